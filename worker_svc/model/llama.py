"""The torch Llama: one batched forward over sessions of different lengths, paged KV cache.

Tokens of all items are packed along one axis ([T, ...]) for everything that is per token
(projections, RoPE, MLP); only attention needs a per-session layout, so queries are scattered
into a padded [B, Hq, Q, D] tensor, run through one ``scaled_dot_product_attention`` call with
an explicit causal-and-length mask against the K/V views, and gathered back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker_svc.kv_cache import BatchLayout, KVViews, PagedKVCache
from worker_svc.model.config import LlamaConfig


@dataclass
class PhaseTimes:
    """Nanoseconds per phase of one forward, summed over layers (host clock)."""

    kv_write_ns: int = 0
    kv_view_prepare_ns: int = 0
    attention_ns: int = 0


@dataclass(frozen=True)
class StepTensors:
    """Device index tensors of one step, built once and shared by every layer."""

    tokens: torch.Tensor      # [T] token ids, items packed in order
    positions: torch.Tensor   # [T] absolute position of each token
    slots: torch.Tensor       # [T] paged-cache slot each token's K/V goes to
    pad_index: torch.Tensor   # [T] row of the token in the flattened padded queries [B * Q]
    mask: torch.Tensor        # [B, 1, Q, S] bool, True = may attend
    batch: int                # B
    query_len: int            # Q, the longest item of the step
    sample_rows: torch.Tensor  # [N] packed index of the tokens whose logits are wanted


def step_tensors(layout: BatchLayout, attn_rows: list[int], tokens: list[int], slots: list[int],
                 sample_items: list[int], device: torch.device) -> StepTensors:
    """``attn_rows[b]``: the padded-attention row of item b, as chosen by the KV views."""
    b, q, s = len(layout.lengths), max(layout.lengths), layout.max_total
    offsets = np.concatenate([[0], np.cumsum(layout.lengths)])
    positions = np.concatenate([np.arange(st, st + n) for st, n in zip(layout.starts, layout.lengths)])
    pad_index = np.concatenate([r * q + np.arange(n) for r, n in zip(attn_rows, layout.lengths)])
    # Query i of row r sits at position start + i; a padding query (i >= n) copies the last
    # real query's mask so that no row is all-masked (which would make NaNs, harmless but noisy).
    query_pos = np.zeros((b, q), dtype=np.int64)
    for r, st, n in zip(attn_rows, layout.starts, layout.lengths):
        query_pos[r] = st + np.minimum(np.arange(q), n - 1)
    mask = np.arange(s)[None, None, :] <= query_pos[:, :, None]                   # [B, Q, S]

    def dev(a: object) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device)

    return StepTensors(
        tokens=dev(tokens), positions=dev(positions), slots=dev(slots),
        pad_index=dev(pad_index), mask=torch.from_numpy(mask[:, None]).to(device),
        batch=b, query_len=q, sample_rows=dev([offsets[i + 1] - 1 for i in sample_items]))


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on cpu, where ops run eagerly)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights as device tensors plus the forward; the KV cache is attached from outside."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, np.ndarray], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def load(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name} is missing")
            array = np.ascontiguousarray(weights[name], dtype=np.float32)
            return torch.as_tensor(array).to(device, dtype)

        self.embed = load("model.embed_tokens.weight")                    # [V, hidden]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({n: load(p + n + ".weight") for n in (
                "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")})
        self.norm = load("model.norm.weight")
        if "lm_head.weight" in weights:
            self.lm_head = load("lm_head.weight")                          # [V, hidden]
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            raise KeyError("lm_head.weight is missing and tie_word_embeddings is False")
        # cos/sin for every position, float32 whatever the model dtype: RoPE is applied in
        # float32 and rounded once, as precision of the angle matters at long positions.
        d = cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)                       # [P, D]
        self.cos = angles.cos().to(device, torch.float32)
        self.sin = angles.sin().to(device, torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct weight tensor (a tied head counted once)."""
        out = [self.embed, self.norm]
        for layer in self.layers:
            out.extend(layer.values())
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        return out

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # In float32 then rounded, as HF does: the mean of squares overflows/underflows in half.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return x32.to(self.dtype) * w

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] -> same, rotated by each token's position (HF rotate_half pairs)."""
        cos = self.cos[positions][:, None, :]                              # [T, 1, D]
        sin = self.sin[positions][:, None, :]
        x32 = x.float()
        return (x32 * cos + _rotate_half(x32) * sin).to(self.dtype)

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
        t, hq, hkv, d = st.tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed[st.tokens]                                          # [T, hidden]
        for i, w in enumerate(self.layers):
            x = self._rms_norm(h, w["input_layernorm"])
            q = self._rope((x @ w["self_attn.q_proj"].T).view(t, hq, d), st.positions)
            k = self._rope((x @ w["self_attn.k_proj"].T).view(t, hkv, d), st.positions)
            v = (x @ w["self_attn.v_proj"].T).view(t, hkv, d)

            t0 = clock()
            cache.write(i, st.slots, k, v)
            t1 = clock()
            views.append(i, k, v)
            k_all, v_all = views.keys_values(i)                            # [B, S, Hkv, D]
            t2 = clock()

            q_pad = q.new_zeros((st.batch * st.query_len, hq, d))
            q_pad[st.pad_index] = q
            q_pad = q_pad.view(st.batch, st.query_len, hq, d).transpose(1, 2)  # [B, Hq, Q, D]
            o = F.scaled_dot_product_attention(
                q_pad, k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=st.mask,
                enable_gqa=hq != hkv)                                      # [B, Hq, Q, D]
            o = o.transpose(1, 2).reshape(st.batch * st.query_len, hq * d)[st.pad_index]
            t3 = clock()
            times.kv_write_ns += t1 - t0
            times.kv_view_prepare_ns += t2 - t1
            times.attention_ns += t3 - t2

            h = h + o @ w["self_attn.o_proj"].T
            x = self._rms_norm(h, w["post_attention_layernorm"])
            mlp = F.silu(x @ w["mlp.gate_proj"].T) * (x @ w["mlp.up_proj"].T)
            h = h + mlp @ w["mlp.down_proj"].T
        last = self._rms_norm(h[st.sample_rows], self.norm)                # [N, hidden]
        return (last @ self.lm_head.T).float()                             # [N, V]
