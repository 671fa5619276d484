"""The products on a GGUF's own blocks (``worker_svc/model/gguf_quant.py``, ``gguf_kernels.c``)
at every kernel level this CPU runs, for every block format they serve.

Blocks are made by the gguf package's own quantizer (``gguf.quants.quantize``, llama.cpp's
reference rounding), the K formats (Q4_K, Q6_K), which it does not write, by our own
(``tests/helpers/kquants.py``), and

  * our reading of them (``BlockTensor.dequantize``) equals the gguf package's dequantize, and
    for the K formats also on random bytes (every scale, min and bit pattern);
  * the C input quantizer equals the torch one the reference uses (int8 values, scales, sums);
  * each level's product equals the float64 reference (the exactly dequantized weight times the
    activations quantized as the C does) to float32 rounding: the integer sums are exact, only
    the order of adding up the blocks' float terms differs. Shapes: K a multiple of 32 with an
    odd number of blocks (the AVX-512 path takes two at a time), N not a multiple of 4, M = 1,
    3, 17, and smollm2's own; for the K formats K of 1, 2 and 3 super-blocks and down_proj's;
  * the amx level (AMX tiles from 16 activation rows) on its own shapes: M of one tile, one and
    a few rows past it (those rows take the avx512 group kernel), a padded last tile, many
    tiles; N with and without rows past the groups; K of one block, an odd number, and more
    blocks than it unpacks at once. There it equals the avx512 level exactly: the integer sums
    are exact and the float steps are the same, in the same order.

Levels this CPU cannot run (or, for amx, this process may not use) are skipped, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfleet_models.gguf_blocks import FORMATS, QK_K, BlockTensor
from tests.helpers import kquants
from worker_svc.model import gguf_quant, q8
from worker_svc.model.gguf_packed import RowGroups

# Their rows split among 2 threads, whatever the process has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("two_threads")

K_FORMATS = [f for f in FORMATS if FORMATS[f].block_weights == QK_K]


def _kernels(level: str) -> gguf_quant.GGUFKernels:
    runnable = gguf_quant.runnable_levels()
    if level not in runnable:
        pytest.skip(f"this CPU does not run the {level} kernels (it runs {', '.join(runnable)})")
    return gguf_quant.GGUFKernels.load(level)


def _blocks(fmt: str, w: np.ndarray) -> BlockTensor:
    """w float32 [N, K] quantized into ``fmt``'s blocks (by the gguf package, or ours for K)."""
    data = kquants.quantize(w, fmt)  # uint8 [N, row bytes]
    return BlockTensor(FORMATS[fmt], np.ascontiguousarray(data), w.shape[1])


def _weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of different ranges, and a shifted block (Q4_1's min matters), as trained weights have
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 0.2, (n, 1)).astype(np.float32)
    w[:, :32] += 0.05
    return w


def _input(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # channels of very different ranges, as Llama's activations have
    return torch.randn(m, k, generator=g) * torch.rand(k, generator=g).pow(4) * 50


# (N, K): K of 1 and 3 blocks (odd), 2 blocks, N not a multiple of 4; two groups of 16 rows
# and 3 more (gguf_packed); smollm2's qkv and down.
SHAPES = [(7, 32), (5, 96), (13, 64), (35, 96), (960, 576), (576, 1536)]
# The K formats: 1, 3 (odd) and 2 super-blocks; down_proj's (576 is no multiple of 256).
K_SHAPES = [(7, 256), (5, 768), (13, 512), (576, 1536)]
CASES = [(f, n, k) for f in FORMATS for n, k in (K_SHAPES if f in K_FORMATS else SHAPES)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_our_reading_of_the_blocks_equals_the_gguf_packages(fmt: str) -> None:
    import gguf

    w = _weight(9, 768 if fmt in K_FORMATS else 160, seed=1)
    blocks = _blocks(fmt, w)
    theirs = gguf.quants.dequantize(blocks.data, gguf.GGMLQuantizationType[fmt]).reshape(w.shape)
    assert np.array_equal(blocks.dequantize(), theirs)
    # and the blocks are the format's own: a small error against the float weight, not garbage
    np.testing.assert_allclose(theirs, w, rtol=0, atol=float(np.abs(w).max()) / (7 if fmt != "Q8_0" else 100))


def _random_k_blocks(fmt: str, n: int, k: int, seed: int) -> BlockTensor:
    """Random bytes in ``fmt``'s layout, the fp16 fields made small finite numbers."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, k // QK_K, f.block_bytes), dtype=np.uint8)
    for at in (0, 2) if fmt == "Q4_K" else (208,):  # d, dmin / d
        halves = rng.uniform(1e-3, 2e-2, data.shape[:2]).astype(np.float16)
        data[:, :, at : at + 2] = halves[:, :, None].view(np.uint8)
    return BlockTensor(f, data.reshape(n, -1), k)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_our_reading_of_random_k_blocks_equals_the_gguf_packages(fmt: str) -> None:
    import gguf

    blocks = _random_k_blocks(fmt, 6, 768, seed=3)
    theirs = gguf.quants.dequantize(blocks.data, gguf.GGMLQuantizationType[fmt]).reshape(6, 768)
    assert np.array_equal(blocks.dequantize(), theirs)
    assert np.unique(theirs).size > 1000  # the bytes make many values, not a constant
    # float64 is exact: it differs from float32 by float32's rounding only
    np.testing.assert_allclose(blocks.dequantize(dtype=np.float64), theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("m", [1, 4])
def test_random_k_blocks_at_every_level(level: str, fmt: str, m: int) -> None:
    """Every 6-bit scale and min, and Q6_K's negative scales, not only the quantizer's."""
    kernels = _kernels(level)
    w = gguf_quant.stack([(_random_k_blocks(fmt, 9, 768, seed=4), 1.0)], kernels)
    x = _input(m, 768, seed=5)
    ref = gguf_quant.reference_linear(x, w)
    np.testing.assert_allclose(w.linear(x).numpy(), ref.numpy(), rtol=0, atol=2e-6 * float(ref.abs().max()) * 768**0.5)


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
def test_c_input_quantizer_equals_the_references(level: str) -> None:
    kernels = _kernels(level)
    x = _input(5, 160, seed=2)
    x[1] = 0.0  # a zero row: scale 0, values 0
    x[2, 3] = x[2, :32].abs().max() * 1.5  # exact halves on the way: rint's ties to even
    for got, want in zip(kernels.quantize_input(x), gguf_quant.quantize_input(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
@pytest.mark.parametrize("fmt, n, k", CASES)
@pytest.mark.parametrize("m", [1, 3, 6, 17])
def test_every_level_equals_the_reference(level: str, fmt: str, n: int, k: int, m: int) -> None:
    kernels = _kernels(level)
    w = gguf_quant.stack([(_blocks(fmt, _weight(n, k, seed=n + k)), 1.0)], kernels)
    x = _input(m, k, seed=n * 1000 + k + m)
    ref = gguf_quant.reference_linear(x, w)
    got = w.linear(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=0, atol=2e-6 * float(ref.abs().max()) * k**0.5)


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
def test_stacked_parts_scales_and_accumulate(level: str) -> None:
    """q, k, v of different formats stacked (two runs: Q4_1 q+k merged, then Q8_0 v), q's rows
    scaled; the product added into a strided ``out`` leaves its other columns alone."""
    kernels = _kernels(level)
    q, k, v = (_weight(n, 96, seed=s) for n, s in ((8, 3), (4, 4), (4, 5)))
    w = gguf_quant.stack([(_blocks("Q4_1", q), 0.125), (_blocks("Q4_1", k), 1.0), (_blocks("Q8_0", v), 1.0)], kernels)
    assert len(w.parts) == 2 and w.out_features == 16 and w.scales[1] is None
    x = _input(3, 96, seed=6)
    ref = gguf_quant.reference_linear(x, w)
    atol = 2e-5 * float(ref.abs().max())
    np.testing.assert_allclose(w.linear(x).numpy(), ref.numpy(), rtol=0, atol=atol)
    # the scale is q's only: q's columns are the unscaled product / 8
    unscaled = gguf_quant.reference_linear(x, gguf_quant.stack([(_blocks("Q4_1", q), 1.0)], None))
    np.testing.assert_allclose(ref[:, :8].numpy(), (unscaled / 8).numpy(), rtol=1e-12)
    wide = torch.ones(3, 20)
    out = wide[:, 2:18]
    assert out.stride(1) == 1
    w.linear(x, out=out)
    np.testing.assert_allclose(out.numpy(), (ref + 1).numpy(), rtol=0, atol=atol)
    assert torch.equal(wide[:, :2], torch.ones(3, 2)) and torch.equal(wide[:, 18:], torch.ones(3, 2))


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
@pytest.mark.parametrize("m", [1, 16, 35])
def test_q8_0_weights_at_minus_128_do_not_overflow(level: str, m: int) -> None:
    """A file's Q8_0 may hold -128 (the gguf package never writes it, other quantizers may):
    |w| is taken as unsigned (amx: s8 x s8 in int32), so -128 * -127 is exact at every level,
    for one row, a tile of 16 and tiles with rows past them."""
    kernels = _kernels(level)
    k, n = 96, 18  # a group of 16 rows and two in the file's layout, each path both ways
    data = np.zeros((n, k // 32 * 34), dtype=np.uint8)
    blocks = data.reshape(n, k // 32, 34)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # d = 1
    blocks[0::2, :, 2:] = np.uint8(0x80)  # every weight -128
    blocks[1::2, :, 2:] = np.uint8(127)
    w = gguf_quant.stack([(BlockTensor(FORMATS["Q8_0"], data, k), 1.0)], kernels)
    x = torch.full((m, k), -1.0)  # quantized to -127, scale 1/127
    got = w.linear(x)
    np.testing.assert_allclose(got.numpy(), [[128.0 * k, -127.0 * k] * (n // 2)] * m, rtol=1e-6)


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_simd_levels_keep_row_groups_of_the_same_bytes(level: str, fmt: str) -> None:
    """At the SIMD levels a Q8_0 / Q4 weight is stored in groups of 16 rows (gguf_packed): the
    file's bytes, reordered, none added; its rows read back as the file's (the reference
    product and the tied lookup read them so), whole and by index. The scalar level keeps
    the file's layout."""
    kernels = _kernels(level)
    blocks = _blocks(fmt, _weight(35, 96, seed=10))
    w = gguf_quant.stack([(blocks, 1.0)], kernels)
    part = w.parts[0]
    if level == "scalar":
        assert isinstance(part, BlockTensor)
        return
    assert isinstance(part, RowGroups) and part.groups == 2 and part.nbytes == blocks.nbytes
    assert not np.array_equal(part.packed[: 32 * blocks.data.shape[1]], blocks.data[:32].reshape(-1))
    assert np.array_equal(part.data, blocks.data)
    index = np.array([34, 0, 17, 15, 16, 34])
    assert np.array_equal(part.file_rows(index), blocks.data[index])
    assert np.array_equal(part.dequantize(index), blocks.dequantize(index))
    # the layout itself: row 5's block 1 has its d at lane 5 of group 0's block 1, and its
    # payload bytes 4..7 in chunk 1 at lane 5
    bb, head = FORMATS[fmt].block_bytes, 2 if fmt != "Q4_1" else 4
    group_block = part.packed[16 * bb : 32 * bb]
    assert bytes(group_block[10:12]) == bytes(blocks.data[5, bb : bb + 2])
    at = 16 * head + 64 + 5 * 4
    assert bytes(group_block[at : at + 4]) == bytes(blocks.data[5, bb + head + 4 : bb + head + 8])


def test_tied_lookup_dequantizes_only_the_rows_read() -> None:
    w = _weight(50, 64, seed=7)
    blocks = _blocks("Q8_0", w)
    weight = gguf_quant.stack([(blocks, 1.0)], None)
    tokens = torch.tensor([3, 3, 49, 0])
    assert torch.equal(weight.rows(tokens), torch.from_numpy(blocks.dequantize()[[3, 3, 49, 0]]))


def test_without_the_c_library_products_fall_back_to_the_reference() -> None:
    w = gguf_quant.stack([(_blocks("Q4_0", _weight(6, 64, seed=8)), 1.0)], None)
    x = _input(2, 64, seed=9)
    assert torch.equal(w.linear(x), gguf_quant.reference_linear(x, w).float())


def test_a_level_beyond_the_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU's levels are read where both kernel families pick theirs (q8.load_level).
    monkeypatch.setattr(q8, "runnable_levels", lambda: ("scalar",))
    assert gguf_quant.runnable_levels() == ("scalar",)  # amx only above avx512
    with pytest.raises(ValueError, match="'avx2' is not one this CPU runs"):
        gguf_quant.GGUFKernels.load("avx2")
    with pytest.raises(ValueError, match="'amx' is not one this CPU runs"):
        gguf_quant.GGUFKernels.load("amx")
    monkeypatch.setenv("KVFLEET_Q8_LEVEL", "scalar")
    assert gguf_quant.GGUFKernels.load().level == "scalar"


# The amx level's shapes (N, K): one group; two and 3 rows past them; K of one block, of 3 (odd),
# smollm2's 576 and 1536, and 2304 (72 blocks: more than the 64 a group unpacks at once).
AMX_SHAPES = [(16, 32), (35, 96), (48, 576), (21, 1536), (32, 2304)]
# M: under a tile (avx512), one tile, 1 and 4 rows past it (avx512 for those rows), 13 past two
# (a padded tile), 256 (smollm2's prefill chunk).
AMX_ROWS = [15, 16, 17, 20, 45, 256]


def _amx_pair() -> tuple[gguf_quant.GGUFKernels, gguf_quant.GGUFKernels]:
    return _kernels("amx"), _kernels("avx512")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("n, k", AMX_SHAPES)
def test_amx_equals_the_reference_and_the_avx512_level(fmt: str, n: int, k: int) -> None:
    amx, avx512 = _amx_pair()
    blocks = _blocks(fmt, _weight(n, k, seed=n + 3 * k))
    w, w512 = gguf_quant.stack([(blocks, 1.0)], amx), gguf_quant.stack([(blocks, 1.0)], avx512)
    for m in AMX_ROWS:
        x = _input(m, k, seed=n * 1000 + k + m)
        ref = gguf_quant.reference_linear(x, w)
        got = w.linear(x)
        assert got.shape == (m, n) and got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=0, atol=2e-6 * float(ref.abs().max()) * k**0.5)
        assert torch.equal(got, w512.linear(x)), (fmt, n, k, m)


def test_amx_scales_and_accumulates_as_avx512() -> None:
    """Stacked parts of every grouped format and a Q4_K one (which amx multiplies as avx512
    does), q's rows scaled, added into a strided ``out``: the same floats as avx512."""
    amx, avx512 = _amx_pair()
    parts = [("Q4_1", 48, 0.125), ("Q4_0", 16, 1.0), ("Q8_0", 20, 1.0), ("Q4_K", 16, 1.0)]
    blocks = [(_blocks(f, _weight(n, 256, seed=i)), sc) for i, (f, n, sc) in enumerate(parts)]
    w, w512 = gguf_quant.stack(blocks, amx), gguf_quant.stack(blocks, avx512)
    x = _input(37, 256, seed=11)
    wide = torch.ones(37, 104)
    out, out512 = wide.clone()[:, 2:102], wide.clone()[:, 2:102]
    w.linear(x, out=out)
    w512.linear(x, out=out512)
    assert torch.equal(out, out512)
    ref = gguf_quant.reference_linear(x, w) + 1.0
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=0, atol=2e-5 * float(ref.abs().max()))


def test_amx_is_the_default_where_usable_and_refused_where_not(monkeypatch: pytest.MonkeyPatch) -> None:
    _amx_pair()  # (skips where this CPU or process has no AMX)
    assert gguf_quant.runnable_levels()[-2:] == ("avx512", "amx")
    monkeypatch.delenv("KVFLEET_Q8_LEVEL", raising=False)
    assert gguf_quant.GGUFKernels.load().level == "amx"
    # KVFLEET_Q8_LEVEL=amx caps the int8 kernels, which have no amx level, at their best
    monkeypatch.setenv("KVFLEET_Q8_LEVEL", "amx")
    assert q8.Q8Kernels.load().level == "avx512" and gguf_quant.GGUFKernels.load().level == "amx"
    monkeypatch.setenv("KVFLEET_Q8_LEVEL", "avx512")
    assert gguf_quant.GGUFKernels.load().level == "avx512"
    # a process Linux refused the tile state: no amx level, the default falls back to avx512
    monkeypatch.delenv("KVFLEET_Q8_LEVEL")
    monkeypatch.setattr(gguf_quant, "amx_usable", lambda: False)
    assert "amx" not in gguf_quant.runnable_levels()
    assert gguf_quant.GGUFKernels.load().level == "avx512"
    with pytest.raises(ValueError, match="'amx' is not one this CPU runs"):
        gguf_quant.GGUFKernels.load("amx")
    found, lib = gguf_quant._library("amx")
    with pytest.raises(ValueError, match="may not use the AMX tiles"):
        gguf_quant.GGUFKernels(lib, "amx", found.path)
