"""bfloat16 weights on a CPU without oneDNN's bfloat16 kernels (``cpu_backend._bf16_product``):
from WIDEN_ROWS rows the weight is widened to float32 for the product. Either way the product
is the bfloat16 mode's: the input rounded to bfloat16, exact products summed in float32, the sum
rounded to bfloat16, so it is within one bfloat16 rounding of the float64 product of the rounded
operands, at every row count on both sides of the switch."""

import pytest
import torch

from worker_svc.model import cpu_backend
from worker_svc.model.cpu_backend import WIDEN_ROWS, Matrix, _bf16_product, matmul, matmul_add_


def _reference(x: torch.Tensor, nk: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double() @ nk.double().t()


@pytest.mark.parametrize("rows", [1, WIDEN_ROWS - 1, WIDEN_ROWS, 64, 300])
def test_a_bf16_product_is_within_one_rounding_of_the_exact_one(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    nk = torch.randn(192, 576, generator=g).to(torch.bfloat16)
    got = _bf16_product(x, nk)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    ref = _reference(x, nk)
    # one rounding to bfloat16 (8 bits of mantissa: half an ulp is 2**-8 of the value) plus
    # float32 summation over 576 terms, far below that
    err = (got.double() - ref).abs()
    assert bool((err <= ref.abs() * 2**-8 + 1e-6).all()), float((err / ref.abs().clamp_min(1e-6)).max())


def test_the_widened_product_is_taken_from_widen_rows_and_matmul_uses_it(monkeypatch) -> None:
    """The switch is where it says, and both of the engine's entry points go through it."""
    widened: list[int] = []
    real_float = torch.Tensor.float

    def counting_float(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and t.shape == (192, 576):
            widened.append(1)
        return real_float(t)

    monkeypatch.setattr(torch.Tensor, "float", counting_float)
    nk = torch.randn(192, 576).to(torch.bfloat16)
    w = Matrix(kn=None, nk=nk, shape=(192, 576))
    for rows, wide in ((WIDEN_ROWS - 1, False), (WIDEN_ROWS, True)):
        x = torch.randn(rows, 576)
        widened.clear()
        out = matmul(x, w, cpu_backend.NO_ROWS)
        assert out.dtype == torch.float32 and bool(widened) == wide, (rows, widened)
        h = torch.zeros(rows, 192)
        widened.clear()
        matmul_add_(h, x, w, cpu_backend.NO_ROWS)
        assert bool(widened) == wide and torch.equal(h, out), rows


def test_float16_weights_keep_torch_s_own_product() -> None:
    """--dtype float16 on a CPU reaches the same branch: its input is rounded to float16 and
    the product stays torch's (no bfloat16 anywhere), at any row count."""
    g = torch.Generator().manual_seed(7)
    nk = torch.randn(96, 128, generator=g).to(torch.float16)
    w = Matrix(kn=None, nk=nk, shape=(96, 128))
    for rows in (1, WIDEN_ROWS, 40):
        x = torch.randn(rows, 128, generator=g)
        assert _bf16_product(x, nk).dtype == torch.float16
        assert torch.equal(matmul(x, w, cpu_backend.NO_ROWS), (x.to(torch.float16) @ nk.t()).to(torch.float32))
