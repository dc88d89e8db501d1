"""Few-Bit Backward's fit (Novikov et al., sec. 3): the optimal piecewise-constant f'.

The backward of a pointwise activation needs only f'(x); `fit_derivative` finds the
piecewise-constant q with 2**bits intervals (eq. (2)) minimising eq. (3) with weight 1 on
[lo, hi], by the dynamic programming of eqs. (6)-(9). `derivative` gives the exact f' of
each activation. The codec storing the interval indices is `llm_act.codecs.fewbit.FewBit`.

Even derivatives (sigmoid, tanh): as in the paper (Fig. 3, Table 1), the table is fitted
on the folded axis |x| in [0, hi] with all 2**bits intervals there and mirrored, so `bits`
bits per element buy 2**(bits+1) intervals on [lo, hi]. The full-axis table
(`.boundaries`, `.values`) then has 2**(bits+1) intervals; `.cuts`/`.levels` are the
2**bits-interval code table on |x| that the codec uses.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715


# ---- activations and their exact derivatives ---------------------------------------------
def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / _SQRT2))


def _d_gelu(x):
    return 0.5 * (1.0 + torch.erf(x / _SQRT2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(_TANH_C * (x + _TANH_A * x**3)))


def _d_gelu_tanh(x):
    th = torch.tanh(_TANH_C * (x + _TANH_A * x**3))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * _TANH_C * (1.0 + 3.0 * _TANH_A * x * x)


def _silu(x):
    return x * torch.sigmoid(x)


def _d_silu(x):
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _d_sigmoid(x):
    s = torch.sigmoid(x)
    return s * (1.0 - s)


def _d_tanh(x):
    th = torch.tanh(x)
    return 1.0 - th * th


def _softplus(x):  # stable for any |x| (torch's softplus switches to x above 20)
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))


def _relu(x):
    return torch.clamp(x, min=0)


def _d_relu(x):
    return (x > 0).to(x.dtype)


#: name -> (f, f'), both elementwise torch functions
_FUNCS: dict[str, tuple[Callable, Callable]] = {
    "gelu": (_gelu, _d_gelu),
    "gelu_tanh": (_gelu_tanh, _d_gelu_tanh),
    "silu": (_silu, _d_silu),
    "sigmoid": (torch.sigmoid, _d_sigmoid),
    "tanh": (torch.tanh, _d_tanh),
    "softplus": (_softplus, torch.sigmoid),
    "relu": (_relu, _d_relu),
}
ACTIVATIONS: tuple[str, ...] = tuple(_FUNCS)
#: activations whose derivative is even: f'(-x) = f'(x)
EVEN = frozenset({"sigmoid", "tanh"})
MAX_BITS = 8


def _check_name(name) -> str:
    if name not in _FUNCS:
        raise ValueError(
            f"unknown activation {name!r}; known activations: {', '.join(ACTIVATIONS)}"
        )
    return name


def derivative(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exact derivative f' of activation `name` as an elementwise torch function.

    float16/bfloat16 inputs are evaluated in float32 and returned in their own dtype.
    """
    d = _FUNCS[_check_name(name)][1]

    def fprime(x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            return d(x.float()).to(x.dtype)
        return d(x)

    fprime.__name__ = f"d_{name}"
    return fprime


# ---- the table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DerivativeTable:
    """An optimal piecewise-constant approximation q of f' on [lo, hi] (eq. (2)).

    `boundaries`: all cut points of q on [lo, hi], endpoints included (len(values) + 1);
    `values`: q on each interval (the mean of f' there, eq. (4)); `error`: the integral
    over [lo, hi] of (f' - q)^2 (eq. (3), weight 1). Intervals are (s_k, s_{k+1}]; x
    outside [lo, hi] takes the end intervals' values. The code table is `cuts` (2**bits - 1
    interior cut points, float32 numbers) and `levels` (2**bits values) over t = x, or over
    t = |x| when `symmetric`; code = #{cuts < t}.
    """

    name: str
    bits: int
    lo: float
    hi: float
    boundaries: tuple[float, ...]
    values: tuple[float, ...]
    error: float
    symmetric: bool
    cuts: tuple[float, ...]
    levels: tuple[float, ...]

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """The code (bucket index, int64) of every element of x (NaN: arbitrary)."""
        t = x.detach().to(torch.float64).contiguous()
        if self.symmetric:
            t = t.abs()
        cuts = torch.tensor(self.cuts, dtype=torch.float64, device=x.device)
        return torch.bucketize(t, cuts, right=False)

    def lookup(self, x: torch.Tensor) -> torch.Tensor:
        """q(x) in x's dtype (float64 arithmetic)."""
        levels = torch.tensor(self.levels, dtype=torch.float64, device=x.device)
        return levels[self.codes(x)].to(x.dtype)


# ---- fitting: eqs. (6)-(9) on a grid ---------------------------------------------------
_COARSE_CELLS = 1024  # DP over all cut positions on this grid ...
_REFINE = 128  # ... then over the 128x finer grid within _WINDOW coarse cells of each cut
_WINDOW = 2
_GL4 = ((-0.8611363115940526, 0.34785484513745385), (-0.3399810435848563, 0.6521451548625461),
        (0.3399810435848563, 0.6521451548625461), (0.8611363115940526, 0.34785484513745385))

_GL8 = tuple(torch.from_numpy(a) for a in np.polynomial.legendre.leggauss(8))


@dataclass
class _Problem:
    """The weighted fit problem on [a, b]: weight(t) is piecewise constant between knots."""

    f: Callable
    df: Callable
    a: float
    b: float
    knots: list[float]  # a, b and where the weight or f' may jump
    lo: float
    hi: float
    folded: bool

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        """Uniform weight on [lo, hi]; on the folded axis t = |x| both +t and -t count."""
        w = ((t >= self.lo) & (t <= self.hi)).to(t.dtype)
        if self.folded:
            w = w + ((-t >= self.lo) & (-t <= self.hi)).to(t.dtype)
        return w


def _problem(name: str, lo: float, hi: float) -> _Problem:
    f, df = _FUNCS[name]
    if name in EVEN:
        a = 0.0 if lo < 0.0 < hi else min(abs(lo), abs(hi))
        b = max(abs(lo), abs(hi))
        knots = {a, b} | {abs(v) for v in (lo, hi) if a < abs(v) < b}
        return _Problem(f, df, a, b, sorted(knots), lo, hi, True)
    knots = {lo, hi} | ({0.0} if lo < 0.0 < hi else set())
    return _Problem(f, df, lo, hi, sorted(knots), lo, hi, False)


def _grid(p: _Problem, coarse_cells: int, refine: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fine nodes (float64; interior ones rounded to float32 numbers) and coarse node indices.

    Every knot is a node (so a jump of f' such as relu's at 0 is never inside a cell); each
    knot-to-knot segment gets a multiple of `refine` fine cells; every `refine`-th fine
    node is a coarse node.
    """
    nodes, coarse = [torch.tensor([p.knots[0]], dtype=torch.float64)], [0]
    count = 1
    for s0, s1 in zip(p.knots[:-1], p.knots[1:]):
        cells = max(1, round(coarse_cells * (s1 - s0) / (p.b - p.a)))
        t = torch.linspace(s0, s1, cells * refine + 1, dtype=torch.float64)
        inner = t[1:-1].to(torch.float32).to(torch.float64)
        ordered = torch.cat([t[:1], inner, t[-1:]])
        if bool((torch.diff(ordered) > 0).all()):
            t[1:-1] = inner  # float32 cut points: the codec's float32 compare is then exact
        nodes.append(t[1:])
        coarse.extend(count + refine * k - 1 for k in range(1, cells + 1))
        count += cells * refine
    return torch.cat(nodes), torch.tensor(coarse, dtype=torch.int64)


def _prefix(p: _Problem, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. (9): W, FW, F2 = integrals of w, w f', w f'^2 from t[0] to every node (4-pt GL)."""
    h = torch.diff(t)
    mid = 0.5 * (t[:-1] + t[1:])
    w = p.weight(mid)
    cw, cf, cf2 = h * w, torch.zeros_like(h), torch.zeros_like(h)
    for node, weight in _GL4:
        v = p.df(mid + 0.5 * node * h)
        cf += weight * v
        cf2 += weight * v * v
    cf, cf2 = 0.5 * h * w * cf, 0.5 * h * w * cf2
    zero = torch.zeros(1, dtype=torch.float64)
    return tuple(torch.cat([zero, torch.cumsum(c, 0)]) for c in (cw, cf, cf2))


def _segment_cost(prefix, j: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Eq. (8): T(j, i), the squared error of the best constant on [t_j, t_i] (j < i)."""
    W, FW, F2 = prefix
    dw = W[i] - W[j]
    dfw = FW[i] - FW[j]
    return (F2[i] - F2[j]) - dfw * dfw / torch.where(dw > 0, dw, torch.ones_like(dw))


def _dp(prefix, candidates: list[torch.Tensor]) -> tuple[list[int], float]:
    """Eq. (7) over layered candidates: candidates[0] = [start], candidates[-1] = [end],
    candidates[k] = node indices allowed for the k-th cut. Returns the chosen nodes and the
    minimal summed cost (intervals must have positive length)."""
    best = torch.zeros(1, dtype=torch.float64)
    back, costs = [], {}  # layers sharing candidate tensors share their cost matrix
    for prev, cur in zip(candidates[:-1], candidates[1:]):
        key = (id(prev), id(cur))
        if key not in costs:
            cost = _segment_cost(prefix, prev[:, None], cur[None, :])
            costs[key] = cost.masked_fill_(prev[:, None] >= cur[None, :], math.inf)
        best, arg = (best[:, None] + costs[key]).min(dim=0)
        back.append(arg)
    chosen = [int(candidates[-1][0])]
    k = 0
    for layer in range(len(back) - 1, -1, -1):
        k = int(back[layer][k])
        chosen.append(int(candidates[layer][k]))
    return chosen[::-1], float(best[0])


def _optimal_cuts(p: _Problem, intervals: int, coarse_cells: int, refine: int) -> list[float]:
    """Cut points (endpoints included) of the optimal `intervals`-piece approximation."""
    t, coarse = _grid(p, coarse_cells, refine)
    prefix = _prefix(p, t)
    last = t.numel() - 1
    inner = coarse[1:-1]
    if inner.numel() < intervals - 1:
        raise ValueError(f"grid too coarse for {intervals} intervals")
    first = [torch.tensor([0])] + [inner] * (intervals - 1) + [torch.tensor([last])]
    chosen, _ = _dp(prefix, first)
    # refine: each cut moves within _WINDOW coarse cells on the fine grid (still eq. (7))
    span = torch.arange(-_WINDOW * refine, _WINDOW * refine + 1)
    windows = [torch.tensor([0])]
    windows += [(c + span).clamp(1, last - 1).unique() for c in chosen[1:-1]]
    windows += [torch.tensor([last])]
    chosen, _ = _dp(prefix, windows)
    return [float(t[i]) + 0.0 for i in chosen]  # + 0.0: no -0.0


def _integral(p: _Problem, fn: Callable, a: float, b: float, pieces: int = 64) -> float:
    """Integral of w(t) fn(t) over [a, b]: composite 8-point Gauss-Legendre, split at knots."""
    xs, ws = _GL8
    edges = sorted({a, b} | {k for k in p.knots if a < k < b})
    total = 0.0
    for e0, e1 in zip(edges[:-1], edges[1:]):
        s = torch.linspace(e0, e1, pieces + 1, dtype=torch.float64)
        h = torch.diff(s)
        mid = 0.5 * (s[:-1] + s[1:])
        x = mid[:, None] + 0.5 * h[:, None] * xs[None, :]
        total += float((0.5 * h[:, None] * ws[None, :] * p.weight(x) * fn(x)).sum())
    return total


def _interval_mean(p: _Problem, a: float, b: float) -> float:
    """Eq. (4): the weighted mean of f' on [a, b], exactly from the antiderivative f."""
    edges = sorted({a, b} | {k for k in p.knots if a < k < b})
    num = den = 0.0
    for e0, e1 in zip(edges[:-1], edges[1:]):
        w = float(p.weight(torch.tensor(0.5 * (e0 + e1), dtype=torch.float64)))
        f0, f1 = p.f(torch.tensor([e0, e1], dtype=torch.float64)).tolist()
        num += w * (f1 - f0)
        den += w * (e1 - e0)
    return num / den


def _check_fit_args(name, bits, lo, hi) -> tuple[str, int, float, float]:
    _check_name(name)
    integral = isinstance(bits, numbers.Integral) and not isinstance(bits, bool)
    if not integral or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in 1..{MAX_BITS}, got {bits!r}")
    bits = int(bits)
    try:
        lo, hi = float(lo), float(hi)
    except (TypeError, ValueError):
        raise ValueError(f"lo and hi must be numbers, got lo={lo!r}, hi={hi!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"need finite lo < hi, got lo={lo!r}, hi={hi!r}")
    return name, bits, lo, hi


def fit_derivative(name: str, bits: int, lo: float = -10.0, hi: float = 10.0) -> DerivativeTable:
    """The optimal `bits`-bit piecewise-constant approximation of f' for activation `name`.

    Dynamic programming of eqs. (6)-(9) over cut positions: first on a grid of ~1024 cells
    over the fitted range, then within +-2 coarse cells of each cut on a 128x finer grid
    (cut positions ~1e-4 apart: the error is then within ~1e-6 relative of the continuous
    optimum). Values are exact interval means (from the antiderivative); `.error` is
    integrated separately with composite Gauss-Legendre quadrature. Fitted once per
    arguments and cached.
    """
    return _fit(*_check_fit_args(name, bits, lo, hi))


@functools.lru_cache(maxsize=None)
def _fit(name: str, bits: int, lo: float, hi: float, coarse_cells: int = _COARSE_CELLS,
         refine: int = _REFINE) -> DerivativeTable:
    p = _problem(name, lo, hi)
    cuts = _optimal_cuts(p, 1 << bits, coarse_cells, refine)
    levels = [_interval_mean(p, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    error = 0.0
    for (a, b), y in zip(zip(cuts[:-1], cuts[1:]), levels):
        error += _integral(p, lambda x, y=y: (p.df(x) - y) ** 2, a, b)
    if p.folded:
        boundaries, values = _unfold(cuts, levels, lo, hi)
    else:
        boundaries, values = [lo, *cuts[1:-1], hi], levels
    return DerivativeTable(
        name=name, bits=bits, lo=lo, hi=hi, boundaries=tuple(boundaries),
        values=tuple(values), error=error, symmetric=p.folded,
        cuts=tuple(cuts[1:-1]), levels=tuple(levels))


def _unfold(cuts: list[float], levels: list[float], lo: float, hi: float):
    """Full-axis intervals of a table on |x|: mirror it and clip to [lo, hi]."""
    pieces = []
    for (a, b), y in zip(zip(cuts[:-1], cuts[1:]), levels):
        for l, r in ((max(a, lo), min(b, hi)), (max(-b, lo), min(-a, hi))):
            if r > l:
                pieces.append((l, r, y))
    pieces.sort()
    return [pieces[0][0]] + [r for _, r, _ in pieces], [y for _, _, y in pieces]
