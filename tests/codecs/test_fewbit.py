"""Few-Bit Backward's codec: few-bit codes of x that decode to the fitted f' (sec. 3)."""
import math

import pytest
import torch
import torch.nn.functional as F

from llm_act.codecs import make_codec
from llm_act.codecs.fewbit import ACTIVATIONS, FewBit, derivative


# ---- the codec -----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_registry_builds_fewbit(bits):
    c = make_codec(f"fewbit{bits}", activation="silu")
    assert isinstance(c, FewBit) and c.bits == bits and c.activation == "silu"
    assert c.name == f"fewbit{bits}" and not c.lossless and not c.stochastic


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("bits", [1, 3])
def test_decode_is_the_table_lookup_of_x(name, bits):
    codec = FewBit(name, bits)
    t = codec.table
    cuts = torch.tensor(t.cuts, dtype=torch.float32)
    x = torch.cat([torch.randn(3000) * 4, cuts, -cuts, torch.tensor([-50.0, 50.0, 0.0, 1e6])])
    y = codec.decode(codec.encode(x))
    assert y.dtype == x.dtype
    assert torch.equal(y, t.lookup(x))
    # the same through the full-axis table (boundaries, values), away from exact cut points
    z = torch.randn(3000, dtype=torch.float64) * 4
    idx = torch.bucketize(z, torch.tensor(t.boundaries[1:-1], dtype=torch.float64))
    want = torch.tensor(t.values, dtype=torch.float64)[idx]
    assert torch.equal(t.lookup(z), want)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_nbytes_is_exact(bits):
    codec = FewBit("gelu", bits)
    for shape in [(1,), (127,), (1000,), (3, 5, 130), (4096,), (0,)]:
        x = torch.randn(shape)
        n = x.numel()
        enc = codec.encode(x)
        want = math.ceil(n * bits / 8) + math.ceil(math.ceil(n / 128) / 8)
        assert enc.nbytes == want == codec.nbytes_for(shape, torch.bfloat16)
    big = codec.nbytes_for((1 << 20,), torch.float32)
    assert 8 * big / (1 << 20) == bits + 1 / 128


@pytest.mark.parametrize("name", ["gelu", "tanh"])
@pytest.mark.parametrize("bits", [1, 3])
def test_non_finite_inputs_decode_to_nan_at_the_same_positions(name, bits):
    codec = FewBit(name, bits)
    x = torch.randn(5, 300) * 4
    x[0, 3], x[0, 200], x[2, 7], x[4, 299] = math.nan, math.inf, -math.inf, math.nan
    y = codec.decode(codec.encode(x))
    bad = ~torch.isfinite(x)
    assert torch.equal(torch.isnan(y), bad)
    # groups without a non-finite value decode exactly; flagged ones lose only the top bucket
    flat_bad = bad.reshape(-1)
    groups = torch.nn.functional.pad(flat_bad, (0, (-flat_bad.numel()) % 128)).view(-1, 128).any(1)
    flagged = groups.repeat_interleave(128)[: x.numel()].view_as(x)
    want = codec.table.lookup(x)
    assert torch.equal(y[~flagged], want[~flagged])
    ok = flagged & ~bad
    top = codec.table.levels[-1]
    same = y[ok] == want[ok]
    assert bool((same | (want[ok] == top)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (127,), (1000,), (3, 5, 130), (0,), (3, 0, 5)])
def test_shapes_dtypes_and_non_contiguous(shape, dtype):
    codec = FewBit("gelu", 3)
    x = (torch.randn(shape) * 3).to(dtype)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert torch.equal(y, codec.table.lookup(x))
    if x.dim() == 3 and x.numel():
        xt = x.transpose(0, 2)
        assert not xt.is_contiguous()
        yt = codec.decode(codec.encode(xt))
        assert yt.shape == xt.shape and torch.equal(yt, codec.table.lookup(xt))


def test_bad_inputs():
    codec = FewBit("gelu", 2)
    with pytest.raises(TypeError, match="int64"):
        codec.encode(torch.arange(10))
    enc = FewBit("silu", 2).encode(torch.randn(10))
    with pytest.raises(ValueError, match="silu"):
        codec.decode(enc)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gelu_gradient_with_the_decoded_derivative(bits):
    """backward(gelu) with q(x) instead of f'(x): error per element = (g (q - f'))^2,
    whose mean over x ~ U[lo, hi] is E[g^2] * error / (hi - lo) (eq. (3))."""
    codec = FewBit("gelu", bits)
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(200_000, generator=gen, dtype=torch.float64) * 20 - 10).float()
    g = torch.randn(x.shape, generator=gen)
    xr = x.clone().requires_grad_()
    (exact,) = torch.autograd.grad(F.gelu(xr), xr, g)
    approx = g * codec.decode(codec.encode(x))
    mse = float(((approx - exact) ** 2).mean())
    predicted = float((g**2).mean()) * codec.table.error / 20.0
    assert mse == pytest.approx(predicted, rel=0.05)


def _distributions(gen):
    n = (64, 512)
    normal = torch.randn(n, generator=gen) * 2
    laplace = torch.distributions.Laplace(0.0, 2.0).sample(n)
    outliers = torch.randn(n, generator=gen)
    outliers[:, :8] *= 30  # a few outlier channels, most beyond [lo, hi]
    return {"normal": normal, "laplace": laplace, "outlier_channels": outliers}


@pytest.mark.parametrize("name", ["gelu", "silu", "tanh"])
@pytest.mark.parametrize("bits", [1, 3])
def test_expected_error_within_2x_of_measured(name, bits):
    codec = FewBit(name, bits)
    d = derivative(name)
    gen = torch.Generator().manual_seed(2)
    for label, x in _distributions(gen).items():
        measured = float(((codec.decode(codec.encode(x)).double() - d(x.double())) ** 2).mean())
        predicted = codec.expected_error(x)
        assert measured / 2 <= predicted <= 2 * measured, (label, measured, predicted)
        assert predicted == pytest.approx(measured, rel=0.05), label  # much closer, in fact


def test_expected_error_of_uniform_x_is_the_normalised_fit_error():
    codec = FewBit("gelu", 2)
    x = torch.linspace(-10, 10, 100_001)
    x[::1000] = math.nan  # non-finite elements are left out
    assert codec.expected_error(x) == pytest.approx(codec.table.error / 20.0, rel=0.01)
