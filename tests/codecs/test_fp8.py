"""FP8 codec: size, rounding bound, error model, non-finite values, odd inputs."""
import math

import pytest
import torch

from llm_act.codecs import FP8, make_codec
from llm_act.codecs.base import side_list_nbytes
from tests.codecs._checks import assert_nonfinite_kept

MBITS = {"e4m3": 3, "e5m2": 2}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _dists(shape=(64, 2, 256)):
    g = torch.Generator().manual_seed(1)
    normal = torch.randn(shape, generator=g)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample(shape)
    outliers = torch.randn(shape, generator=g) * torch.where(
        torch.rand(shape[-1], generator=g) < 0.02, 60.0, 1.0)
    return {"normal": normal, "laplace": laplace, "outlier_channels": outliers}


def test_bad_format_and_block():
    with pytest.raises(ValueError, match="fmt"):
        FP8("e3m4")
    with pytest.raises(ValueError, match="block"):
        FP8(block=0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(1,), (127,), (3, 5, 130), (256, 2, 512)])
def test_nbytes_exact(fmt, shape):
    c = FP8(fmt)
    x = torch.randn(shape)
    enc = c.encode(x)
    n = math.prod(shape)
    assert enc.nbytes == c.nbytes_for(shape, x.dtype) == n + 4 * math.ceil(n / 128) + side_list_nbytes(n, x.dtype)
    if shape == (256, 2, 512):
        assert enc.bits_per_element() == pytest.approx(8.25 + 8 * side_list_nbytes(n, x.dtype) / n)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_within_half_spacing(fmt):
    c = FP8(fmt, block=100)
    x = torch.randn(4000) * torch.logspace(-3, 3, 4000)
    enc = c.encode(x)
    y = c.decode(enc)
    scale = enc.data["scale"].repeat_interleave(100)[:4000]
    # half a spacing: relative 2^-(m+1) in the normal range, half the subnormal step below
    sub = 2.0 ** (-6 if fmt == "e4m3" else -14) * 2.0 ** -MBITS[fmt] * scale
    bound = torch.maximum(x.abs() * 2.0 ** -(MBITS[fmt] + 1), sub / 2) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all()
    amax_idx = x.view(40, 100).abs().argmax(dim=1) + torch.arange(40) * 100
    torch.testing.assert_close(y[amax_idx], x[amax_idx], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dist", ["normal", "laplace", "outlier_channels"])
def test_expected_error_within_2x(fmt, dist):
    x = _dists()[dist]
    c = FP8(fmt)
    measured = float(((c.roundtrip(x) - x).double() ** 2).mean())
    predicted = c.expected_error(x)
    assert measured / 2 <= predicted <= 2 * measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_nonfinite_positions_and_dtypes(dtype, fmt):
    x = torch.randn(3, 5, 130).to(dtype)
    bad = torch.zeros_like(x, dtype=torch.bool)
    x[0, 1, 7], x[2, 4, 129], x[1, 0, 0] = float("nan"), float("inf"), float("-inf")
    bad[0, 1, 7] = bad[2, 4, 129] = bad[1, 0, 0] = True
    y = make_codec(f"fp8_{fmt}").roundtrip(x)
    assert_nonfinite_kept(x, y)
    # the non-finite values do not spoil their block's scale
    rel = ((y[~bad].float() - x[~bad].float()).abs() / x[~bad].float().abs().clamp(min=1e-3))
    assert rel.max() < 0.3


def test_noncontiguous_empty_zero_and_types():
    c = FP8()
    x = torch.randn(64, 40)
    assert torch.equal(c.roundtrip(x.t()), c.roundtrip(x.t().contiguous()))
    e = c.roundtrip(torch.empty(0, 3))
    assert e.shape == (0, 3) and c.encode(torch.empty(0, 3)).nbytes == 0 == c.nbytes_for((0, 3), torch.float32)
    z = torch.zeros(300)
    assert torch.equal(c.roundtrip(z), z)
    for bad in (torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.complex64)):
        with pytest.raises(TypeError):
            c.encode(bad)


def test_deterministic_and_global_rng_untouched():
    c = FP8("e5m2")
    x = torch.randn(1000)
    state = torch.get_rng_state()
    a, b = c.roundtrip(x), c.roundtrip(x)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b)
