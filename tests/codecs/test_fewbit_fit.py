"""Few-Bit Backward's fit: the exact derivatives and the optimal piecewise-constant fit of
f' (sec. 3)."""
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llm_act.codecs.fewbit import FewBit
from llm_act.codecs.fewbit_fit import (
    ACTIVATIONS,
    EVEN,
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
    from llm_act.codecs import fewbit_fit

    monkeypatch.setattr(fewbit_fit, "EVEN", frozenset())
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
