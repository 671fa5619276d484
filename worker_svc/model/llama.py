"""The torch model of every family we run (the Llama lineage with its family options): one
batched forward over sessions of different lengths, paged KV cache.

Tokens of all items are packed along one axis ([T, ...]) for everything that is per token
(projections, RoPE, MLP); only attention needs a per-session layout. A step's items form at
most two attention groups (see ``kv_cache``): prefill chunks (several queries each) and
one-token items (decodes). Each group is one batched matmul, softmax, batched matmul with an
additive mask built once per step, against K/V that the views hand over already batched as
[items x kv heads, S, D], so grouped-query heads never repeat K/V and decodes never pay for a
long prefill chunk's padding.

Weights are prepared once for this forward, not kept in the checkpoint's form:
  * q, k, v projections are one matrix ([q; k; v] rows) and gate, up are one, so a layer is
    four matmuls;
  * q and k rows are permuted within each head from Hugging Face's rotate-half pairing
    (i, i + D/2) to adjacent pairs (2i, 2i + 1), so RoPE is one in-place complex multiply; q
    and k get the same permutation, so every q.k (hence the output) is unchanged, and the KV
    cache holds K in that order;
  * q rows are pre-scaled by the attention scale, 1/sqrt(D) (RoPE is linear, so it commutes);
  * the family options (``LlamaConfig``) are read once here: q/k/v biases (Qwen2) are one
    vector laid out as the qkv rows (permuted and scaled alike); q/k norms (Qwen3) are
    permuted the same way and q's carries the attention scale instead of the q rows (a norm
    after the product would undo it), applied with torch's op on the strided q/k columns;
    the RoPE table holds the family's frequencies and scale (``kvfleet_models.rope``), and
    Gemma's local layers read a second table; a windowed layer reads the step's window masks
    (``StepTensors.window_groups``) over the same cached keys; Gemma's score scale
    (query_pre_attn_scalar^-0.5) replaces 1/sqrt(D) wherever that goes, its sandwich norms
    norm o's and down's outputs before their residual adds (``_residual_``), its embedding
    rows are scaled at lookup and its final logits soft-capped;
  * on a CPU in float32 the matmuls and attention products go to numpy's BLAS with the
    matrix stored [in, out], and small products to torch's MKL (see ``cpu_backend`` for the
    measurements). Elsewhere (bfloat16, GPUs) only torch's matmul with [out, in]. A tied LM
    head is the embedding, not a copy of it;
  * bfloat16 on a CPU is bfloat16 *weights*: the residual stream, norms, RoPE and attention (on
    numpy's BLAS) stay float32 (the KV cache is float16, see below), and each product casts its input to bfloat16
    and its output back. Measured on the 2-core EPYC (smollm2, batch-1 decode step): 35 ms
    with everything in bfloat16 (attention's bfloat16 bmm alone ~3 ms, norms and casts another
    few) against 25 ms this way with oneDNN's packed products (``python -m bench.modes``);
    on GPUs everything stays bfloat16;
  * with ``quant="int8"`` (CPU, float32) every projection and the LM head are int8 weights in
    blocks of 32 with their own scales (``q8``, weight-only: the inputs stay float32); attention, norms and RoPE
    stay float32, attention on numpy's BLAS as in the float32 path. An untied embedding stays
    a float32 table; a tied one is the int8 head alone, a row looked up dequantized and its
    smoothing undone (``ModelWeights.embed_rows``): no float copy beside the packed one.

On a CPU the small ops between the products (the RMS norms, each fused with the residual add
before it, RoPE, a decode group's attention) are hand-fused C (``fused``) where a C
compiler is found, and torch's ops otherwise or with ``fused_ops=False``. A plain float32
stack of small layers (the tiny model) runs a whole step there as one call (``whole_step``:
``runner`` sends it every step of the paged views whose products fit WHOLE_STEP_MACS), each
token a row attending to its item's keys up to its own position, so a prefill's tokens and
decodes go alike. The fused decode
attention reads each item's keys from its window's first (``kv_firsts``, where a sliding
window cuts) to its own position (``kv_lens``), no others. In the rebuild views mode it
reads each item's keys from the paged cache's blocks where they lie, and the queries from the
step's qkv rows, so a decode group's K/V, q and output are never copied (``PagedRows``).
Where torch holds the threads (int8, bfloat16), attention groups of several items run on
torch's bmm, which uses all of them (``use_threads``).

The KV cache is float32, except in the reduced-precision CPU modes (bfloat16, int8, gguf:
``platform.kv_cache_dtype``) where each new K/V is rounded once to float16 as it is stored:
the fused decode attention widens it as it reads, the other paths widen a group's K/V before
their products. Batch-32 decode attention is bound by those bytes.

The step's input tensors (``StepTensors``: token ids, positions, slots, per-group masks) are
built by ``worker_svc.runner`` from the engine's admitted items; this module only consumes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvfleet_models.config import LlamaConfig
from kvfleet_models.gguf_blocks import BlockTensor
from kvfleet_models.rope import rope_frequencies
from worker_svc.kv_cache import AttnGroup, KVViews, PagedKVCache, PagedRows, SlabRows
from worker_svc.model import fused, gguf_quant, int8
from worker_svc.model.cpu_backend import (
    QUANT_MODES,
    QUERY_TILE,
    Matrix,
    attention_core,
    matmul,
    matmul_add_,
    pack_bf16,
    query_tiles,
    torch_rows,
)
from worker_svc.model.fused import DecodeAttention, KVStore
from worker_svc.model.gguf_quant import GGUFKernels, GGUFWeight
from worker_svc.model.weights import LayerWeights, ModelWeights, gate_act_mul, qk_norm_, rms_norm, rope_
from worker_svc.platform import plan_backend, synchronize

# Items in an attention group from which torch's bmm runs it where torch holds the threads
# (``LlamaModel.use_threads``); NEVER: the host path keeps every group.
TORCH_ATTENTION_ITEMS = 2
TORCH_ATTENTION_NEVER = 1 << 62
# Steps as one C call (``LlamaModel.whole_step``) where a step's products are at most this many
# multiply-adds a layer (its rows times a layer's weights and a share of the head's): the C
# loops are no BLAS. ``python -m bench.whole_step`` on the 2-core AVX2 EPYC, decode steps on one
# thread, per-op ms / whole ms: hidden 32 (the tiny model) 6.9x at 1 row, 1.43x at 64, 1.35x at
# 128 (1.3 M), 1.05x at 256 (2.7 M), 1.03x at 384 (4.0 M); hidden 64 8.0x at 1 row, 1.12x at 64
# (2.7 M), 0.94x at 128 (5.4 M); hidden 128 4.5x at 1 row, 1.42x at 8 (1.3 M), 1.29x at 32,
# 0.82x at 64 (10.6 M); hidden 256 2.7x at 1 row, 1.21x at 8 (5.3 M), 0.63x at 32.
WHOLE_STEP_MACS = 1 << 22


@dataclass
class PhaseTimes:
    """Nanoseconds per phase of one forward, summed over layers (host clock)."""

    kv_write_ns: int = 0
    kv_view_prepare_ns: int = 0
    attention_ns: int = 0


@dataclass(frozen=True)
class GroupTensors:
    """One attention group's per-step tensors, shared by every layer."""

    group: AttnGroup
    rows: slice  # the group's tokens in the packed axis
    batch: int  # B: items in the group
    query_len: int  # Q: the group's longest item
    # [T_g] row of each token in the attention-ordered, Q-padded queries [B * Q]; None when
    # that is the identity (one-token items already in attention order).
    pad_index: torch.Tensor | None
    # Additive mask (0 or -inf): [B, Q, S] in attention order, or None when nothing is masked
    # (every item sees all S keys, as in a batch-1 decode).
    mask: np.ndarray | None
    # The mask expanded for ``baddbmm``, [N, G * Q, S] in group order (torch path only).
    bias: torch.Tensor | None
    # One-token items only: [B] int64 keys each item sees, in attention order (the mask as
    # lengths, for the fused decode attention); None when every item sees all S.
    kv_lens: torch.Tensor | None = None
    # ... and where a sliding window cuts, the first key each sees; None: 0.
    kv_firsts: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTensors:
    """Device tensors of one step, built once and shared by every layer."""

    tokens: torch.Tensor  # [T] token ids, items packed in layout order
    positions: torch.Tensor  # [T] absolute position of each token
    slots: torch.Tensor  # [T] paged-cache slot each token's K/V goes to
    # The attention groups' tensors for layers that see every earlier key; () when no layer
    # does (then only ``window_groups``).
    groups: tuple[GroupTensors, ...]
    sample_rows: torch.Tensor  # [N] packed index of the tokens whose logits are wanted
    # The same groups masked to the config's sliding window, for its windowed layers; () when
    # the model has none.
    window_groups: tuple[GroupTensors, ...] = ()


def _pair_order(head_dim: int) -> np.ndarray:
    """[D] the rotate-half dims (i, i + D/2) of a head in adjacent order (2i, 2i + 1)."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def _pair_rows(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows (or bias entries) from rotate-half pairs to adjacent ones."""
    return w.reshape(heads, head_dim, -1)[:, _pair_order(head_dim)].reshape(w.shape)


def _blocks(weights: Mapping[str, np.ndarray | BlockTensor], name: str) -> BlockTensor:
    w = weights.get(name)
    if not isinstance(w, BlockTensor):
        got = "missing" if w is None else "float"
        raise ValueError(
            f"quant=gguf runs on a GGUF's own blocks (kvfleet_models.registry.load_model_blocks): weight {name} is {got}"
        )
    return w


def _gguf_layers(
    cfg: LlamaConfig, weights: Mapping[str, np.ndarray | BlockTensor], kernels: GGUFKernels | None, q_scale: float
) -> list[tuple[Matrix, Matrix, Matrix, Matrix]]:
    """Each layer's (qkv, o, gate_up, down) on the GGUF's blocks: q and k rows pair-permuted as
    the float path permutes them (whole rows move, blocks untouched), q's scale per output row."""

    def mat(parts: list[tuple[BlockTensor, float]]) -> Matrix:
        w = gguf_quant.stack(parts, kernels)
        return Matrix(kn=None, nk=None, gguf=w, shape=(w.out_features, w.in_features))

    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    out = []
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = _blocks(weights, a + "q_proj.weight").take_rows(_pair_rows(np.arange(hq * d), hq, d))
        k = _blocks(weights, a + "k_proj.weight").take_rows(_pair_rows(np.arange(hkv * d), hkv, d))
        out.append(
            (
                mat([(q, q_scale), (k, 1.0), (_blocks(weights, a + "v_proj.weight"), 1.0)]),
                mat([(_blocks(weights, a + "o_proj.weight"), 1.0)]),
                mat([(_blocks(weights, m + "gate_proj.weight"), 1.0), (_blocks(weights, m + "up_proj.weight"), 1.0)]),
                mat([(_blocks(weights, m + "down_proj.weight"), 1.0)]),
            )
        )
    return out


def _gguf_head(
    cfg: LlamaConfig,
    weights: Mapping[str, np.ndarray | BlockTensor],
    kernels: GGUFKernels | None,
    vec: Callable[[np.ndarray], torch.Tensor],
) -> tuple[torch.Tensor | None, Matrix, GGUFWeight | None]:
    """(the float embedding table or None, the head, the embedding's blocks or None) under
    quant="gguf": a tied head is the embedding's blocks, its lookup dequantizing the rows read;
    an untied model's embedding stays in its blocks too where the file quantized it."""
    embed = weights.get("model.embed_tokens.weight")
    head_name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    if head_name != "lm_head.weight" and not cfg.tie_word_embeddings:
        raise KeyError("lm_head.weight is missing and tie_word_embeddings is False")
    head = gguf_quant.stack([(_blocks(weights, head_name), 1.0)], kernels)
    matrix = Matrix(kn=None, nk=None, gguf=head, shape=(head.out_features, head.in_features))
    if head_name != "lm_head.weight":
        return None, matrix, head
    if isinstance(embed, BlockTensor):
        return None, matrix, gguf_quant.stack([(embed, 1.0)], kernels)
    if embed is None:
        raise KeyError("weight model.embed_tokens.weight is missing")
    return vec(np.asarray(embed, dtype=np.float32)), matrix, None


def torch_attention(
    q3: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, mask: np.ndarray | None, group_size: int
) -> torch.Tensor:
    """softmax(q k^T + bias) v on torch's bmm (any device): q3 [N, G*Q, D], kv [2, N, S, D], bias
    [N, G*Q, S]. With a mask ([B, Q, S] on the host, the bias's source) over more than one tile
    of queries, a tile at a time, each over the keys its queries see (``query_tiles``), as
    ``attention_core`` goes."""
    n, rows, d = q3.shape
    q = rows // group_size
    if mask is None or q <= QUERY_TILE:
        return _softmax_products(q3, kv[0], kv[1], bias)
    q4, b4 = q3.reshape(n, group_size, q, d), bias.reshape(n, group_size, q, -1)  # G*Q is G-major
    out = q3.new_empty((n, group_size, q, d))
    for t0, t1, s in query_tiles(mask):
        t = t1 - t0
        qt = q4[:, :, t0:t1].reshape(n, group_size * t, d)
        bt = b4[:, :, t0:t1, :s].reshape(n, group_size * t, s)
        out[:, :, t0:t1] = _softmax_products(qt, kv[0][:, :s], kv[1][:, :s], bt).view(n, group_size, t, d)
    return out.view(n, rows, d)


def _softmax_products(q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    scores = torch.baddbmm(bias, q3, k.transpose(1, 2))  # [N, G*Q, S]
    if scores.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q3.dtype)
    return torch.bmm(probs, v)  # [N, G*Q, D]


class LlamaModel:
    """Weights as device tensors plus the forward; the KV cache is attached from outside."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: Mapping[str, np.ndarray | BlockTensor],
        device: torch.device,
        dtype: torch.dtype,
        host_blas: bool | None = None,
        quant: str = "none",
        fused_ops: bool | None = None,
        torch_copy: bool = True,
        whole_steps: bool = True,
    ) -> None:
        """host_blas: None = numpy's BLAS exactly when float32 on a CPU (False forces torch's
        path, which GPUs take, so that a CPU-only test can check it).
        torch_copy: on the host BLAS path, also keep each matrix's [out, in] copy for the row
        counts torch runs faster on one thread (``cpu_backend.TORCH_ROWS``); False: torch reads
        the [in, out] copy transposed, and the weights live once (with more than one thread
        every product goes to the host BLAS anyway).
        quant: "none", "int8" (float32 on a CPU only: ``q8``'s int8 products) or "gguf"
        (the same, on a GGUF's own blocks: ``weights`` from ``load_model_blocks``).
        fused_ops: None = the hand-fused C ops (``fused``) on a CPU where they build; False =
        torch's ops only; True = required (an error where they cannot be built).
        whole_steps: a step as one C call where the model allows it (``whole_step_fits``);
        False, or KVFLEET_WHOLE_STEPS=0 in the environment, keeps every step on the per-op path."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        if quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
        # Dtypes and kernels, decided once (worker_svc/platform.py): the residual stream,
        # norms and attention are float32 on a CPU whatever the weights (module docstring).
        self.plan = plan_backend(device, dtype, quant, host_blas, fused_ops)
        self.act_dtype = self.plan.act_dtype
        self.quant = quant

        def array(name: str) -> np.ndarray:
            if name not in weights:
                raise KeyError(f"weight {name} is missing")
            w = weights[name]
            if isinstance(w, BlockTensor):  # a GGUF's blocks served as floats (not quant="gguf")
                return w.dequantize()
            return np.asarray(w, dtype=np.float32)

        def put(a: np.ndarray, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device, dtype)

        def put_t(a: np.ndarray) -> torch.Tensor:
            """``a.T``, contiguous: torch's blocked transpose (numpy's copy of a transposed view
            took 250 ms for SmolLM2's 49152 x 576 head on the Xeon, torch's 67 ms)."""
            return put(a).t().contiguous()

        def vec(a: np.ndarray) -> torch.Tensor:
            return put(a, self.act_dtype)

        # numpy's BLAS for float32 on a CPU (see ``cpu_backend``), and for attention on every
        # CPU path; torch elsewhere.
        self.host_blas = self.plan.host_blas
        self.host_attention = self.plan.host_attention
        # Attention groups of at least this many items run on torch's bmm (and so get a
        # ``bias``) even on the host path: see ``use_threads``.
        self.torch_attention_items = TORCH_ATTENTION_NEVER
        self.torch_decode_items = TORCH_ATTENTION_NEVER  # the same, for one-token groups
        # Row counts of a product that go to torch even on the host BLAS path.
        self.torch_rows = torch_rows(self.host_blas, threads=1)

        cpu_bf16 = self.plan.onednn_bf16

        def matrix(a: np.ndarray, lookup: bool = False) -> Matrix:
            """a: [out, in] as in the checkpoint; lookup: also the embedding table (tied)."""
            if self.host_blas and not torch_copy:
                kn = put_t(a)
                return Matrix(kn=kn, nk=kn.t(), shape=a.shape)  # one copy: torch reads it transposed
            nk = put(a)
            dnn = pack_bf16(nk) if cpu_bf16 else None
            if dnn is not None:  # oneDNN's copy replaces torch's, unless rows are looked up
                return Matrix(kn=None, nk=nk if lookup else None, dnn=dnn, shape=a.shape)
            return Matrix(kn=put_t(a) if self.host_blas else None, nk=nk, shape=a.shape)

        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        # The attention scale (head_dim^-0.5, Gemma's query_pre_attn_scalar^-0.5) goes into q's
        # rows, or into q's norm where the family normalises q (a norm after the product would
        # undo a scale in the rows).
        scale = cfg.attention_scale
        row_scale = 1.0 if cfg.qk_norm else scale
        # The MLP's input norm: Llama's post_attention_layernorm; with Gemma's sandwich norms
        # that name is the attention output's norm and pre_feedforward_layernorm the MLP's.
        mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"

        def sandwich(name: str) -> torch.Tensor | None:
            return vec(array(name)) if cfg.sandwich_norms else None

        # quant="gguf": the products' kernels (their level reported at start-up) and each
        # layer's (qkv, o, gate_up, down) on the file's own blocks.
        self.gguf_kernels = ""
        gguf_layers: list[tuple[Matrix, Matrix, Matrix, Matrix]] = []
        gguf_kernels: GGUFKernels | None = None
        if quant == "gguf":
            gguf_kernels = gguf_quant.load_kernels()
            self.gguf_kernels = gguf_kernels.level if gguf_kernels is not None else "torch"
            gguf_layers = _gguf_layers(cfg, weights, gguf_kernels, row_scale)
        table: torch.Tensor | None

        layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if quant == "gguf":  # the file's blocks, rows permuted and stacked as below
                qkv, o, gate_up, down = gguf_layers[i]
            else:
                q = _pair_rows(array(a + "q_proj.weight"), hq, d) * row_scale
                k = _pair_rows(array(a + "k_proj.weight"), hkv, d)
                qkv = matrix(np.concatenate([q, k, array(a + "v_proj.weight")]))
                o = matrix(array(a + "o_proj.weight"))
                gate_up = matrix(np.concatenate([array(p + "mlp.gate_proj.weight"), array(p + "mlp.up_proj.weight")]))
                down = matrix(array(p + "mlp.down_proj.weight"))
            bias = None
            if cfg.qkv_bias:  # laid out as the rows: pair-permuted, q's scaled alike
                qb = _pair_rows(array(a + "q_proj.bias"), hq, d) * row_scale
                kb = _pair_rows(array(a + "k_proj.bias"), hkv, d)
                bias = vec(np.concatenate([qb, kb, array(a + "v_proj.bias")]))
            q_norm = k_norm = None
            if cfg.qk_norm:
                q_norm = vec(array(a + "q_norm.weight")[_pair_order(d)] * scale)
                k_norm = vec(array(a + "k_norm.weight")[_pair_order(d)])
            layers.append(
                LayerWeights(
                    input_norm=vec(array(p + "input_layernorm.weight")),
                    qkv=qkv,
                    o=o,
                    post_norm=vec(array(p + mlp_norm + ".weight")),
                    gate_up=gate_up,
                    down=down,
                    qkv_bias=bias,
                    q_norm=q_norm,
                    k_norm=k_norm,
                    attn_out_norm=sandwich(p + "post_attention_layernorm.weight"),
                    mlp_out_norm=sandwich(p + "post_feedforward_layernorm.weight"),
                )
            )
        # Keys each layer's queries see (0: all before them): layers pick their groups' masks.
        self.windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
        self.local_layers = tuple(cfg.local_rope(i) for i in range(cfg.num_layers))  # Gemma's local RoPE
        self.tied_head = "lm_head.weight" not in weights
        # quant="gguf": the embedding rows looked up from their blocks, one row at a time.
        self.embed_blocks: GGUFWeight | None = None
        if quant == "gguf":
            table, lm_head, self.embed_blocks = _gguf_head(cfg, weights, gguf_kernels, vec)
        elif "lm_head.weight" in weights:
            embed = array("model.embed_tokens.weight")  # [V, hidden]
            table = vec(embed)
            lm_head = matrix(array("lm_head.weight"))
        elif cfg.tie_word_embeddings:
            # The head's copies are the embedding: the lookup reads a few of the [V, hidden] rows
            # (an int8 head has no float copy to read: ``int8.quantize`` keeps the table).
            table = None
            lm_head = matrix(array("model.embed_tokens.weight"), lookup=True)
        else:
            raise KeyError("lm_head.weight is missing and tie_word_embeddings is False")

        # scale * e^(i * angle) for every position and pair, complex64 whatever the model
        # dtype: RoPE is applied in float32 and rounded once, as precision of the angle matters
        # at long positions. The frequencies and scale are the family's (``rope_frequencies``:
        # yarn's scale multiplies cos and sin, so both q and k). Gemma's local layers have a
        # table of their own.
        def rotary(local: bool) -> torch.Tensor:
            inv_freq_np, rope_scale = rope_frequencies(cfg, local)
            angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * torch.from_numpy(inv_freq_np)
            return torch.polar(torch.full_like(angles, rope_scale), angles).to(device, torch.complex64)

        # Gemma's sqrt(hidden), rounded to the weights' dtype as transformers rounds it to its embedding's.
        embed_scale = torch.tensor(cfg.embed_multiplier, dtype=dtype, device=device) if cfg.scaled_embedding else None
        prepared = ModelWeights(
            layers,
            vec(array("model.norm.weight")),
            table,
            lm_head,
            rotary(False),
            local_rotary=rotary(True) if any(self.local_layers) else None,
            embed_scale=embed_scale,
        )
        # The int8 products' kernel level ("" unless int8; "torch" where the C kernels could
        # not be built): reported in the worker's start line.
        self.int8_kernels = ""
        if quant == "int8":  # a transform of the weights, calibrated on torch's reference ops
            prepared, self.int8_kernels = int8.quantize(cfg, prepared)  # float -> smoothed int8
        self.layers, self.norm, self.embed = prepared.layers, prepared.norm, prepared.embed
        self.lm_head, self.rotary, self.local_rotary = prepared.lm_head, prepared.rotary, prepared.local_rotary
        self.embed_scale = prepared.embed_scale
        self._weights = prepared  # its embed_rows: the lookup of a float table or an int8 tied head
        self.fused: fused.FusedOps | None = None
        # The C ops work on float32 CPU tensors: every CPU mode's activations are float32.
        if self.plan.fused_ops:
            self.fused = fused.load()
            if self.fused is None and fused_ops:
                raise RuntimeError("fused CPU ops were required but could not be built (see the log)")
        # A step of a plain stack of small layers as one C call (``fused.DecodeStack``).
        # A step's multiply-adds a row and layer in the products (the head's spread over the layers).
        self._row_macs = sum(m.numel for m in self.layers[0].matrices()) + self.lm_head.numel / cfg.num_layers
        self.decode_stack = (
            self._decode_stack() if whole_steps and os.environ.get("KVFLEET_WHOLE_STEPS") != "0" else None
        )

    def _decode_stack(self) -> fused.DecodeStack | None:
        """The weights for ``FusedOps.decode_step``, or None where it does not apply: it needs the
        C ops, float32 [in, out] copies of every product (the host BLAS path's), a plain Llama
        layer (no biases, q/k or sandwich norms, windows, local RoPE, logit cap or embedding
        scale; SiLU) and a row within WHOLE_STEP_MACS: small layers, whose steps are their
        dispatches, not their arithmetic."""
        cfg = self.cfg
        if self.fused is None or self.act_dtype != torch.float32 or not self.host_attention:
            return None
        if cfg.hidden_act != "silu" or cfg.final_logit_softcap or any(self.windows) or any(self.local_layers):
            return None
        if self._row_macs > WHOLE_STEP_MACS:
            return None

        def kn(m: Matrix) -> torch.Tensor | None:
            ok = m.kn is not None and m.kn.dtype == torch.float32 and m.kn.is_contiguous()
            return m.kn if ok else None

        layers = []
        for w in self.layers:
            if any(v is not None for v in (w.qkv_bias, w.q_norm, w.attn_out_norm, w.mlp_out_norm)):
                return None
            qkv, o, gate_up, down = (kn(m) for m in w.matrices())
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            layers.append((w.input_norm, qkv, o, w.post_norm, gate_up, down))
        head = kn(self.lm_head)
        # The lookup's table: the embedding, or a tied head's copy read by columns.
        embed = self.embed if self.embed is not None else None if head is None else head.t()
        if head is None or embed is None or self.embed_scale is not None:
            return None
        return fused.DecodeStack(
            layers, self.norm, head, embed, self.rotary, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        )

    def whole_step_fits(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens runs as one C call (``whole_step``): the model has a
        ``decode_stack`` and the step's products stay small (WHOLE_STEP_MACS)."""
        return self.decode_stack is not None and rows * self._row_macs <= WHOLE_STEP_MACS

    def whole_step(self, cache: PagedKVCache, rows: fused.StepRows, times: PhaseTimes) -> torch.Tensor:
        """A step as one C call (``FusedOps.decode_step``, where ``whole_step_fits``): every token
        a row of its own (``rows``), attending to its item's keys up to its own position through
        its item's blocks (causal for a prefill's tokens, whose K/V are written first). Returns
        the float32 logits [T, V] of every row."""
        assert self.fused is not None and self.decode_stack is not None
        out = self.fused.decode_step(self.decode_stack, cache.kv, rows)
        times.kv_write_ns += out.kv_write_ns
        times.attention_ns += out.attention_ns
        return out.logits

    @property
    def kernel_level(self) -> str:
        """The quantized products' kernel level ("" for float weights), for the start line."""
        return self.int8_kernels or self.gguf_kernels

    def use_threads(self, n: int) -> None:
        """With the host BLAS on ``n`` > 1 threads, every product goes to it: MKL would run on
        torch's single thread (see ``cpu_backend.use_cpu_threads``)."""
        self.torch_rows = torch_rows(self.host_blas, n)
        # Where torch holds the threads (int8, bfloat16), its bmm runs attention's products
        # on all of them, numpy's on one. Measured on decode groups before the fused attention
        # took those (smollm2 int8, 2 threads, 100-250-token contexts): 32 items 51-54 ms of
        # attention a step -> 35, 8 items 13.3 -> 9.0; it now applies to prefill groups.
        parallel = self.host_attention and not self.host_blas and n > 1
        self.torch_attention_items = TORCH_ATTENTION_ITEMS if parallel else TORCH_ATTENTION_NEVER
        # A decode group goes to the fused attention where there is one: it reads each item's
        # own keys only (torch's bmm computes the padded S) and shares its rows among torch's
        # threads. Measured in a step (32 decodes of 100-250-token contexts, int8, 2 threads):
        # attention 29.9 ms on torch's bmm, 26.3 fused; 8 decodes 8.0 and 6.6 ms.
        self.torch_decode_items = TORCH_ATTENTION_NEVER if self.fused is not None else self.torch_attention_items

    def sizes(self) -> tuple[int, int]:
        """(parameters, bytes) of the weights, each distinct parameter counted once: a tied
        head is the embedding's parameters (its bytes every copy it is held in: under bfloat16 on a
        CPU the rows plus oneDNN's; under int8 the one int8 copy, whose rows the lookup reads)."""
        matrices = [self.lm_head] + [m for layer in self.layers for m in layer.matrices()]
        vectors = [self.norm] + [v for layer in self.layers for v in layer.vectors()]
        params = sum(m.numel for m in matrices) + sum(v.numel() for v in vectors)
        nbytes = sum(m.nbytes for m in matrices) + sum(v.numel() * v.element_size() for v in vectors)
        head = self.lm_head
        if self.embed is None and head.dnn is not None and head.nk is not None:
            nbytes += head.nk.numel() * head.nk.element_size()  # a tied head's rows beside oneDNN's copy
        if self.embed is not None:
            nbytes += self.embed.numel() * self.embed.element_size()
            if not self.tied_head:
                params += self.embed.numel()
        elif self.embed_blocks is not None and not self.tied_head:  # quant="gguf", untied
            nbytes += self.embed_blocks.nbytes
            params += self.embed_blocks.out_features * self.embed_blocks.in_features
        return params, nbytes

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_blocks is None:  # a float table, or int8's tied head: only these rows read
            return self._weights.embed_rows(tokens).to(self.act_dtype)  # [T, hidden]
        rows = self.embed_blocks.rows(tokens)  # quant="gguf": only these rows dequantized
        if self.embed_scale is not None:  # Gemma: in the table's dtype, as transformers
            rows = rows * self.embed_scale.to(rows.dtype)
        return rows.to(self.act_dtype)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x.contiguous(), w, self.cfg.rms_norm_eps)
        return rms_norm(x, w, self.cfg.rms_norm_eps)

    def _add_rms_norm_(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h += y in place; returns rms_norm(h) * w."""
        if self.fused is not None:
            return self.fused.add_rms_norm_(h, y.contiguous(), w, self.cfg.rms_norm_eps)
        h.add_(y)
        return self._rms_norm(h, w)

    def _residual_(
        self, h: torch.Tensor, x: torch.Tensor, m: Matrix, out_norm: torch.Tensor | None, following: torch.Tensor | None
    ) -> torch.Tensor | None:
        """h += x @ m, normed first by ``out_norm`` where the family has one (Gemma's sandwich
        norms: before the add, so the add cannot fuse with the product); returns h's norm by
        ``following`` (None: not wanted). The add fuses with that norm where the C ops are on."""
        if out_norm is None and self.fused is None:
            matmul_add_(h, x, m, self.torch_rows)
            return None if following is None else self._rms_norm(h, following)
        y = matmul(x, m, self.torch_rows)
        if out_norm is not None:
            y = self._rms_norm(y, out_norm)
        if following is None:
            h.add_(y)
            return None
        return self._add_rms_norm_(h, y, following)

    def _rope_(self, qkv: torch.Tensor, rot: torch.Tensor) -> None:
        """Rotate the q and k columns of qkv [T, (Hq + 2 Hkv) * D] in place; rot: [T, 1, D/2]
        (contiguous)."""
        cfg = self.cfg
        if self.fused is not None and qkv.stride(1) == 1:
            self.fused.rope_(qkv, rot, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim // 2)
            return
        rope_(qkv, rot, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)

    def _new_kv(self, qkv: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """The step's new K and V [T, 2, Hkv, D] (qkv's columns after the queries'), in the
        cache's dtype (a float16 cache, ``platform.kv_cache_dtype``: one rounding)."""
        cfg = self.cfg
        kv = qkv[:, cfg.num_heads * cfg.head_dim :].view(qkv.shape[0], 2, cfg.num_kv_heads, cfg.head_dim)
        return kv if kv.dtype == cache.kv.dtype else kv.to(cache.kv.dtype)

    def _fused_decode(
        self, plans: dict[int, DecodeAttention], gt: GroupTensors, q: torch.Tensor, kv: torch.Tensor, *args: Any
    ) -> torch.Tensor:
        """The fused decode attention, its plan made on a step's first layer and reused by the
        others (``plans``: the step's, by group)."""
        assert self.fused is not None
        plan = plans.get(id(gt))
        if plan is None or not plan.matches(q, kv, *args):
            plan = plans[id(gt)] = self.fused.decode_attention_plan(q, kv, *args)
        return plan(q, kv)

    def _attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor | SlabRows | PagedRows,
        gt: GroupTensors,
        plans: dict[int, DecodeAttention],
    ) -> torch.Tensor:
        """q: [T_g, Hq * D] the group's queries; kv: [2, N, S, D], or the persistent slab's rows,
        or the paged cache's blocks (either read in place by the fused decode path, gathered for
        the others). Returns [T_g, Hq * D]. ``plans``: the step's fused decode plans."""
        cfg = self.cfg
        hkv, d = cfg.num_kv_heads, cfg.head_dim
        g, b, n = cfg.num_heads // hkv, gt.batch, gt.query_len
        torch_items = self.torch_attention_items if n > 1 else self.torch_decode_items
        use_torch = gt.bias is not None and (b >= torch_items or not self.host_attention)
        fused_decode = (
            not use_torch and self.fused is not None and n == 1 and (gt.mask is None or gt.kv_lens is not None)
        )
        if fused_decode and isinstance(kv, PagedRows) and gt.pad_index is None:
            # The paged cache read in place, and q too (its rows in qkv, heads in bh order, any
            # order being the kernel's to choose here): no copy of q, K/V or the output.
            return self._fused_decode(plans, gt, q, kv.kv, gt.kv_lens, True, b, hkv, None, kv.table, gt.kv_firsts)
        rows: torch.Tensor | None = None
        if isinstance(kv, SlabRows) and fused_decode and gt.group.order == "bh":
            rows, kv = kv.rows, kv.slab
        elif not isinstance(kv, torch.Tensor):
            kv = kv.merged()
        if kv.dtype != q.dtype and not (fused_decode and self.fused is not None and kv.dtype in self.fused.kv_dtypes):
            kv = kv.to(q.dtype)  # a float16 cache read by torch's or numpy's products: widened
        if gt.pad_index is not None:
            q = q.new_zeros((b * n, q.shape[1])).index_copy_(0, gt.pad_index, q)
        q5 = q.view(b, n, hkv, g, d)
        if gt.group.order == "bh":
            q3 = q5.permute(0, 2, 3, 1, 4).reshape(b * hkv, g * n, d)  # [B*Hkv, G*Q, D]
        else:
            q3 = q5.permute(2, 0, 3, 1, 4).reshape(hkv * b, g * n, d)  # [Hkv*B, G*Q, D]
        if use_torch:
            assert gt.bias is not None
            o3 = torch_attention(q3, kv, gt.bias, gt.mask, g)
        elif fused_decode:
            o3 = self._fused_decode(
                plans, gt, q3.contiguous(), kv, gt.kv_lens, gt.group.order == "bh", b, hkv, rows, None, gt.kv_firsts
            )
        elif self.host_attention:
            o3 = attention_core(q3, kv, gt.mask, gt.group.order, b, n, hkv, g)  # [N, G*Q, D]
        else:
            assert gt.bias is not None
            o3 = torch_attention(q3, kv, gt.bias, gt.mask, g)
        if gt.group.order == "bh":
            o = o3.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4)
        else:
            o = o3.view(hkv, b, g, n, d).permute(1, 3, 0, 2, 4)
        o = o.reshape(b * n, hkv * g * d)  # [B*Q, Hq*D]
        return o if gt.pad_index is None else o.index_select(0, gt.pad_index)

    @torch.inference_mode()
    def forward(
        self, st: StepTensors, cache: PagedKVCache, views: KVViews, times: PhaseTimes, sync: bool = False
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [N, V] of the ``sample_rows`` tokens.

        ``sync``: wait for the device at each phase boundary, so ``times`` measures device work.
        """

        def clock() -> int:
            if sync:
                synchronize(self.device)
            return time.perf_counter_ns()

        cfg = self.cfg
        t, q_width = st.tokens.shape[0], cfg.num_heads * cfg.head_dim
        inter = cfg.intermediate_size
        h = self._embed(st.tokens)  # [T, hidden]
        rot = self.rotary.index_select(0, st.positions).unsqueeze(1)  # [T, 1, D/2]
        # Gemma's local layers' table ([T, 1, D/2]); the global one where there is none.
        rot_local = rot if self.local_rotary is None else self.local_rotary.index_select(0, st.positions).unsqueeze(1)
        x = self._rms_norm(h, self.layers[0].input_norm)
        plans: dict[int, DecodeAttention] = {}  # the fused decode attention's, by group: made once a step
        store: KVStore | None = None  # the fused K/V write into the cache: made once a step
        for i, w in enumerate(self.layers):
            qkv = matmul(x, w.qkv, self.torch_rows)  # [T, (Hq+2Hkv)*D]
            if w.qkv_bias is not None:
                qkv.add_(w.qkv_bias)
            if w.q_norm is not None:
                qk_norm_(qkv, w, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps)
            self._rope_(qkv, rot_local if self.local_layers[i] else rot)
            t0 = clock()
            kv = None
            if self.fused is not None:  # one C call, its checks made on the step's first layer
                if store is None or not store.fits(qkv):
                    store = self.fused.kv_store_plan(cache.kv, st.slots, qkv, q_width)
                store(i, qkv)
            else:
                kv = self._new_kv(qkv, cache)
                cache.write(i, st.slots, kv)
            t1 = clock()
            if views.copies_new_tokens:
                views.append(i, kv if kv is not None else self._new_kv(qkv, cache))
            groups = st.window_groups if self.windows[i] else st.groups  # the layer's masks
            group_kv = [views.keys_values(i, j) for j in range(len(groups))]
            t2 = clock()
            if len(groups) == 1:
                attn = self._attention(qkv[:, :q_width], group_kv[0], groups[0], plans)
            else:
                attn = qkv.new_empty((t, q_width))
                for gt, kv_g in zip(groups, group_kv):
                    attn[gt.rows] = self._attention(qkv[gt.rows, :q_width], kv_g, gt, plans)
            t3 = clock()
            times.kv_write_ns += t1 - t0
            times.kv_view_prepare_ns += t2 - t1
            times.attention_ns += t3 - t2

            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            x_mlp = self._residual_(h, attn, w.o, w.attn_out_norm, w.post_norm)
            assert x_mlp is not None
            gate_up = matmul(x_mlp, w.gate_up, self.torch_rows)  # [T, 2 * inter]
            x_next = self._residual_(h, gate_act_mul(gate_up, inter, cfg.hidden_act), w.down, w.mlp_out_norm, following)
            if x_next is not None:
                x = x_next
        last = self._rms_norm(h.index_select(0, st.sample_rows), self.norm)  # [N, hidden]
        logits = matmul(last, self.lm_head, self.torch_rows).float()  # [N, V]
        if cfg.final_logit_softcap:  # Gemma: cap * tanh(logits / cap)
            cap = cfg.final_logit_softcap
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits
