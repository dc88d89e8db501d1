"""Dual-precision kernels vs the reference (interpreter on CPU)."""
import math

import pytest
import torch

from llm_act.kernels import dual_ref as ref

triton_dual = pytest.importorskip("llm_act.kernels.dual_triton")


def _input(s, C, dtype, nonfinite=True):
    x = (torch.randn(s, C) * torch.linspace(0.1, 4, C)).to(dtype)
    if nonfinite and s * C > 10:
        x[3 % s, 2 % C], x[(s - 1), C - 1], x[0, 1 % C] = float("nan"), float("inf"), float("-inf")
    return x


def _check(x, pool, bits):
    s, C = x.shape
    u = torch.rand(s, C)
    got = triton_dual.dual_encode(x, pool, bits, noise=u)
    want = ref.dual_encode_ref(x, pool, bits, u)
    for name, a, b in zip(("lfc", "codes", "zero", "step"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    y = triton_dual.dual_decode(*want, pool, bits, s, C, x.dtype)
    ry = ref.dual_decode_ref(*want, pool, bits, s, C, x.dtype)
    assert torch.equal(torch.isnan(y), torch.isnan(ry))
    assert torch.equal(y.nan_to_num(0.0), ry.nan_to_num(0.0))
    assert torch.equal(torch.isnan(y), ~torch.isfinite(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,C,pool", [(1, 1, 8), (13, 5, 3), (127, 3, 8), (30, 130, 8)])
def test_kernels_match_reference(dtype, s, C, pool):
    _check(_input(s, C, dtype), pool, 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_other_bit_widths(bits):
    _check(_input(20, 70, torch.float32), 6, bits)


def test_constant_channels():
    x = torch.full((10, 6), 0.3)
    x[:, 2] = 1.0
    _check(x, 4, 2)


def test_in_kernel_noise_is_unbiased():
    s, C, pool, bits = 16, 24, 8, 2
    x = _input(s, C, torch.float32, nonfinite=False)
    n = 24
    acc = torch.zeros(s, C)
    for i in range(n):
        enc = triton_dual.dual_encode(x, pool, bits, seed=torch.tensor([1000 + 17 * i]))
        acc += triton_dual.dual_decode(*enc, pool, bits, s, C, torch.float32)
    step = enc[3].float().abs()
    # std of the mean <= step / (2 sqrt(n)); 5 sigma per element
    assert ((acc / n - x).abs() <= 5 * step / (2 * math.sqrt(n)) + 1e-6).all()
    # and the same LFC / scales as the reference (only the noise differs)
    want = ref.dual_encode_ref(x, pool, bits, torch.rand(s, C))
    for i in (0, 2, 3):
        assert torch.equal(enc[i], want[i])


def test_needs_exactly_one_noise_source():
    with pytest.raises(ValueError, match="noise"):
        triton_dual.dual_encode(torch.randn(4, 4), 2, 2)
