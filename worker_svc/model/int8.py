"""Int8 weights for the CPU: channel smoothing, then weight-only int8 blocks of 32 (``q8``).

``--quant int8`` keeps float32 activations: each product's weight is int8 with a scale per row
and block of 32 columns, widened to float in the kernel. Before rounding, each product's input
channel j is divided by ``s_j = max|x_j|^a / max|W_:j|^(1-a)`` and the weight's column
multiplied by it (SmoothQuant's migration; with float activations it works as AWQ's does: the
columns that meet Llama's outlier activation channels, on smollm2 the down projection's input
peaks at 480 where its median channel is 5, are scaled up before rounding, so their relative
rounding error, which those large inputs multiply, shrinks). The product is unchanged before
rounding; the division costs nothing at run time, folded into whatever makes the input:
  * qkv and gate/up: the RMS norm's weight before them (and the final norm before the head);
  * o: the v rows of qkv and V's bias (attention output is a convex mix of V rows, so scaling
    V's channel scales its output channel; the s of query heads sharing a kv head are their max);
  * down: the up rows of gate/up (act(gate) * up is linear in up).
Gemma's sandwich norms change none of this: each norms a product's *output* (o's, down's)
before the residual add, and a product's input still comes from the norm or rows named above
(the MLP's input norm is its pre_feedforward_layernorm, ``LayerWeights.post_norm``).
The KV cache then holds the scaled V (internal to this engine). ``max|x_j|`` comes from one
float32 forward at load over 512 seeded random token ids drawn with p(id) ~ 1 / (id + 10):
BPE vocabularies put frequent tokens first, so that resembles text without needing a
tokenizer or a corpus.

Measured on smollm2 (top-1 agreement with float32 / perplexity ratio, the whole of
tests/data/heldout.txt, 2-core Intel Xeon), weight-only int8 blocks of 32: with smoothing
0.973 / x0.998, without 0.976 / x1.006 (the perplexity is the finer measure; 0.003 of
agreement is 7 positions). Before, with the inputs rounded to int8 blocks of 32 as well (W8A8):
smoothing 0.963-0.967 / x1.000, none 0.956 / x1.011; fbgemm's per-row int8 (one scale per row
and per token) 0.898 without smoothing and 0.928 with it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from kvfleet_models.config import LlamaConfig
from worker_svc.model.cpu_backend import Matrix
from worker_svc.model.q8 import Q8Kernels, load_kernels, quantize_blocks
from worker_svc.model.weights import ModelWeights, gate_act_mul, qk_norm_, rms_norm, rope_

ALPHA = 0.5  # migration strength (SmoothQuant's default; 0.3, 0.4, 0.6, 0.7 measured worse)
CALIBRATION_TOKENS = 512


def _nk(m: Matrix) -> torch.Tensor:
    assert m.nk is not None
    return m.nk


def _out_norm(y: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return y if w is None else rms_norm(y, w, eps)  # Gemma's sandwich norm of a sublayer's output


@torch.inference_mode()
def input_ranges(cfg: LlamaConfig, weights: ModelWeights, tokens: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """max |x_j| of each product's input over one causal float32 forward of ``tokens`` [T] on
    torch's reference ops: per layer {"qkv", "o", "gate_up", "down"} and, in the last entry,
    {"head"}."""
    t, hq, hkv, d = tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_width, inter, eps = hq * d, cfg.intermediate_size, cfg.rms_norm_eps
    h = weights.embed_rows(tokens)  # [T, hidden]
    out: list[dict[str, torch.Tensor]] = []
    pos = torch.arange(t)
    for i, w in enumerate(weights.layers):
        seen = {}
        x = rms_norm(h, w.input_norm, eps)
        seen["qkv"] = x.abs().amax(0)
        qkv = x @ _nk(w.qkv).t()
        if w.qkv_bias is not None:
            qkv += w.qkv_bias
        if w.q_norm is not None:
            qk_norm_(qkv, w, hq, hkv, eps)
        rope_(qkv, weights.rotary_of(cfg.local_rope(i))[:t].unsqueeze(1), hq + hkv, d)  # rot: [T, 1, D/2]
        q = qkv[:, :q_width].view(t, hq, d).transpose(0, 1)  # [Hq, T, D]
        k, v = qkv[:, q_width:].view(t, 2, hkv, d).permute(1, 2, 0, 3)  # [Hkv, T, D] each
        g = hq // hkv
        # [T, T] keys each query sees: causal, and within the layer's window if it has one
        visible = pos[None, :] <= pos[:, None]
        if cfg.window(i):
            visible &= pos[None, :] > pos[:, None] - cfg.window(i)
        attn = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=visible, scale=1.0
        )  # q is pre-scaled (in its rows or its norm)
        attn = attn.transpose(0, 1).reshape(t, q_width)
        seen["o"] = attn.abs().amax(0)
        h = h + _out_norm(attn @ _nk(w.o).t(), w.attn_out_norm, eps)
        x = rms_norm(h, w.post_norm, eps)
        seen["gate_up"] = x.abs().amax(0)
        gate_up = x @ _nk(w.gate_up).t()
        act = gate_act_mul(gate_up, inter, cfg.hidden_act)
        seen["down"] = act.abs().amax(0)
        h = h + _out_norm(act @ _nk(w.down).t(), w.mlp_out_norm, eps)
        out.append(seen)
    out.append({"head": rms_norm(h, weights.norm, eps).abs().amax(0)})
    return out


def calibration_ids(vocab_size: int, n: int, seed: int) -> torch.Tensor:
    """n token ids, p(id) ~ 1 / (id + 10) (see the module docstring)."""
    p = 1.0 / (np.arange(vocab_size) + 10.0)
    ids = np.random.default_rng(seed).choice(vocab_size, n, p=p / p.sum())
    return torch.from_numpy(ids)


def _smoothing(x_max: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """s [in] for a weight w [out, in] whose input peaks at x_max [in]."""
    w_max = w.abs().amax(0).clamp_min(1e-5)
    s = x_max.clamp_min(1e-5) ** ALPHA / w_max ** (1 - ALPHA)
    return s.clamp(1e-2, 1e2)


def quantize(
    cfg: LlamaConfig, weights: ModelWeights, seed: int = 0, kernels: Q8Kernels | None = None
) -> tuple[ModelWeights, str]:
    """The weights with every float product (torch layout, [out, in]) replaced by a smoothed
    weight-only int8 one, the norms taking the folded divisions: a transform applied before the model is
    built. ``kernels``: the C products (default: the best level this CPU runs, or torch's
    reference product where they cannot be built). Returns (weights, the products' kernel
    level: "torch" for the reference)."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_width, kv_width, inter = hq * d, hkv * d, cfg.intermediate_size
    n = min(CALIBRATION_TOKENS, cfg.max_position)
    ranges = input_ranges(cfg, weights, calibration_ids(cfg.vocab_size, n, seed))
    kernels = kernels or load_kernels()

    def q8(w: torch.Tensor) -> Matrix:
        return Matrix(kn=None, nk=None, q8=quantize_blocks(w, kernels), shape=(w.shape[0], w.shape[1]))

    layers = []
    for w, seen in zip(weights.layers, ranges):
        qkv, o, gate_up, down = (_nk(m).clone() for m in (w.qkv, w.o, w.gate_up, w.down))
        s_qkv = _smoothing(seen["qkv"], qkv)
        s_up = _smoothing(seen["gate_up"], gate_up)
        # o's input channel (head j, dim c) is v's (kv head j // G, dim c): one s per kv channel.
        s_kv = _smoothing(seen["o"], o).view(hkv, hq // hkv, d).amax(1)  # [Hkv, D]
        s_o = s_kv.repeat_interleave(hq // hkv, 0).reshape(q_width)
        s_down = _smoothing(seen["down"], down)
        qkv *= s_qkv
        qkv[q_width + kv_width :] /= s_kv.reshape(kv_width, 1)
        bias = None
        if w.qkv_bias is not None:  # V's bias scales with its rows
            bias = w.qkv_bias.clone()
            bias[q_width + kv_width :] /= s_kv.reshape(kv_width)
        gate_up *= s_up
        gate_up[inter:] /= s_down[:, None]
        layers.append(
            dataclasses.replace(
                w,
                input_norm=w.input_norm / s_qkv,
                post_norm=w.post_norm / s_up,
                qkv=q8(qkv),
                o=q8(o * s_o),
                gate_up=q8(gate_up),
                down=q8(down * s_down),
                qkv_bias=bias,
            )
        )
    head = _nk(weights.lm_head)
    s_head = _smoothing(ranges[-1]["head"], head)
    quantized = dataclasses.replace(
        weights,
        layers=layers,
        norm=weights.norm / s_head,
        embed=weights.embed,  # None where tied: the rows are read from the int8 head below
        embed_unsmooth=(1.0 / s_head) if weights.embed is None else None,
        lm_head=q8(head * s_head),
    )
    return quantized, kernels.level if kernels is not None else "torch"
