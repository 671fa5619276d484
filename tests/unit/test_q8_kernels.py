"""The weight-only int8 block products (``worker_svc/model/q8.py``) at every kernel level this
CPU runs.

Every level must equal the float64 reference (the float32 input times the dequantized weight)
up to float32 rounding; levels the CPU cannot run are skipped with the reason. Each level's library is the package's build where
there is one (``make install``, a wheel), and a checkout's first-use compile equals it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from worker_svc.model import native, q8
from worker_svc.model.cpu_features import CpuFeatures

# Their rows split among 2 threads, whatever the process has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("two_threads")


def _kernels(level: str) -> q8.Q8Kernels:
    if level not in q8.runnable_levels():
        pytest.skip(f"this CPU does not run the {level} kernels (it runs {', '.join(q8.runnable_levels())})")
    return q8.Q8Kernels.load(level)


# (N, K): N under, over and at whole groups of 16 rows (the padding rows are never written),
# K not a multiple of 32 (x is read only up to K) and below one block, and smollm2's shapes.
SHAPES = [(7, 48), (5, 20), (35, 96), (960, 576), (576, 1536)]


@pytest.mark.parametrize("level", q8.LEVELS)
@pytest.mark.parametrize("n, k", SHAPES)
# each row-tile size of both SIMD levels, and passes of several; from 24 rows (PANEL_MIN_ROWS) the
# avx512 level's prefill path: 24 is two whole passes of 12, 37 three and a row
@pytest.mark.parametrize("m", [1, 2, 3, 9, 17, 24, 37])
def test_every_level_equals_the_reference(level, n, k, m) -> None:
    kernels = _kernels(level)
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    w = q8.quantize_blocks(torch.randn(n, k, generator=g), kernels)
    # channels of very different ranges, as Llama's activations have
    x = torch.randn(m, k, generator=g) * torch.rand(k, generator=g).pow(4) * 50
    ref = q8.reference_linear(x, w)
    got = w.linear(x)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=0, atol=2e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("level", q8.LEVELS)
def test_weights_at_full_range_and_exact_sums(level) -> None:
    """Weights at +-127 in every block and small-integer inputs: every product and partial sum
    is an integer a float32 holds exactly, so each level must give the exact result (a
    saturating or truncating widening of -127, or a lost tail column, shows here)."""
    kernels = _kernels(level)
    k = 100  # three whole blocks and a block of 4 columns
    signs = torch.tensor([1.0, -1.0]).repeat(k // 2)
    w = q8.quantize_blocks(torch.stack([torch.ones(k), -torch.ones(k), signs] * 6), kernels)  # 18 rows
    assert int(w.row_blocks()[0][:, :k].abs().min()) == 127
    x = torch.stack([torch.ones(k), torch.arange(k, dtype=torch.float32) - 50])
    x = x.repeat(16, 1)  # 32 rows: the avx512 level's prefill path too
    got = w.linear(x).double()
    want = x.double() @ torch.stack([torch.ones(k), -torch.ones(k), signs] * 6).double().t()
    assert torch.equal(got, want)


@pytest.mark.parametrize("level", q8.LEVELS)
def test_accumulate_into_out_and_strided_rows(level) -> None:
    kernels = _kernels(level)
    g = torch.Generator().manual_seed(5)
    w = q8.quantize_blocks(torch.randn(9, 40, generator=g), kernels)
    wide = torch.randn(30, 64, generator=g)  # 30 rows: the prefill path too
    x = wide[:, 8:48]  # rows 64 floats apart
    h = torch.randn(30, 9, generator=g)
    expect = h + q8.reference_linear(x.contiguous(), w)
    assert w.linear(x, out=h) is h
    np.testing.assert_allclose(h.numpy(), expect.numpy(), rtol=0, atol=1e-5 * float(expect.abs().max()))


def test_the_grouped_layout_holds_each_row_and_block() -> None:
    """``quantize_blocks`` rounds half to even per row and block of 32, and its groups of 16
    rows read back, row by row, as those blocks (the zero padding of K and of N included)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(20, 70, generator=g) * 3
    w[0, :32] = torch.arange(32) - 12.7  # block max 19.3 -> scale 19.3/127: many ties near .5
    q = q8.quantize_blocks(w)
    assert q.qs.shape == (2, 3, 32, 16) and q.scales.shape == (2, 3, 16)  # 20 rows -> 2 groups
    scales = torch.cat([w, torch.zeros(20, 26)], 1).view(20, 3, 32).abs().amax(2) / 127
    qs = torch.round(torch.cat([w, torch.zeros(20, 26)], 1).view(20, 3, 32) / scales[:, :, None]).to(torch.int8)
    got_qs, got_scales = q.row_blocks()
    assert torch.equal(got_qs, qs.view(20, 96)) and torch.equal(got_scales, scales)
    assert torch.equal(q.qs[1, :, :, 4:], torch.zeros(3, 32, 12, dtype=torch.int8))  # rows 20-31: padding
    assert torch.equal(q.scales[1, :, 4:], torch.zeros(3, 12))
    index = torch.tensor([19, 0, 16, 3])
    assert torch.equal(q.rows(index), q8.dequantize(q)[index])
    assert (q8.dequantize(q) - w).abs().max() <= scales.max() / 2 + 1e-6


def test_zero_rows_and_blocks() -> None:
    w = q8.quantize_blocks(torch.zeros(4, 64), q8.Q8Kernels.load("scalar"))
    qs, scales = w.row_blocks()
    assert torch.equal(scales, torch.zeros(4, 2)) and torch.equal(qs, torch.zeros(4, 64, dtype=torch.int8))
    assert torch.equal(w.linear(torch.randn(2, 64)), torch.zeros(2, 4))


def test_levels_follow_the_cpu_flags_and_are_refused_beyond_them(monkeypatch) -> None:
    monkeypatch.delenv(q8.LEVEL_ENV, raising=False)  # the default is under test, not the caller's choice
    assert q8.runnable_levels(CpuFeatures(frozenset())) == ("scalar",)
    assert q8.runnable_levels(CpuFeatures(frozenset({"avx2", "fma"}))) == ("scalar", "avx2")
    vnni = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert q8.runnable_levels(CpuFeatures(frozenset(vnni))) == q8.LEVELS
    # AVX-512 without VNNI runs the AVX2 kernels
    assert q8.runnable_levels(CpuFeatures(frozenset(vnni - {"avx512_vnni"}))) == ("scalar", "avx2")
    best = q8.runnable_levels()[-1]
    assert q8.Q8Kernels.load().level == best
    monkeypatch.setenv(q8.LEVEL_ENV, "scalar")
    assert q8.Q8Kernels.load().level == "scalar"
    with pytest.raises(ValueError, match="must be one of"):
        q8.Q8Kernels(None, "avx9", q8.SOURCE)  # type: ignore[arg-type]
    missing = [lv for lv in q8.LEVELS if lv not in q8.runnable_levels()]
    for level in missing:
        with pytest.raises(ValueError, match="not one this CPU runs"):
            q8.Q8Kernels.load(level)


def test_without_the_c_library_products_fall_back_to_the_reference(monkeypatch) -> None:
    """No compiler: load_kernels logs and returns None, and the weights still multiply right."""

    def no_compiler(level: str) -> None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")

    monkeypatch.setattr(q8, "_library", no_compiler)
    assert q8.load_kernels() is None
    g = torch.Generator().manual_seed(2)
    w = q8.quantize_blocks(torch.randn(6, 40, generator=g), None)
    x = torch.randn(2, 40, generator=g)
    assert torch.allclose(w.linear(x), q8.reference_linear(x, w))
    assert torch.allclose(w.linear(x), x @ q8.dequantize(w).t(), atol=0.1)


@pytest.mark.parametrize("level", q8.LEVELS)
def test_a_first_use_build_equals_the_installed_one(level, monkeypatch) -> None:
    """Without the package's build (a checkout never built), each level compiles into the
    tests' cache folder (KVFLEET_CACHE_DIR, tests/conftest.py) and computes the same products."""
    kernels = _kernels(level)
    if (native.HERE / native.installed_name(native.Q8[level])).exists():
        assert kernels.origin is native.Origin.INSTALLED and kernels.path.parent == native.HERE
    monkeypatch.setattr(native, "installed", lambda *a, **k: None)
    q8._library.cache_clear()
    try:
        compiled = q8.Q8Kernels.load(level)
        assert compiled.origin is native.Origin.COMPILED
        assert compiled.path.parent == Path(os.environ[native.CACHE_ENV]) / "fused"
        g = torch.Generator().manual_seed(3)
        w, x = q8.quantize_blocks(torch.randn(12, 96, generator=g)), torch.randn(5, 96, generator=g)
        assert torch.equal(q8.with_kernels(w, compiled).linear(x), q8.with_kernels(w, kernels).linear(x))
    finally:
        q8._library.cache_clear()


def test_a_level_without_a_library_is_unavailable_and_skipped(monkeypatch) -> None:
    """A level the build's compiler could not make (and no first-use compile): reported
    unavailable, refused by name, and the default goes to the best level that has one."""
    runnable = q8.runnable_levels()
    best, real = runnable[-1], q8._library

    def without_best(level: str):  # type: ignore[no-untyped-def]
        if level == best:
            raise RuntimeError(f"{level} not built")
        return real(level)

    monkeypatch.setattr(q8, "_library", without_best)
    assert q8.available_levels() == runnable[:-1]
    with pytest.raises(RuntimeError, match="not built"):
        q8.Q8Kernels.load(best)
    if len(runnable) > 1:
        assert q8.Q8Kernels.load().level == runnable[-2]
    else:
        with pytest.raises(RuntimeError, match="no int8 kernel level"):
            q8.Q8Kernels.load()
