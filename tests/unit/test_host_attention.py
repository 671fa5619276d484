"""The attention of prefill chunks, on the host (numpy, ``cpu_backend.attention_core``) and on
torch's bmm (``llama.torch_attention``, where torch holds the threads, and off the CPU): a tile
of queries at a time, each tile's products stopping at the last key one of its queries sees.
Held to torch's masked softmax over every key, and checked to leave the masked keys out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.model import cpu_backend, llama
from worker_svc.model.cpu_backend import QUERY_TILE, attention_core


def _causal_mask(starts: list[int], lengths: list[int], keys: int) -> np.ndarray:
    """[B, Q, S] additive: item b's query i (at position start + i; a padding query repeats its
    last real one, as the runner pads) sees keys up to its own position."""
    q = max(lengths)
    pos = np.array([[s + min(i, n - 1) for i in range(q)] for s, n in zip(starts, lengths)])
    return np.where(np.arange(keys)[None, None, :] <= pos[:, :, None], 0.0, -np.inf).astype(np.float32)


def _case(starts: list[int], lengths: list[int], order: str, hkv: int = 2, g: int = 3, d: int = 16, seed: int = 0):
    b, q, s = len(starts), max(lengths), max(st + n for st, n in zip(starts, lengths))
    rng = np.random.default_rng(seed)
    q3 = torch.from_numpy(rng.standard_normal((b * hkv, g * q, d)).astype(np.float32))
    kv = torch.from_numpy(rng.standard_normal((2, b * hkv, s, d)).astype(np.float32))
    mask = _causal_mask(starts, lengths, s)
    item = [n // hkv if order == "bh" else n % b for n in range(b * hkv)]  # each row's item
    bias = torch.from_numpy(mask)[item].repeat(1, g, 1)  # [N, G*Q, S], G-major rows
    want = torch.softmax(q3 @ kv[0].transpose(1, 2) + bias, -1) @ kv[1]
    return q3, kv, mask, want, (b, q, hkv, g), bias


@pytest.mark.parametrize("order", ["bh", "hb"])
@pytest.mark.parametrize(
    "starts, lengths",
    [
        ([0], [300]),  # a fresh prompt: three tiles, 128, 256 and 300 keys
        ([40], [QUERY_TILE]),  # one tile after a cached prefix: no tiling
        ([0, 170, 5], [260, 90, 200]),  # items of different starts and lengths (padded queries)
    ],
)
def test_tiles_equal_the_masked_softmax_over_every_key(order: str, starts: list[int], lengths: list[int]) -> None:
    q3, kv, mask, want, (b, q, hkv, g), bias = _case(starts, lengths, order)
    for got in (attention_core(q3, kv, mask, order, b, q, hkv, g), llama.torch_attention(q3, kv, bias, mask, g)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tile_stops_at_the_last_key_its_queries_see(monkeypatch) -> None:
    """A fresh 300-token prompt: the first tile multiplies 128 keys, the second 256, the last
    all 300; a chunk after a 40-token prefix, 168, 296 and 340. On either path."""
    widths: list[int] = []
    host, bmm = cpu_backend._attend, llama._softmax_products

    def host_recorded(q3, k, v, *args):  # type: ignore[no-untyped-def]
        widths.append(k.shape[1])
        return host(q3, k, v, *args)

    def bmm_recorded(q3, k, v, bias):  # type: ignore[no-untyped-def]
        widths.append(k.shape[1])
        return bmm(q3, k, v, bias)

    monkeypatch.setattr(cpu_backend, "_attend", host_recorded)
    monkeypatch.setattr(llama, "_softmax_products", bmm_recorded)
    for start, want in ((0, [128, 256, 300]), (40, [168, 296, 340])):
        q3, kv, mask, ref, (b, q, hkv, g), bias = _case([start], [300], "bh", seed=start)
        widths.clear()
        torch.testing.assert_close(attention_core(q3, kv, mask, "bh", b, q, hkv, g), ref, rtol=1e-5, atol=1e-5)
        assert widths == want
        widths.clear()
        torch.testing.assert_close(llama.torch_attention(q3, kv, bias, mask, g), ref, rtol=1e-5, atol=1e-5)
        assert widths == want
