"""The fast path for many distinct blocks that differ only in noise.

One job: plan, in a fraction of a second, a problem of many distinct blocks (>=
`FAST_MIN_CLASSES`: per-layer sensitivities, objective "time", a noise budget) whose full
MILP would search for minutes: the merged MILP (`llm_act.planner.merge`) solved exactly,
then Lagrangian relaxation with exact per-block choices (`llm_act.planner.lagrange`) from
it. Within 0.05% of a 60 s search on 24-512 distinct layers; `Plan.optimal` is False.
"""
from __future__ import annotations

import logging
from typing import Optional

from llm_act.planner.classes import BlockClass, Solution, evaluate_choice
from llm_act.planner.lagrange import lagrange_plan
from llm_act.planner.merge import merge_classes, spread_solution
from llm_act.planner.milp_model import VAR_RTOL, TimeLimit, solve_verified
from llm_act.planner.search import mixed_whole_blocks

log = logging.getLogger(__name__)

#: from this many distinct blocks that differ only in noise (per-layer sensitivities), a
#: time-objective solve with a noise budget takes the fast path (`fast_search`)
FAST_MIN_CLASSES = 16


def fast_search(classes, mem_limit, var_limit, limit: TimeLimit) -> Optional[Solution]:
    """The fast path for many distinct blocks differing only in noise: the merged (uniform)
    MILP solved exactly, then Lagrangian relaxation of both budget rows with exact per-block
    choices (`llm_act.planner.lagrange`) from it, for the blocks the uniform plan does not
    recompute whole (those stay, their bytes, noise and transient held fixed); the better of
    the two by exact figures (ties: the uniform plan). None when the uniform problem has no
    plan (the caller then runs the full search, which decides feasibility)."""
    merged, member = merge_classes(classes)
    sol, _, status = solve_verified(merged, "time", mem_limit, var_limit, limit)
    if sol is None:
        return None
    sol = mixed_whole_blocks(merged, "time", mem_limit, var_limit, limit, sol)
    uniform = spread_solution(classes, member, sol)
    best = uniform
    picks, fulls = uniform
    part = [k for k, c in enumerate(classes) if not c.floor and c.count > sum(fulls[k])]
    held = [BlockClass(c.sites, c.inflight, c.count if c.floor else sum(n), c.options, c.full, c.grad, c.stages,
                   c.first, c.input_bytes)
            for c, n in zip(classes, fulls)]
    held_fulls = [list(n) for n in fulls]
    stored, peak, _ms, noise = evaluate_choice(held, [picks[k] for k in range(len(classes))], held_fulls)
    sub = [BlockClass(classes[k].sites, classes[k].inflight, classes[k].count - sum(fulls[k]),
                  classes[k].options, grad=classes[k].grad, stages=classes[k].stages) for k in part]
    # Lagrangian relaxation from the uniform plan, its transient bound (the sites the plan
    # keeps stay kept) as is and with its partly decoded groups opened (q kept beside an
    # encoded k, v, out may be encoded too): the best of these by exact figures
    ref = [picks[k] for k in part]
    hint: dict = {}  # the second variant's prices start from the first's
    for open_groups in ((False, True) if sub else ()):
        try:
            lag = lagrange_plan(sub, mem_limit - stored, var_limit - noise if var_limit else var_limit,
                                ref, peak_floor=peak, open_groups=open_groups, hint=hint)
        except Exception as err:  # the fast path never fails a solve: the best plan stands
            log.debug("llm_act: the Lagrangian fast path failed: %r", err)
            break
        if lag is None:
            continue
        trial = [list(p) for p in best[0]]
        for k, row in zip(part, lag):
            trial[k] = list(row)
        cand = (trial, fulls)
        c_stored, c_peak, ms, c_noise = evaluate_choice(classes, *cand)
        if (c_stored + c_peak <= mem_limit and c_noise <= var_limit * (1 + VAR_RTOL)
                and ms < evaluate_choice(classes, *best)[2] * (1 - 1e-12)):
            best = cand
    return best


def fast_applies(classes, objective, mem_limit, var_limit, fast: Optional[bool]) -> bool:
    if fast is False or objective != "time" or var_limit is None or not var_limit > 0:
        return False
    if fast is None and len(classes) < FAST_MIN_CLASSES:
        return False
    return len(merge_classes(classes)[0]) == 1
