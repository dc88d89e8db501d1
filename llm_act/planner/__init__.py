"""The per-block MILP planner: keep, compress or recompute each saved tensor at the least
added step time that fits a memory budget and a gradient-noise budget."""
from llm_act.plan import Plan, load_plan_json, plan_json
from llm_act.planner.milp import (
    OBJECTIVES,
    InfeasibleBudget,
    InfeasibleVariance,
    SolverError,
    evaluate_plan,
    solve_plan,
)
from llm_act.planner.profile import BlockProfile, CodecOption, SiteProfile

__all__ = [
    "BlockProfile",
    "CodecOption",
    "InfeasibleBudget",
    "InfeasibleVariance",
    "OBJECTIVES",
    "Plan",
    "SiteProfile",
    "SolverError",
    "evaluate_plan",
    "load_plan_json",
    "plan_json",
    "solve_plan",
]
