"""The torch Llama: one batched forward over sessions of different lengths, paged KV cache.

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
  * q rows are pre-scaled by 1/sqrt(D), the attention scale (RoPE is linear, so it commutes);
  * on a CPU in float32 the matmuls go to numpy's BLAS (OpenBLAS) with the matrix stored
    [in, out]: measured on a 2-core AMD EPYC, that streams the weights of a batch-1 decode about
    1.8x faster than torch's MKL does with either layout, and is on par or faster from 16 rows
    (see bench/README.md); products of 2-12 rows, where MKL is 15-27 % faster, use a second,
    [out, in] copy (so the host holds the weights twice). Elsewhere (bfloat16, GPUs) only torch's
    matmul with [out, in], which its bfloat16 CPU kernels run 1.4-1.5x faster than [in, out]. A
    tied LM head is the embedding, not a copy of it.
"""
from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from worker_svc.kv_cache import AttnGroup, BatchLayout, KVViews, PagedKVCache
from kvfleet_models.config import LlamaConfig


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
    rows: slice                     # the group's tokens in the packed axis
    batch: int                      # B: items in the group
    query_len: int                  # Q: the group's longest item
    # [T_g] row of each token in the attention-ordered, Q-padded queries [B * Q]; None when
    # that is the identity (one-token items already in attention order).
    pad_index: torch.Tensor | None
    # Additive mask (0 or -inf): [B, Q, S] in attention order, or None when nothing is masked
    # (every item sees all S keys, as in a batch-1 decode).
    mask: np.ndarray | None
    # The mask expanded for ``baddbmm``, [N, G * Q, S] in group order (torch path only).
    bias: torch.Tensor | None


@dataclass(frozen=True)
class StepTensors:
    """Device tensors of one step, built once and shared by every layer."""

    tokens: torch.Tensor      # [T] token ids, items packed in layout order
    positions: torch.Tensor   # [T] absolute position of each token
    slots: torch.Tensor       # [T] paged-cache slot each token's K/V goes to
    groups: tuple[GroupTensors, ...]
    sample_rows: torch.Tensor  # [N] packed index of the tokens whose logits are wanted


def _group_tensors(g: AttnGroup, layout: BatchLayout, offsets: np.ndarray, num_kv_heads: int,
                   group_size: int, dtype: torch.dtype, device: torch.device,
                   host_blas: bool) -> GroupTensors:
    items = list(g.items)
    starts = np.array([layout.starts[i] for i in items])
    lengths = np.array([layout.lengths[i] for i in items])
    b, q, s = len(items), int(lengths.max()), g.kv_len
    att = np.arange(b) if g.perm is None else np.array(g.perm)   # attention row of each item
    pad_index = None
    if q > 1 or g.perm is not None:
        pad_index = torch.from_numpy(np.concatenate(
            [r * q + np.arange(n) for r, n in zip(att, lengths)])).to(device)
    # Query i of an item sits at position start + i; a padding query (i >= n) copies the last
    # real query's mask so that no row is all-masked (which would make NaNs, harmless but noisy).
    query_pos = np.empty((b, q), dtype=np.int64)
    query_pos[att] = starts[:, None] + np.minimum(np.arange(q)[None, :], lengths[:, None] - 1)
    allowed = np.arange(s)[None, None, :] <= query_pos[:, :, None]              # [B, Q, S]
    mask = None if allowed.all() else np.where(allowed, 0.0, -np.inf).astype(np.float32)
    bias = None
    if not host_blas:
        m = torch.zeros((b, q, s)) if mask is None else torch.from_numpy(mask)
        m = m.to(device, dtype)
        if g.order == "bh":
            m = m.view(b, 1, 1, q, s).expand(b, num_kv_heads, group_size, q, s)
        else:
            m = m.view(1, b, 1, q, s).expand(num_kv_heads, b, group_size, q, s)
        bias = m.reshape(b * num_kv_heads, group_size * q, s)
    start, stop = int(offsets[items[0]]), int(offsets[items[-1] + 1])
    return GroupTensors(group=g, rows=slice(start, stop), batch=b, query_len=q,
                        pad_index=pad_index, mask=mask, bias=bias)


def step_tensors(cfg: LlamaConfig, layout: BatchLayout, groups: list[AttnGroup],
                 tokens: list[int], slots: list[int], sample_items: list[int],
                 dtype: torch.dtype, device: torch.device, host_blas: bool = False) -> StepTensors:
    """Host-side preparation of a step: index tensors and per-group masks."""
    lengths = np.asarray(layout.lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.repeat(np.asarray(layout.starts) - offsets[:-1], lengths) + np.arange(offsets[-1])

    def dev(a: object) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

    g = cfg.num_heads // cfg.num_kv_heads
    return StepTensors(
        tokens=dev(tokens), positions=dev(positions), slots=dev(slots),
        groups=tuple(_group_tensors(x, layout, offsets, cfg.num_kv_heads, g, dtype, device, host_blas)
                     for x in groups),
        sample_rows=dev(offsets[np.asarray(sample_items, dtype=np.int64) + 1] - 1))


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on cpu, where ops run eagerly)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


# Row counts of a product that torch's MKL runs faster than numpy's OpenBLAS on one CPU thread
# (15-27 % at 4-12 rows, measured on the 2-core AMD EPYC; OpenBLAS wins at 1 row by 1.7x and is
# on par or ahead from 16 rows): for those the host keeps a second, [out, in] copy of every
# matrix. Only with one thread: torch (hence MKL) runs single-threaded beside the host BLAS.
_TORCH_ROWS = range(2, 13)


@dataclass(frozen=True)
class Matrix:
    """One weight matrix in the layouts its products use: ``kn`` [in, out] for numpy's BLAS
    (host BLAS only), ``nk`` [out, in] for torch (always)."""

    kn: torch.Tensor | None
    nk: torch.Tensor

    @property
    def param(self) -> torch.Tensor:
        """The copy that counts as the parameter (sizes are reported once)."""
        return self.kn if self.kn is not None else self.nk


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor    # [hidden]
    qkv: Matrix                 # hidden -> (Hq + 2 Hkv) * D, q/k pair-permuted, q pre-scaled
    o: Matrix                   # Hq * D -> hidden
    post_norm: torch.Tensor     # [hidden]
    gate_up: Matrix             # hidden -> 2 * intermediate
    down: Matrix                # intermediate -> hidden

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_norm, self.qkv.param, self.o.param, self.post_norm,
                self.gate_up.param, self.down.param]


def set_host_blas_threads(n: int) -> bool:
    """Set the thread count of numpy's bundled OpenBLAS (its pool is separate from torch's);
    returns whether a library was found. numpy has no API for it, hence ctypes."""
    found = False
    libs = Path(np.__file__).parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")) if libs.is_dir() else []:
        lib = ctypes.CDLL(str(path))
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                found = True
                break
    return found


def _pair_rows(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows from rotate-half pairs (i, i + D/2) to adjacent (2i, 2i + 1)."""
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)
    return w.reshape(heads, head_dim, -1)[:, order].reshape(w.shape)


class LlamaModel:
    """Weights as device tensors plus the forward; the KV cache is attached from outside."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, np.ndarray], device: torch.device,
                 dtype: torch.dtype, host_blas: bool | None = None) -> None:
        """host_blas: None = numpy's BLAS exactly when float32 on a CPU (False forces torch's
        path, which GPUs take, so that a CPU-only test can check it)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def array(name: str) -> np.ndarray:
            if name not in weights:
                raise KeyError(f"weight {name} is missing")
            return np.asarray(weights[name], dtype=np.float32)

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device, dtype)

        # numpy's BLAS for float32 on a CPU (see the module docstring); torch elsewhere.
        cpu_f32 = device.type == "cpu" and dtype == torch.float32
        if host_blas and not cpu_f32:
            raise ValueError("host_blas needs float32 weights on a CPU")
        self.host_blas = cpu_f32 if host_blas is None else host_blas
        self.torch_rows = _TORCH_ROWS if self.host_blas else range(0)

        def matrix(a: np.ndarray) -> Matrix:
            """a: [out, in] as in the checkpoint."""
            return Matrix(kn=put(a.T) if self.host_blas else None, nk=put(a))

        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q = _pair_rows(array(p + "self_attn.q_proj.weight"), hq, d) / math.sqrt(d)
            k = _pair_rows(array(p + "self_attn.k_proj.weight"), hkv, d)
            self.layers.append(LayerWeights(
                input_norm=put(array(p + "input_layernorm.weight")),
                qkv=matrix(np.concatenate([q, k, array(p + "self_attn.v_proj.weight")])),
                o=matrix(array(p + "self_attn.o_proj.weight")),
                post_norm=put(array(p + "post_attention_layernorm.weight")),
                gate_up=matrix(np.concatenate([array(p + "mlp.gate_proj.weight"),
                                               array(p + "mlp.up_proj.weight")])),
                down=matrix(array(p + "mlp.down_proj.weight"))))
        self.norm = put(array("model.norm.weight"))
        embed = array("model.embed_tokens.weight")                        # [V, hidden]
        if "lm_head.weight" in weights:
            self.embed: torch.Tensor | None = put(embed)
            self.lm_head = matrix(array("lm_head.weight"))
        elif cfg.tie_word_embeddings:
            # The head's copies are the embedding: the lookup reads a few of the [V, hidden] rows.
            self.embed = None
            self.lm_head = matrix(embed)
        else:
            raise KeyError("lm_head.weight is missing and tie_word_embeddings is False")
        # e^(i * angle) for every position and pair, complex64 whatever the model dtype: RoPE
        # is applied in float32 and rounded once, as precision of the angle matters at long
        # positions.
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv_freq
        self.rotary = torch.polar(torch.ones_like(angles), angles).to(device, torch.complex64)

    def use_threads(self, n: int) -> None:
        """With the host BLAS on ``n`` > 1 threads, every product goes to it: MKL would run on
        torch's single thread (see ``engine.use_cpu_threads``)."""
        if self.host_blas:
            self.torch_rows = _TORCH_ROWS if n == 1 else range(0)

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct weight tensor (a tied head counted once)."""
        out = [self.lm_head.param, self.norm]
        for layer in self.layers:
            out.extend(layer.tensors())
        if self.embed is not None:
            out.append(self.embed)
        return out

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed if self.embed is not None else self.lm_head.nk
        return table.index_select(0, tokens)                               # [T, hidden]

    def _matmul(self, x: torch.Tensor, w: Matrix) -> torch.Tensor:
        """x [M, in] times w -> [M, out]."""
        if w.kn is not None and x.shape[0] not in self.torch_rows:
            return torch.from_numpy(np.matmul(x.numpy(), w.kn.numpy()))
        return x @ w.nk.t()

    def _matmul_add_(self, h: torch.Tensor, x: torch.Tensor, w: Matrix) -> None:
        """h += x times w, in place."""
        if w.kn is not None and x.shape[0] not in self.torch_rows:
            hn = h.numpy()
            np.add(hn, np.matmul(x.numpy(), w.kn.numpy()), out=hn)
        else:
            h.addmm_(x, w.nk.t())

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Computed in float32 (torch's kernel upcasts half types), as HF does.
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    def _rope_(self, qkv: torch.Tensor, rot: torch.Tensor) -> None:
        """Rotate the q and k columns of qkv [T, (Hq + 2 Hkv) * D] in place; rot: [T, 1, D/2]."""
        cfg = self.cfg
        t, width = qkv.shape[0], (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        qk = qkv[:, :width].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim // 2, 2)
        if self.dtype == torch.float32:
            torch.view_as_complex(qk).mul_(rot)
        else:
            rotated = torch.view_as_complex(qk.float()) * rot
            qk.copy_(torch.view_as_real(rotated))

    def _attention(self, q: torch.Tensor, kv: torch.Tensor, gt: GroupTensors) -> torch.Tensor:
        """q: [T_g, Hq * D] the group's queries; kv: [2, N, S, D]. Returns [T_g, Hq * D]."""
        cfg = self.cfg
        hkv, d = cfg.num_kv_heads, cfg.head_dim
        g, b, n = cfg.num_heads // hkv, gt.batch, gt.query_len
        if gt.pad_index is not None:
            q = q.new_zeros((b * n, q.shape[1])).index_copy_(0, gt.pad_index, q)
        q5 = q.view(b, n, hkv, g, d)
        if gt.group.order == "bh":
            q3 = q5.permute(0, 2, 3, 1, 4).reshape(b * hkv, g * n, d)      # [B*Hkv, G*Q, D]
        else:
            q3 = q5.permute(2, 0, 3, 1, 4).reshape(hkv * b, g * n, d)      # [Hkv*B, G*Q, D]
        if self.host_blas:
            o3 = self._attention_core_host(q3, kv, gt)
        else:
            assert gt.bias is not None
            scores = torch.baddbmm(gt.bias, q3, kv[0].transpose(1, 2))      # [N, G*Q, S]
            if self.dtype == torch.float32:
                probs = torch.softmax(scores, dim=-1)
            else:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            o3 = torch.bmm(probs, kv[1])                                     # [N, G*Q, D]
        if gt.group.order == "bh":
            o = o3.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4)
        else:
            o = o3.view(hkv, b, g, n, d).permute(1, 3, 0, 2, 4)
        o = o.reshape(b * n, hkv * g * d)                                    # [B*Q, Hq*D]
        return o if gt.pad_index is None else o.index_select(0, gt.pad_index)

    def _attention_core_host(self, q3: torch.Tensor, kv: torch.Tensor, gt: GroupTensors) -> torch.Tensor:
        """softmax(q k^T + mask) v with numpy's batched matmul: for these many small matrices
        (G*Q x D by D x S, per item and kv head) it ran 3x faster than torch's bmm (measured at
        32 items x 200 keys), and it takes the slab's strided views as they are."""
        cfg = self.cfg
        k, v = kv[0].numpy(), kv[1].numpy()                                  # [N, S, D]
        scores = np.matmul(q3.numpy(), k.transpose(0, 2, 1))                # [N, G*Q, S]
        if gt.mask is not None:
            b, n, hkv, g = gt.batch, gt.query_len, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
            if gt.group.order == "bh":
                view = scores.reshape(b, hkv, g, n, -1)
                view += gt.mask[:, None, None]
            else:
                view = scores.reshape(hkv, b, g, n, -1)
                view += gt.mask[None, :, None]
        probs = torch.softmax(torch.from_numpy(scores), dim=-1).numpy()
        return torch.from_numpy(np.matmul(probs, v))                         # [N, G*Q, D]

    @torch.inference_mode()
    def forward(self, st: StepTensors, cache: PagedKVCache, views: KVViews,
                times: PhaseTimes, sync: bool = False) -> torch.Tensor:
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
        h = self._embed(st.tokens)                                         # [T, hidden]
        rot = self.rotary.index_select(0, st.positions).unsqueeze(1)       # [T, 1, D/2]
        for i, w in enumerate(self.layers):
            x = self._rms_norm(h, w.input_norm)
            qkv = self._matmul(x, w.qkv)                                   # [T, (Hq+2Hkv)*D]
            self._rope_(qkv, rot)
            kv = qkv[:, q_width:].view(t, 2, cfg.num_kv_heads, cfg.head_dim)

            t0 = clock()
            cache.write(i, st.slots, kv)
            t1 = clock()
            views.append(i, kv)
            group_kv = [views.keys_values(i, j) for j in range(len(st.groups))]
            t2 = clock()
            if len(st.groups) == 1:
                attn = self._attention(qkv[:, :q_width], group_kv[0], st.groups[0])
            else:
                attn = qkv.new_empty((t, q_width))
                for gt, kv_g in zip(st.groups, group_kv):
                    attn[gt.rows] = self._attention(qkv[gt.rows, :q_width], kv_g, gt)
            t3 = clock()
            times.kv_write_ns += t1 - t0
            times.kv_view_prepare_ns += t2 - t1
            times.attention_ns += t3 - t2

            self._matmul_add_(h, attn, w.o)
            x = self._rms_norm(h, w.post_norm)
            gate_up = self._matmul(x, w.gate_up)                           # [T, 2 * inter]
            act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
            self._matmul_add_(h, act, w.down)
        last = self._rms_norm(h.index_select(0, st.sample_rows), self.norm)  # [N, hidden]
        return self._matmul(last, self.lm_head).float()                    # [N, V]
