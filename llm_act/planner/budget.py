"""Budget search over the analytic profile: what `llm-act plan` solves, apart from its
flags and tables. Every pipeline stage of a model shape is planned under one device budget
(static memory and the activations outside the blocks come off first), and a stage that
cannot fit gets the smallest budget that would. The noise budget defaults to that of the
"compress" plan (each site at its default codec, Adacc sec. 3.2), so the planner never
picks a codec noisier overall than those defaults; the runtime and the bench reuse
`min_budget` and `reference_variance` to state a refusal or set a comparable noise budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from llm_act.planner.analytic import (
    DeviceModel,
    ModelShape,
    outer_bytes,
    stage_blocks,
    stage_layers,
    static_bytes,
)
from llm_act.planner.milp import InfeasibleBudget, InfeasibleVariance, evaluate_plan, solve_plan
from llm_act.sites import DEFAULT_CODECS

#: the act_input codec of the reference plan where few-bit does not apply (gated units)
_GLU_ACT_CODEC = "outlier_int4"


@dataclass
class StageResult:
    """One pipeline stage: its plan, or (`plan` None) the smallest budget that fits it."""

    stage: int
    layers: tuple[int, int]
    inflight: int
    static_bytes: int
    outer_bytes: int
    variance_budget: Optional[float]
    plan: object = None
    min_budget_bytes: Optional[int] = None
    blocks: list = field(default_factory=list)


def reference_choice(block) -> dict[str, str]:
    """The "compress" plan for `block`: every site at its default codec (the few-bit one
    replaced where the block does not offer it, i.e. under a gated linear unit)."""
    out = {}
    for site in block.sites:
        name = DEFAULT_CODECS[site.name]
        if name not in {c.name for c in site.codecs}:
            name = _GLU_ACT_CODEC
        out[site.name] = name
    return out


def reference_variance(blocks) -> float:
    """The noise of the "compress" plan over `blocks`: the default noise budget."""
    return evaluate_plan(blocks, [reference_choice(b) for b in blocks]).variance


def min_budget(blocks, static: int, variance_budget: Optional[float], resolution: int = 2**20) -> int:
    """The smallest device budget with a plan, static included: exact without a noise
    budget; with one, within `resolution` bytes above the edge (bisection on feasibility)."""
    try:
        solve_plan(blocks, 0, static_bytes=static)
        lo = static
    except InfeasibleBudget as err:
        lo = err.min_budget_bytes
    if variance_budget is None:
        return lo
    keep_all = sum(b.count * b.inflight * sum(s.nbytes for s in b.sites) for b in blocks)
    hi = static + keep_all  # keeping everything adds no noise: always within the budget

    def fits(budget: int) -> bool:
        try:
            solve_plan(blocks, budget, static_bytes=static, variance_budget=variance_budget)
            return True
        except (InfeasibleBudget, InfeasibleVariance):
            return False

    if fits(lo):
        return lo
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def plan_stages(shape: ModelShape, budget: int, *, zero_stage: int = 0, dp: int = 1,
                device: Optional[DeviceModel] = None,
                variance_budget: Union[str, float, None] = "compress") -> list[StageResult]:
    """Solve every pipeline stage of `shape` under a device `budget` (bytes). A stage that
    cannot fit has `plan` None and `min_budget_bytes` set."""
    device = device or DeviceModel()
    results = []
    for k in range(shape.pp):
        blocks = stage_blocks(shape, k, device)
        static = static_bytes(shape, zero_stage, dp, stage=k)
        outer = sum(outer_bytes(shape, k).values())
        if variance_budget == "compress":
            vb = reference_variance(blocks)
        elif variance_budget in (None, "none"):
            vb = None
        else:
            vb = float(variance_budget)
        res = StageResult(k, stage_layers(shape, k), shape.pp - k, static, outer, vb, blocks=blocks)
        try:
            res.plan = solve_plan(blocks, budget, static_bytes=static + outer, variance_budget=vb)
        except (InfeasibleBudget, InfeasibleVariance):
            res.min_budget_bytes = min_budget(blocks, static + outer, vb)
        results.append(res)
    return results
