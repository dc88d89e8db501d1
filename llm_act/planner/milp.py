"""The per-block planner's entry points: `solve_plan` and `evaluate_plan` (Adacc sec. 3.3,
extended with codecs per site, a transient peak and GACT's variance budget, sec. 4): for
every saved tensor choose keep, a codec, or recompute, at the least added step time that
fits the memory budget.

One job: check the caller's input, run the search, decide what an answer that is not a plan
means (`InfeasibleBudget`, `InfeasibleVariance`, `SolverError`) and assemble the `Plan`
with its exact figures. The work is done in modules of one job each:

- `llm_act.planner.classes`: the options of every site, equal blocks as one class, and the
  exact figures of a choice;
- `llm_act.planner.milp_model`: the MILP (written out there) and the solvers that decide it;
- `llm_act.planner.search`: the full search, identical layers split between whole-block
  recompute and per-site choices;
- `llm_act.planner.merge`: classes that differ only in measured figures solved as one;
- `llm_act.planner.fast`: the fast path for many such classes (Lagrangian relaxation,
  `llm_act.planner.lagrange`).

`time_limit` caps the search; the best plan found by then is used (verified like any
other) and `Plan.optimal` says that optimality was not proven. Many blocks that differ only
in noise (>= FAST_MIN_CLASSES, objective "time", a noise budget) take the fast path instead:
a fraction of a second, within 0.05% of a 60 s search on 24-512 distinct layers.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional, Sequence

from llm_act.codecs.registry import KEEP
from llm_act.plan import Plan, is_whole, whole_layer
from llm_act.planner.classes import (BlockClass, Solution, block_classes, checkpoint_of, end_of_forward_class,
                                     evaluate_choice, exact_added_ms, full_name, no_whole_blocks, site_options,
                                     whole_block_options)
from llm_act.planner.fast import fast_applies, fast_search
from llm_act.planner.lagrange import blind_input
from llm_act.planner.milp_model import VAR_RTOL, SolverError, TimeLimit
from llm_act.planner.profile import BlockProfile, byte_count
from llm_act.planner.search import full_search
from llm_act.sites import CHECKPOINT_SITE

log = logging.getLogger(__name__)

OBJECTIVES = ("time", "variance")
_GIB = float(2**30)
#: the `time_resolution` the adapter plans measured profiles with: times within 1% compare
#: equal, so such near-ties go to the lower noise. Measured (`llm-act bench planner`, 96
#: layers measured 8 times with every figure off by up to 2%): at 1% (or 0) the plans' true
#: added time agrees within 0.001%; at 2-5% the planner optimises the rounded times instead,
#: and the plans' true time spreads by 0.12%
TIME_RESOLUTION = 0.01
#: seconds `solve_plan` lets the solver search before it takes the best plan found so far
TIME_LIMIT_S = 10.0


class InfeasibleBudget(ValueError):
    """No plan fits the memory budget; `min_budget_bytes` is the smallest budget (static
    memory included) that some plan fits."""

    def __init__(self, budget_bytes: int, static_bytes: int, min_budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.static_bytes = static_bytes
        self.min_budget_bytes = min_budget_bytes
        super().__init__(
            f"budget_bytes={budget_bytes} ({budget_bytes / _GIB:.3f} GiB) cannot hold the "
            f"activations: with static_bytes={static_bytes} ({static_bytes / _GIB:.3f} GiB) the "
            f"smallest budget any plan fits is {min_budget_bytes} bytes "
            f"({min_budget_bytes / _GIB:.3f} GiB)"
        )


class InfeasibleVariance(ValueError):
    """No plan that fits the memory budget meets the variance budget; `min_variance` is
    the least summed noise any plan within the memory budget reaches."""

    def __init__(self, variance_budget: float, min_variance: float):
        self.variance_budget = variance_budget
        self.min_variance = min_variance
        super().__init__(
            f"variance_budget={variance_budget!r} cannot be met within the memory budget: "
            f"the least achievable summed noise is {min_variance!r}"
        )


def _limits(budget_bytes, static_bytes) -> tuple[int, int]:
    return (byte_count(budget_bytes, "budget_bytes"), byte_count(static_bytes, "static_bytes"))


def _check_blocks(blocks) -> tuple[BlockProfile, ...]:
    if isinstance(blocks, BlockProfile):
        blocks = (blocks,)
    try:
        blocks = tuple(blocks)
    except TypeError:
        raise TypeError(f"blocks: expected a sequence of BlockProfile, got {blocks!r}") from None
    if not blocks:
        raise ValueError("blocks: expected at least one BlockProfile, got none")
    for b in blocks:
        if not isinstance(b, BlockProfile):
            raise TypeError(f"blocks: expected BlockProfile items, got {b!r}")
    return blocks


def solve_plan(
    blocks: Sequence[BlockProfile],
    budget_bytes: int,
    static_bytes: int = 0,
    variance_budget: Optional[float] = None,
    objective: str = "time",
    time_limit: float = TIME_LIMIT_S,
    fast: Optional[bool] = None,
    time_resolution: float = 0.0,
    loss_bytes: int = 0,
    input_bytes: int = 0,
) -> Plan:
    """The cheapest plan for one device whose activations fit `budget_bytes - static_bytes`
    (and whose summed noise stays within `variance_budget`, when given).

    objective="time" minimises the added step time; "variance" minimises the summed noise
    under the memory budget (GACT's allocation). Raises InfeasibleBudget when no plan fits
    the memory, InfeasibleVariance when none that fits meets the variance budget.
    `time_limit` (seconds) bounds the search: past it the best plan found is returned with
    `optimal=False` (it still fits both budgets exactly).

    `fast`: None (default) plans many distinct blocks that differ only in noise
    (>= FAST_MIN_CLASSES of them: per-layer sensitivities, objective "time", a noise budget
    > 0) by the fast path, Lagrangian relaxation with exact per-block choices, in a fraction
    of a second and within a fraction of a percent of a long MILP search (`llm-act bench
    planner` measures the gap), with `optimal=False`; True forces that path wherever it
    applies, False the full MILP. Smaller or other problems always get the full MILP.

    `time_resolution`: the relative noise of the measured times (e.g. 0.05). Planned times
    are rounded to a geometric grid of that ratio, so profiles whose times differ by less
    (the same run measured twice) choose the same plan: near-ties go to the lower noise, then
    to a fixed order. The plan's figures use the exact times.

    `loss_bytes`: what the end of forward holds besides the blocks' stored tensors (the
    logits and the loss's bookkeeping, freed before any block backpropagates): the peak is
    the larger of it and the largest block's transient (`BlockProfile.grad_bytes` included),
    one definition for every plan (`evaluate_plan` takes it too). `input_bytes`: the stage's
    input, which the model holds until its forward returns (GPTModel's embedding output):
    added to `loss_bytes` when the first block stores its checkpoint encoded (kept, it is that
    stored tensor); `static_memory.input_bytes` gives both for a model shape.
    """
    start = time.perf_counter()
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) \
            or not time_limit > 0 or math.isinf(time_limit):
        raise ValueError(f"time_limit: expected a finite number of seconds > 0, got {time_limit!r}")
    limit = TimeLimit(float(time_limit))
    blocks = _check_blocks(blocks)
    budget, static = _limits(budget_bytes, static_bytes)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if variance_budget is not None:
        if isinstance(variance_budget, bool) or not isinstance(variance_budget, (int, float)) \
                or not variance_budget >= 0 or math.isinf(variance_budget):
            raise ValueError(
                f"variance_budget: expected a finite number >= 0 or None, got {variance_budget!r}"
            )
        variance_budget = float(variance_budget)
    if isinstance(time_resolution, bool) or not isinstance(time_resolution, (int, float)) \
            or not 0 <= time_resolution < 1:
        raise ValueError(f"time_resolution: expected a fraction in [0, 1), got {time_resolution!r}")
    classes, owner = block_classes(blocks, float(time_resolution))
    classes += end_of_forward_class(classes, owner, loss_bytes, input_bytes)
    mem_limit = budget - static
    undecided: Optional[SolverError] = None
    picks, nvars, optimal, quick = None, 0, True, False
    bounds: list = []
    if mem_limit >= 0 and fast_applies(classes, objective, mem_limit, variance_budget, fast):
        picks = fast_search(classes, mem_limit, variance_budget, limit)
        quick = picks is not None
        optimal = not quick
        nvars = sum(len(opts) for c in classes for opts in c.options) + 1 if quick else 0
    try:
        if not quick:
            picks, nvars, optimal = (None, 0, True) if mem_limit < 0 else full_search(
                classes, objective, mem_limit, variance_budget, limit, bounds)
    except SolverError as err:  # decided below: a budget under the edge is the user's error
        picks, nvars, optimal, undecided = None, 0, False, err
    if picks is None:
        # the smallest footprint and the least noise are easy problems: their own limit
        least = full_search(classes, "memory", None, None, TimeLimit(limit.seconds))[0]
        min_act = sum(evaluate_choice(classes, *least)[:2])
        if mem_limit < min_act:
            raise InfeasibleBudget(budget, static, min_act + static)
        if variance_budget is not None:  # the least noise within the memory budget decides
            # (at the very edge of the budget the solver's tolerances may miss the plan the
            # memory search found: that one then stands for the least noise)
            quiet = full_search(classes, "variance", mem_limit, None, TimeLimit(limit.seconds))[0] or least
            least_noise = evaluate_choice(classes, *quiet)[3]
            if least_noise > variance_budget * (1 + VAR_RTOL):
                raise InfeasibleVariance(variance_budget, least_noise)
            if undecided is None:
                picks, optimal = quiet, False
        if picks is None and undecided is not None:
            raise undecided
        if picks is None:
            raise SolverError("the MILP solver found no plan although one fits the memory budget")
    plan = _plan(blocks, classes, owner, picks, exact=time_resolution > 0)
    plan.num_variables = nvars
    plan.objective = objective
    plan.optimal = optimal
    if objective == "time" and bounds and bounds[-1] is not None and not quick:
        plan.bound_ms = bounds[-1]
    plan.solve_seconds = time.perf_counter() - start
    if quick:
        log.debug("llm_act: %d distinct blocks planned by the fast path in %.3f s", len(classes),
                  plan.solve_seconds)
    elif not optimal:
        log.warning("llm_act: the planner stopped at time_limit=%g s with a plan that fits but is not "
                    "proven optimal (%d distinct blocks)", limit.seconds, len(classes))
    return plan


def _plan(blocks, classes, owner, sol: Solution, exact: bool = False, ordered: bool = False) -> Plan:
    """The Plan of a solution; a class's whole-block counts go to its blocks in order. Its
    figures are those of `classes`, or of `blocks` themselves (`exact`: the classes hold
    rounded times)."""
    picks, fulls = sol
    left = [list(f) for f in fulls]
    choice, full, block_fulls = [], [], []
    for block, k in zip(blocks, owner):
        cls = classes[k]
        mine: dict[str, int] = {}
        counts = [0] * len(cls.full)
        room = block.count
        for c, opt in enumerate(cls.full):
            take = min(left[k][c], room)
            if take:
                mine[checkpoint_of(opt.name)] = take
                counts[c] = take
                left[k][c] -= take
                room -= take
        per_site = {s.name: cls.options[i][o].name for i, (s, o) in enumerate(zip(cls.sites, picks[k]))}
        if room == 0 and mine:
            per_site = whole_layer(block, min(mine))
        choice.append(per_site)
        full.append(mine)
        block_fulls.append(counts)
    stored, peak, ms, noise = evaluate_choice(classes, picks, fulls, ordered=ordered)
    if exact:  # only the times were rounded: bytes and noise are the classes' own
        ms = sum(exact_added_ms(b, [classes[k].options[i][o].name for i, o in enumerate(picks[k])], mine)
                 for b, k, mine in zip(blocks, owner, full))
    return Plan(blocks=tuple(blocks), choice=choice, activation_bytes=stored + peak, overhead_ms=ms,
                variance=noise, peak_bytes=peak, full=full)


def evaluate_plan(blocks: Sequence[BlockProfile], choice: Sequence[dict[str, str]],
                  loss_bytes: int = 0, input_bytes: int = 0, ordered: bool = False) -> Plan:
    """The figures of a given choice (e.g. the fixed "keep"/"compress"/"recompute" plans)
    under the same cost model; a site missing from a choice is kept. A choice that
    recomputes every site but the checkpoint is whole-block recompute where the block
    offers it (`BlockProfile.full_ms`), as the layers run it. `ordered`: `blocks` are in
    layer order and a block's transient counts only what it and the blocks before it store
    (the later ones have backpropagated: e.g. one block per layer, `MeasuredProfile.
    blocks(per_layer=True)`); default: every stored byte, the planner's bound."""
    blocks = _check_blocks(blocks)
    choice = list(choice)
    if len(choice) != len(blocks):
        raise ValueError(f"choice: expected {len(blocks)} entries (one per block), got {len(choice)}")
    classes = []
    for b in blocks:
        options = [site_options(s) for s in b.sites]
        classes.append(BlockClass(b.sites, b.inflight, b.count, options, whole_block_options(b, options), b.grad_bytes,
                              b.stage_bytes))
    floor = end_of_forward_class(classes, list(range(len(classes))), loss_bytes, input_bytes)
    picks, fulls = [], no_whole_blocks(classes)
    for n, (cls, block, ch) in enumerate(zip(classes, blocks, choice)):
        if cls.full and is_whole(ch, block):
            name = full_name(ch.get(CHECKPOINT_SITE, KEEP))
            names = [o.name for o in cls.full]
            if name not in names:
                raise ValueError(f"choice[{n}][{CHECKPOINT_SITE!r}]: {ch.get(CHECKPOINT_SITE)!r} is not "
                                 f"an option for the block input here ({', '.join(names)})")
            fulls[n][names.index(name)] = cls.count
            picks.append([0] * len(cls.sites))
            continue
        unknown = set(ch) - {s.name for s in cls.sites}
        if unknown:
            raise ValueError(f"choice[{n}]: sites {sorted(unknown)} are not in the block")
        pick = []
        for s, opts in zip(cls.sites, cls.options):
            name = ch.get(s.name, KEEP)
            names = [o.name for o in opts]
            if name not in names:
                raise ValueError(
                    f"choice[{n}][{s.name!r}]: {name!r} is not an option here ({', '.join(names)})"
                )
            pick.append(names.index(name))
        blind = blind_input(cls, pick)
        if blind is not None:
            i, j = blind
            raise ValueError(
                f"choice[{n}]: {cls.sites[i].name!r} is recomputed from {cls.sites[j].name!r}, whose "
                f"codec {cls.options[j][pick[j]].name!r} does not keep the value"
            )
        picks.append(pick)
    return _plan(blocks, classes + floor, list(range(len(blocks))),
                 (picks + [[] for _ in floor], fulls + [[] for _ in floor]), ordered=ordered)
