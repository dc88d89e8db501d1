"""The search for the best plan: the full MILP, and identical layers split between
whole-block recompute and per-site choices.

One job: find the plan `solve_plan` returns, within its time limit (`full_search`). Equal
blocks share variables, so a uniform model is one small MILP whatever its depth. Blocks that
differ (per-layer sensitivities, pipeline stages) make a multiple-choice knapsack whose LP
bound is a few percent loose: the solver finds a good plan in well under a second but can
search for minutes to prove it optimal; the merged problem's plan (`llm_act.planner.merge`)
stands in when the full search finds nothing better in time. Splitting a class's blocks
between whole-block recompute and per-site choices inside the model made it 10-100x slower
to solve, so that split is searched around it (`mixed_whole_blocks`: bisection, then golden section, over
the number of whole blocks).
"""
from __future__ import annotations

import math
import time
from typing import Optional

from llm_act.planner.classes import BlockClass, Solution, evaluate_choice
from llm_act.planner.merge import merge_classes, spread_solution
from llm_act.planner.milp_model import VAR_RTOL, SolverError, TimeLimit, solve_verified, solver_names


def _split(classes: list[BlockClass], k: int, whole: int) -> list[BlockClass]:
    """`classes` with `whole` blocks of class k recomputed whole: class k keeps its other
    blocks (per-site choices only) and a class without sites holds the whole ones, last."""
    cls = classes[k]
    rest = BlockClass(cls.sites, cls.inflight, cls.count - whole, cls.options, grad=cls.grad, stages=cls.stages,
                  first=cls.first)
    part = BlockClass((), cls.inflight, whole, [], cls.full, grad=cls.grad, first=cls.first)
    return classes[:k] + [rest] + classes[k + 1:] + [part]


def _unsplit(classes: list[BlockClass], k: int, sol: Solution) -> Solution:
    """A solution of `_split(classes, k, ...)` as one of `classes`."""
    picks, fulls = [list(p) for p in sol[0][:len(classes)]], [list(f) for f in sol[1][:len(classes)]]
    fulls[k] = list(sol[1][-1])
    return picks, fulls


_GOLDEN = (5 ** 0.5 - 1) / 2


def mixed_whole_blocks(classes, objective, mem_limit, var_limit, limit: TimeLimit, best: Solution) -> Solution:
    """`best` improved by splitting identical layers between whole-block recompute and
    per-site choices: per class of several blocks with whole-block options, the number W of
    whole blocks is searched over [1, count - 1] (the model itself decides 0 or all): the
    least W that fits (bisection: more whole blocks never need more memory), then a golden-
    section search above it, each W an exact solve of `_split`. The best plan by exact
    figures wins, `best` on ties. Relaxed, the best figure is convex in W, so one solve
    beside the model's own W (0 or count) usually settles it; a plan found fits exactly."""
    if objective == "memory":
        return best
    for k, cls in enumerate(classes):
        if cls.count < 2 or not cls.full or not cls.options:
            continue
        found: dict[int, Optional[Solution]] = {}

        def at(whole: int) -> float:
            if whole not in found:
                sol = None
                if time.perf_counter() < limit.deadline:
                    sol, _, _ = solve_verified(_split(classes, k, whole), objective, mem_limit, var_limit, limit)
                found[whole] = None if sol is None else _unsplit(classes, k, sol)
            sol = found[whole]
            return math.inf if sol is None else _score(classes, objective, sol)

        lo, hi = 1, cls.count - 1
        if objective == "time":
            # W whole blocks cost at least W times the cheapest whole-block option
            cheapest = min(o.cost_ms for o in cls.full)
            if cheapest > 0:
                hi = min(hi, math.floor(_score(classes, objective, best) / cheapest))
        if hi < lo:
            continue
        # f(W), the best time with W whole blocks, is convex in W when relaxed: when the
        # model's own answer (W = 0 or count) is no worse than its neighbour, it stands
        taken = sum(best[1][k])
        edge = {0: lo, cls.count: cls.count - 1}.get(taken)
        if edge is not None and edge <= hi and at(edge) >= _score(classes, objective, best):
            continue
        if math.isinf(at(hi)):
            continue
        if math.isinf(at(lo)):
            while hi - lo > 1:  # at(hi) fits, at(lo) does not
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if not math.isinf(at(mid)) else (mid, hi)
            lo = hi
        a, b = lo, hi
        while b - a > 3:
            c, d = b - round(_GOLDEN * (b - a)), a + round(_GOLDEN * (b - a))
            if at(c) <= at(d):
                b = d
            else:
                a = c
        for whole in range(a, b + 1):
            at(whole)
        for whole in sorted(found):
            sol = found[whole]
            if sol is not None and _score(classes, objective, sol) < _score(classes, objective, best):
                best = sol
    return best


def _score(classes, objective: str, sol: Solution) -> float:
    """The objective's own figure of a solution, exact."""
    stored, peak, ms, noise = evaluate_choice(classes, *sol)
    return {"time": ms, "variance": noise}.get(objective, stored + peak)


def full_search(classes, objective, mem_limit, var_limit, limit: TimeLimit, bounds: Optional[list] = None
            ) -> tuple[Optional[Solution], int, bool]:
    """(solution or None when infeasible, variable count, proven optimal): the full MILP
    within the time limit, and, when classes differ only in noise, the merged MILP first
    as a fallback (taken when the full search found nothing better in time)."""
    merged, member = merge_classes(classes)
    fallback = None
    if len(merged) < len(classes):
        sol, _, status = solve_verified(merged, objective, mem_limit, var_limit, limit)
        if sol is not None:
            fallback = spread_solution(classes, member, sol)
            stored, peak, _ms, noise = evaluate_choice(classes, *fallback)
            if var_limit is not None and noise > var_limit * (1 + VAR_RTOL):
                fallback = None
    sol, nvars, status = solve_verified(classes, objective, mem_limit, var_limit, limit, bounds)
    if sol is not None:
        sol = mixed_whole_blocks(classes, objective, mem_limit, var_limit, limit, sol)
    if status in ("optimal", "infeasible"):  # optimal: over whole classes; the split is searched
        return sol, nvars, status == "optimal"
    if fallback is not None and (sol is None or _score(classes, objective, fallback)
                                 < _score(classes, objective, sol)):
        sol = fallback
    if sol is None and status == "timeout":
        raise SolverError(f"the MILP solver found no plan within time_limit={limit.seconds:g} s "
                          f"({len(classes)} distinct blocks); give solve_plan a larger time_limit")
    if sol is None:
        raise SolverError(f"the MILP solvers ({', '.join(solver_names())}) ended without deciding "
                          f"the problem ({len(classes)} distinct blocks), also without presolve")
    return sol, nvars, False
