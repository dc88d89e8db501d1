"""Few-Bit Backward: the optimal piecewise-constant fit of f' (sec. 3) and the codec."""
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llm_act.codecs import make_codec
from llm_act.codecs.fewbit import (
    ACTIVATIONS,
    EVEN,
    FewBit,
    _dp,
    _fit,
    derivative,
    fit_derivative,
)

# Few-Bit Backward, Table 1: error (3), uniform weight on [-10, 10], 1..4 bits
PAPER_TABLE1 = {
    "gelu": (0.1410, 0.0406, 0.0119, 0.0031),
    "silu": (0.2150, 0.0479, 0.0170, 0.0045),  # "Swish"
    "sigmoid": (0.0181, 0.0038, 0.0009, 0.0002),
    "tanh": (0.1584, 0.0319, 0.0073, 0.0017),
    "softplus": (0.2902, 0.0541, 0.0121, 0.0029),
}
TORCH_ACT = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "softplus": F.softplus,
    "relu": F.relu,
}
SMOOTH = [n for n in ACTIVATIONS if n != "relu"]


def _quad(fn, a, b, pieces=400):
    """Composite 10-point Gauss-Legendre on [a, b] in numpy (open: endpoints not sampled)."""
    nodes, weights = np.polynomial.legendre.leggauss(10)
    edges = np.linspace(a, b, pieces + 1)
    mid, half = (edges[1:] + edges[:-1]) / 2, (edges[1:] - edges[:-1]) / 2
    x = mid[:, None] + half[:, None] * nodes[None, :]
    return float((half[:, None] * weights[None, :] * fn(x)).sum())


def _np(name):
    d = derivative(name)
    return lambda x: d(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()


# ---- the exact derivatives -------------------------------------------------------------------
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_derivative_matches_autograd(name):
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64).requires_grad_()
    (g,) = torch.autograd.grad(TORCH_ACT[name](x).sum(), x)
    assert torch.allclose(derivative(name)(x.detach()), g, atol=1e-12, rtol=0)
    half = derivative(name)(x.detach().to(torch.bfloat16))
    assert half.dtype == torch.bfloat16


# ---- the fit ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PAPER_TABLE1))
def test_errors_match_paper_table1(name):
    # the paper prints 4 decimals
    for bits, paper in zip((1, 2, 3, 4), PAPER_TABLE1[name]):
        assert abs(fit_derivative(name, bits).error - paper) < 6e-5, (name, bits)


@pytest.mark.parametrize("name", SMOOTH)
def test_error_decreases_with_bits(name):
    errors = [fit_derivative(name, b).error for b in (1, 2, 3, 4)]
    for a, b in zip(errors, errors[1:]):
        assert 0 < b < a / 1.5


def test_dp_equals_exhaustive_search_on_a_tiny_grid():
    gen = torch.Generator().manual_seed(5)
    n = 12
    dw = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1
    W = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(dw, 0)])
    v = torch.randn(n, generator=gen, dtype=torch.float64)
    dW = torch.diff(W)
    FW = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(v * dW, 0)])
    F2 = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(v * v * dW, 0)])
    prefix = (W.double(), FW, F2)

    def cost(cuts):
        total = 0.0
        for j, i in zip(cuts[:-1], cuts[1:]):
            seg_w, seg_v = dW[j:i], v[j:i]
            mean = float((seg_w * seg_v).sum() / seg_w.sum())
            total += float((seg_w * (seg_v - mean) ** 2).sum())
        return total

    for k in (2, 3, 4):
        brute = min(cost((0, *c, n)) for c in itertools.combinations(range(1, n), k - 1))
        inner = torch.arange(1, n)
        chosen, best = _dp(prefix, [torch.tensor([0])] + [inner] * (k - 1) + [torch.tensor([n])])
        assert best == pytest.approx(brute, rel=1e-10, abs=1e-12)
        assert cost(chosen) == pytest.approx(brute, rel=1e-10, abs=1e-12)


def test_one_bit_fit_matches_brute_force_over_the_cut():
    # exhaustive search of the single cut on a 0.001 grid, errors from numpy prefix sums
    x = np.linspace(-10, 10, 200_001)
    d = _np("gelu")(x)
    h = x[1] - x[0]
    cf = np.concatenate([[0], np.cumsum((d[1:] + d[:-1]) / 2 * h)])
    cf2 = np.concatenate([[0], np.cumsum((d[1:] ** 2 + d[:-1] ** 2) / 2 * h)])
    idx = np.arange(100, 200_001 - 100, 100)
    left, right = x[idx] + 10, 10 - x[idx]
    err = cf2[-1] - cf[idx] ** 2 / left - (cf[-1] - cf[idx]) ** 2 / right
    table = fit_derivative("gelu", 1)
    assert table.error <= err.min() + 1e-7
    assert table.error == pytest.approx(err.min(), rel=1e-4)
    assert abs(table.boundaries[1] - x[idx[err.argmin()]]) < 0.0015


def test_two_bit_fit_beats_exhaustive_search_on_a_coarse_grid():
    name = "silu"
    cand = np.linspace(-6, 6, 49)[1:-1]
    x = np.linspace(-10, 10, 100_001)
    d = _np(name)(x)
    h = x[1] - x[0]
    cf = np.concatenate([[0], np.cumsum((d[1:] + d[:-1]) / 2 * h)])
    cf2 = np.concatenate([[0], np.cumsum((d[1:] ** 2 + d[:-1] ** 2) / 2 * h)])
    pos = np.searchsorted(x, cand)
    best = math.inf
    for c in itertools.combinations(pos, 3):
        b = (0, *c, len(x) - 1)
        e = cf2[-1] - sum((cf[j] - cf[i]) ** 2 / (x[j] - x[i]) for i, j in zip(b[:-1], b[1:]))
        best = min(best, e)
    err = fit_derivative(name, 2).error
    assert err <= best + 1e-6
    assert err > 0.9 * best  # and the coarse search is not far off


def test_fit_is_converged_in_the_grid():
    for name, bits in (("gelu", 3), ("tanh", 2)):
        coarse = fit_derivative(name, bits).error
        fine = _fit(name, bits, -10.0, 10.0, 2048, 256).error
        assert abs(coarse - fine) < 1e-5 * fine


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_table_shape_and_float32_cuts(name):
    for bits in (1, 3):
        t = fit_derivative(name, bits)
        folded = name in EVEN
        assert t.symmetric == folded
        k = 1 << bits
        assert len(t.cuts) == k - 1 and len(t.levels) == k
        n = 2 * k if folded else k
        assert len(t.values) == n and len(t.boundaries) == n + 1
        assert t.boundaries[0] == -10.0 and t.boundaries[-1] == 10.0
        assert all(a < b for a, b in zip(t.boundaries, t.boundaries[1:]))
        assert all(float(np.float32(c)) == c for c in t.cuts)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_values_are_interval_means_and_error_is_the_integral(name):
    t = fit_derivative(name, 2)
    d = _np(name)
    total = 0.0
    for a, b, y in zip(t.boundaries[:-1], t.boundaries[1:], t.values):
        assert _quad(d, a, b) / (b - a) == pytest.approx(y, abs=1e-9)
        total += _quad(lambda x: (d(x) - y) ** 2, a, b)
    assert t.error == pytest.approx(total, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("name", sorted(EVEN))
def test_even_derivatives_are_fitted_on_the_half_axis_and_mirrored(name, monkeypatch):
    x = torch.linspace(-10, 10, 1001, dtype=torch.float64)
    d = derivative(name)
    assert torch.allclose(d(x), d(-x), atol=1e-15)
    tables = [fit_derivative(name, bits) for bits in (1, 2, 3)]
    for t in tables:
        assert t.boundaries == tuple(-b + 0.0 for b in reversed(t.boundaries))
        assert t.values == tuple(reversed(t.values))
        assert 0.0 in t.boundaries
        assert torch.equal(t.lookup(x), t.lookup(-x))
    # the half-axis table spends all 2**bits codes on |x|: better than a full-axis fit
    from llm_act.codecs import fewbit

    monkeypatch.setattr(fewbit, "EVEN", frozenset())
    for bits, t in zip((1, 2, 3), tables):
        unfolded = _fit.__wrapped__(name, bits, -10.0, 10.0)
        assert len(unfolded.values) == 1 << bits
        assert t.error < unfolded.error


def test_even_fit_on_an_asymmetric_range_weights_both_sides():
    t = fit_derivative("tanh", 2, lo=-2.0, hi=6.0)
    assert t.boundaries[0] == -2.0 and t.boundaries[-1] == 6.0
    d = _np("tanh")
    total = 0.0
    for a, b, y in zip(t.boundaries[:-1], t.boundaries[1:], t.values):
        total += _quad(lambda x: (d(x) - y) ** 2, a, b)
    assert t.error == pytest.approx(total, rel=1e-6)
    # |x| in [0, 2] counts twice: its levels are the means over both sides
    code0 = t.levels[0]
    c = t.cuts[0]
    assert code0 == pytest.approx(_quad(d, 0, c) / c, abs=1e-9)


def test_relu_is_exact():
    for bits in (1, 2):
        t = fit_derivative("relu", bits)
        assert t.error == 0.0
    t = fit_derivative("relu", 1)
    assert t.boundaries == (-10.0, 0.0, 10.0) and t.values == (0.0, 1.0)
    codec = FewBit("relu", 1)
    x = torch.cat([torch.randn(1000) * 20, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    assert torch.equal(codec.decode(codec.encode(x)), (x > 0).float())


def test_fit_is_cached_and_validates_arguments():
    assert fit_derivative("gelu", 3) is fit_derivative("gelu", 3, -10, 10.0)
    with pytest.raises(ValueError, match="swish"):
        fit_derivative("swish", 3)
    for bits in (0, 9, 2.5, True, "3"):
        with pytest.raises(ValueError, match="bits"):
            fit_derivative("gelu", bits)
    with pytest.raises(ValueError, match="lo"):
        fit_derivative("gelu", 2, lo=1.0, hi=1.0)
    with pytest.raises(ValueError, match="lo"):
        fit_derivative("gelu", 2, lo=-math.inf)
    with pytest.raises(ValueError, match="swish"):
        derivative("swish")
    with pytest.raises(ValueError, match="swish"):
        FewBit("swish", 2)


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
