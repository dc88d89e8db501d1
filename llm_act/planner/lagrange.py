"""The planner's fast path for many distinct blocks that differ only in measured figures
(per-layer sensitivities, times that differ by their noise): Lagrangian relaxation of the two budget rows with exact per-block choices,
then a greedy pass in exact arithmetic.

With the memory row priced at mu and the noise row at lam, every site of every block picks
its option alone: argmin cost + lam * noise + mu * inflight * stored. Two couplings stay
exact: the transient peak is held at a bound from a reference plan (a site that plan keeps
stays kept and one it does not recompute is not recomputed, so no block's transient
exceeds the bound) and a recomputed site's few-bit inputs are
settled per block by trying both sides (few-bit allowed at the input, or recompute
forbidden at its readers) and taking the cheaper. Bisection on mu (memory met) inside a
bisection on lam (noise met) gives a plan that fits both budgets; a greedy pass then
spends the slack left (single-site moves, the largest time saving first). Every figure
that decides feasibility is summed in integer bytes / Python floats, in a fixed order, and
every tie goes to the lower option index, then the lower block index: two installations
choose the same plan.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.planner.milp_model import VAR_RTOL
from llm_act.planner.transient import decode_groups, transient_bound

_BISECT = 20  # steps of each bisection (log-scale over ~12 decades: ~3e-5 relative)
#: the memory price at a noise price between two tried ones is first looked for between
#: theirs, widened by this factor (it moves little there); the whole range if not found
_BRACKET = 1.5
#: the price of noise in ms per unit when its budget does not bind: it only breaks ties in time
_NOISE_TIE = 1e-9


def _variants(cls) -> Optional[list[np.ndarray]]:
    """Per dependency pattern, the allowed-option mask (sites x options): for every few-bit
    site either its few-bit options are forbidden or recompute at each of its readers is.
    None when the patterns would be too many (the caller uses the MILP instead)."""
    opts = cls.options
    width = max(len(o) for o in opts)
    base = np.zeros((len(opts), width), dtype=bool)
    for i, o in enumerate(opts):
        base[i, :len(o)] = True
    where = {s.name: i for i, s in enumerate(cls.sites)}
    readers: dict[int, list[int]] = {}
    for i, (site, o) in enumerate(zip(cls.sites, opts)):
        if o[-1].name != RECOMPUTE:
            continue
        for dep in site.inputs:
            j = where[dep]
            if any(not x.gives_value for x in opts[j]):
                readers.setdefault(j, []).append(i)
    fewbit = sorted(readers)
    if len(fewbit) > 4:
        return None
    out = []
    for bits in range(2 ** len(fewbit)):
        mask = base.copy()
        for n, j in enumerate(fewbit):
            if bits >> n & 1:  # few-bit forbidden at j
                for o, x in enumerate(opts[j]):
                    if not x.gives_value:
                        mask[j, o] = False
            else:  # recompute forbidden at j's readers
                for i in readers[j]:
                    mask[i, len(opts[i]) - 1] = False
        out.append(mask)
    return out


class LagrangeProblem:
    """Arrays of `classes` (equal structure; noise and times differing) for the priced choice."""

    def __init__(self, classes, mem_limit: int, var_limit: float, reference: list[list[int]],
                 peak_floor: int = 0, open_groups: bool = False):
        first = classes[0]
        self.classes = classes
        self.mem_limit, self.var_limit = mem_limit, var_limit
        nsite = len(first.options)
        width = max(len(o) for o in first.options)
        self.count = np.array([c.count for c in classes], dtype=np.int64)
        self.inflight = first.inflight
        big = np.inf
        self.cost = np.full((len(classes), nsite, width), big)
        self.stored = np.zeros((nsite, width), dtype=np.int64)
        self.noise = np.zeros((len(classes), nsite, width))
        for i, opts in enumerate(first.options):
            for o, x in enumerate(opts):
                self.stored[i, o] = x.stored
        for k, c in enumerate(classes):
            for i, opts in enumerate(c.options):
                for o, x in enumerate(opts):
                    self.noise[k, i, o] = x.noise
                    self.cost[k, i, o] = x.cost_ms
        self.nbytes = [s.nbytes for s in first.sites]
        # the transient is held at a bound of the reference plan's: a site it keeps stays
        # kept and a site it does not recompute is not recomputed, so no block's transient
        # (recomputed sites + one decode group, `transient.transient_bytes`) exceeds the
        # reference's recomputed bytes + the largest group of the sites it does not keep

        def held(i: int, name: str) -> bool:
            return all(classes[k].options[i][p[i]].name == name for k, p in enumerate(reference))

        kept = [held(i, KEEP) for i in range(nsite)]
        recomputed = [any(classes[k].options[i][p[i]].name == RECOMPUTE for k, p in enumerate(reference))
                      for i in range(nsite)]
        groups = decode_groups([s.name for s in first.sites])
        if open_groups:  # a group the reference decodes at all may be decoded whole
            for g in groups:
                if not all(kept[i] for i in g):
                    for i in g:
                        kept[i] = False
        names = [s.name for s in first.sites]
        bound = transient_bound(self.nbytes, names, [s.inputs for s in first.sites], recomputed,
                                [not k for k in kept], first.stages)
        self.peak = max(peak_floor, bound + (0 if first.stages else first.grad))
        masks = _variants(first)
        if masks is None:
            raise ValueError("too many few-bit sites for the fast path")
        for mask in masks:
            for i, keep_only in enumerate(kept):
                if keep_only:
                    mask[i, 1:] = False
                elif not recomputed[i] and first.options[i][-1].name == RECOMPUTE:
                    mask[i, len(first.options[i]) - 1] = False
        self.masks = masks

    def choose(self, lam: float, mu: float) -> np.ndarray:
        """picks (classes x sites) minimising cost + lam * noise + mu * inflight * stored."""
        # near-ties (equal times) go to the lower noise, then to the lower option index
        score = self.cost + (lam + _NOISE_TIE) * self.noise + (mu * self.inflight) * self.stored[None]
        best_val = None
        best = None
        for mask in self.masks:
            s = np.where(mask[None], score, np.inf)
            pick = np.argmin(s, axis=2)  # first index on ties
            val = np.take_along_axis(s, pick[..., None], axis=2)[..., 0].sum(axis=1)
            if best is None:
                best, best_val = pick, val
            else:
                better = val < best_val
                best = np.where(better[:, None], pick, best)
                best_val = np.where(better, val, best_val)
        return best

    def figures(self, picks: np.ndarray) -> tuple[int, float, float]:
        """(stored bytes, noise, time ms) of picks: bytes in exact integers, noise and time
        summed by numpy in a fixed order (the final plan is re-checked exactly by the MILP
        module's `evaluate_choice`)."""
        idx = np.arange(picks.shape[1])[None, :]
        blk = np.arange(picks.shape[0])[:, None]
        per = self.stored[idx, picks].sum(axis=1)
        stored = int((per * self.count).sum()) * self.inflight
        noise = float((self.noise[blk, idx, picks].sum(axis=1) * self.count).sum())
        ms = float((self.cost[blk, idx, picks].sum(axis=1) * self.count).sum())
        return stored, noise, ms

    def fits(self, stored: int, noise: float) -> tuple[bool, bool]:
        return (stored + self.peak <= self.mem_limit,
                noise <= self.var_limit * (1 + VAR_RTOL) if self.var_limit else noise <= 0.0)


def _min_mu(prob: LagrangeProblem, lam: float, lo: float, hi: float,
            bracket: Optional[tuple[float, float]] = None) -> Optional[tuple[float, np.ndarray]]:
    """The least price on memory at which the picks fit it, to the precision of `_BISECT`
    halvings of [lo, hi] (log scale). `bracket`: where it is expected (the prices found at
    neighbouring `lam`): searched first, so the halvings start from a narrow interval; the
    whole range when the bracket does not hold the edge."""
    def memory_fits(p) -> bool:
        return prob.fits(*prob.figures(p)[:2])[0]

    picks = prob.choose(lam, 0.0)
    if memory_fits(picks):
        return 0.0, picks
    tol = math.log(hi / lo) / 2 ** _BISECT
    top = None
    if bracket is not None and lo < bracket[0] < bracket[1] < hi:
        b_lo, b_hi = bracket
        p = prob.choose(lam, b_hi)
        if memory_fits(p) and not memory_fits(prob.choose(lam, b_lo)):
            lo, hi, top = b_lo, b_hi, p
    if top is None:
        top = prob.choose(lam, hi)
        if not memory_fits(top):
            return None
    while math.log(hi / lo) > tol:
        mid = (lo * hi) ** 0.5
        p = prob.choose(lam, mid)
        if memory_fits(p):
            hi, top = mid, p
        else:
            lo = mid
    return hi, top


def lagrange_plan(classes, mem_limit: int, var_limit: float, reference: list[list[int]],
                  peak_floor: int = 0, open_groups: bool = False,
                  hint: Optional[dict] = None) -> Optional[list[list[int]]]:
    """Picks per class that fit both budgets, or None when the fast path finds none (the
    caller keeps `reference`). `peak_floor`: a transient held elsewhere (blocks the caller
    recomputes whole), below which this one's bound never goes. `open_groups`: a decode group
    the reference decodes in part may be decoded whole (a larger transient bound, more
    sites free to be encoded). `hint`: a dict; the prices found are left in it ("lam"), and
    where it holds them already (a solve of a neighbouring problem) the search for the
    noise price starts around them."""
    try:
        prob = LagrangeProblem(classes, mem_limit, var_limit, reference, peak_floor, open_groups)
    except ValueError:
        return None
    finite = np.isfinite(prob.cost) & (prob.cost > 0)
    cmin = float(prob.cost[finite].min()) if finite.any() else 1.0
    cmax = float(prob.cost[finite].max()) if finite.any() else 1.0
    pos_s = prob.stored[prob.stored > 0]
    pos_n = prob.noise[prob.noise > 0]
    smin = float(pos_s.min()) * prob.inflight if pos_s.size else 1.0
    smax = float(pos_s.max()) * prob.inflight if pos_s.size else 1.0
    nmin = float(pos_n.min()) if pos_n.size else 1.0
    nmax = float(pos_n.max()) if pos_n.size else 1.0
    mu_lo, mu_hi = cmin / smax * 1e-6, cmax / smin * 1e6
    lam_lo, lam_hi = cmin / nmax * 1e-6, cmax / nmin * 1e6

    prices: dict[float, float] = {}  # lam -> the least memory price found there

    def at(lam, near: tuple = ()):
        known = [prices[x] for x in near if prices.get(x, 0.0) > 0]
        bracket = (min(known) / _BRACKET, max(known) * _BRACKET) if known else None
        r = _min_mu(prob, lam, mu_lo, mu_hi, bracket)
        if r is None:
            return None
        prices[lam] = r[0]
        stored, noise, _ = prob.figures(r[1])
        return r[1] if prob.fits(stored, noise)[1] else None

    picks = at(0.0)
    if picks is None:
        best = at(lam_hi)
        if best is None:
            return None
        lo, hi = lam_lo, lam_hi
        prices[lo] = prices.get(0.0, 0.0)
        tol = math.log(hi / lo) / 2 ** _BISECT
        guess = (hint or {}).get("lam")
        if guess and lo < guess / _BRACKET and guess * _BRACKET < hi:  # the neighbour's price, bracketed
            near = at(guess * _BRACKET, (lo, hi))
            if near is not None and at(guess / _BRACKET, (lo, guess * _BRACKET)) is None:
                lo, hi, best = guess / _BRACKET, guess * _BRACKET, near
        while math.log(hi / lo) > tol:
            mid = (lo * hi) ** 0.5
            p = at(mid, (lo, hi))
            if p is not None:
                hi, best = mid, p
            else:
                lo = mid
        picks = best
        if hint is not None:
            hint["lam"] = hi
    picks = _greedy(prob, picks)
    return [[int(o) for o in row] for row in picks]


def blind_input(cls, pick: list[int]) -> Optional[tuple[int, int]]:
    """(site index, input index) of the first recomputed site of `cls` under `pick` whose
    input is stored by a codec that does not keep the value (a few-bit code holds f'(x));
    None when every recomputation can read its inputs."""
    where = {s.name: i for i, s in enumerate(cls.sites)}
    for i, site in enumerate(cls.sites):
        if cls.options[i][pick[i]].name != RECOMPUTE:
            continue
        for dep in site.inputs:
            j = where[dep]
            if not cls.options[j][pick[j]].gives_value:
                return i, j
    return None


def _valid(cls, pick: list[int]) -> bool:
    return blind_input(cls, pick) is None


def _greedy(prob: LagrangeProblem, picks: np.ndarray) -> np.ndarray:
    """Spend the slack: single-site moves that save time and keep both budgets, the
    largest saving first (ties: lower block, site, option)."""
    picks = picks.copy()
    stored, noise, _ = prob.figures(picks)
    allowed = np.logical_or.reduce(prob.masks)
    nk, ns = picks.shape
    for _ in range(nk * ns):
        cur_cost = np.take_along_axis(prob.cost, picks[..., None], axis=2)
        dcost = (prob.cost - cur_cost) * prob.count[:, None, None]
        dcost = np.where(allowed[None], dcost, np.inf)
        order = np.argwhere(dcost < -1e-12)
        if not len(order):
            break
        gains = dcost[tuple(order.T)]
        # the moves that keep both budgets (screened in floating point, each taken one is
        # re-summed exactly below), the largest saving first
        kk, ii, oo = order[:, 0], order[:, 1], order[:, 2]
        old_o = picks[kk, ii]
        ds = prob.count[kk] * prob.inflight * (prob.stored[ii, oo] - prob.stored[ii, old_o])
        dn = prob.count[kk] * (prob.noise[kk, ii, oo] - prob.noise[kk, ii, old_o])
        room = stored + ds + prob.peak <= prob.mem_limit
        room &= (noise + dn <= prob.var_limit * (1 + VAR_RTOL)) if prob.var_limit else (noise + dn <= 0.0)
        order, gains = order[room], gains[room]
        if not len(order):
            break
        rank = np.lexsort((order[:, 2], order[:, 1], order[:, 0], gains))
        moved = False
        for r in rank:
            k, i, o = (int(v) for v in order[r])
            old = int(picks[k, i])
            c = int(prob.count[k])
            ds = c * prob.inflight * (int(prob.stored[i, o]) - int(prob.stored[i, old]))
            dn = c * (float(prob.noise[k, i, o]) - float(prob.noise[k, i, old]))
            if not prob.fits(stored + ds, noise + dn) == (True, True):
                continue
            trial = [int(v) for v in picks[k]]
            trial[i] = o
            if not _valid(prob.classes[k], trial):
                continue
            picks[k, i] = o
            stored, noise, _ = prob.figures(picks)  # re-summed exactly
            if prob.fits(stored, noise) != (True, True):
                picks[k, i] = old
                stored, noise, _ = prob.figures(picks)
                continue
            moved = True
            break
        if not moved:
            break
    return picks
