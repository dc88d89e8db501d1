"""Plan "auto"'s decision at a tracking point: the MILP over the measured profile.

One job: turn the measured profile into a plan. `problem` builds the planner's blocks (the
sites `ActConfig.codecs` pins are left out, their bytes counted as static); `default_budget`
is the budget where the user gives none (on a GPU the memory this process can use after the
first iteration minus `GPU_MARGIN`, on CPU static + the memory of the "compress" plan);
`decide` solves on one rank per pipeline stage, with the output loss chosen beside the plan
(`llm_act.runtime.output_choice`), and broadcasts the decision so every rank switches at the
same step boundary. The noise budget is `ActConfig.variance_budget`, else `noise_fraction`
of the measured sampling noise.

A budget no plan fits: a user-given budget is refused at the first tracking (the decision
carries `refused`; the adapter raises `BudgetTooSmall` on every rank), unless the first
step's check (`budget_check.FirstForward`) accepted it against the analytic minimum; a
GPU's derived budget, or a user budget that stops fitting later, gets the tightest plan and one
warning; the CPU's reference budget gets the tightest plan and one info line
(`budget_is_a_limit`). Any other solver failure is returned as `failure`: a re-planning step never ends a
run. The functions take their asker as a `Planning` (the `Adapter` is one): what a decision
reads of it, declared here so that this module never imports the adapter.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional, Protocol

from llm_act.plan import plan_from
from llm_act.planner import evaluate_plan, InfeasibleVariance, solve_plan
from llm_act.planner.milp import TIME_RESOLUTION, InfeasibleBudget
from llm_act.config import ActConfig
from llm_act.runtime import agreement, memory, output_choice
from llm_act.runtime.measuring import Measurements
from llm_act.runtime.plan_owner import PlanOwner

log = logging.getLogger("llm_act.runtime.controller")

#: the share of device memory left free when the budget comes from the free memory
GPU_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Decision:
    """One tracking point's decision, the same on every rank (the source rank's, broadcast):
    a plan, or none and why. Plain data, so the broadcast pickles it as it is."""

    #: the memory budget it was decided under (bytes)
    budget: int
    #: the statistics shifts this point found (they reset the tracking interval)
    reasons: tuple[str, ...]
    #: {layer: {site: choice}} of the decided layers; None where no plan was decided
    plan: Optional[dict[int, dict[str, str]]] = None
    predicted_bytes: int = 0
    activation_bytes: int = 0
    overhead_ms: float = 0.0
    #: the plan's predicted noise, and the noise budget it was held to (None: not measured)
    noise: Optional[float] = None
    noise_budget: Optional[float] = None
    #: (budget, static, smallest budget) of a user budget no plan fits, refused on every rank
    refused: Optional[tuple[int, int, int]] = None
    #: why the solver broke ("Type: message"); the plan in force then stays
    failure: Optional[str] = None
    #: the output loss chosen with the plan ("stock", "chunked"; None: unchanged), and the
    #: output choice's figures (`output_choice.OutputChoice.to_dict()`)
    output_loss: Optional[str] = None
    output: Optional[dict[str, Any]] = None


class Planning(Protocol):
    """What a decision reads of the adapter that asks for it (`llm_act.runtime.adapt.Adapter`)."""

    controller: PlanOwner
    measured: Measurements
    #: the budget fixed at the first tracking point (None before it)
    budget: Optional[int]
    #: the last planner answer (set by `solve`)
    solution: Any
    #: tracking points of this run
    run_tracks: int
    #: the first forward's budget check (`budget_check.FirstForward`): its `result`
    first: Any

    @property
    def config(self) -> ActConfig:
        """The run's settings."""

    def pins(self, layer: Optional[int] = None) -> dict[str, str]:
        """The sites the user fixed (`ActConfig.codecs`)."""

    def static_bytes(self) -> int:
        """Memory that is not activations."""

    def warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log `msg` the first time a warning of `kind` is given in this run."""


def offers_biased(a: Planning) -> bool:
    """Whether the planner may choose a biased codec: not under a noise budget with
    `biased_codecs="exclude"`."""
    return not (a.measured.noise_bounded() and a.config.biased_codecs == "exclude")


def noise_budget(a: Planning) -> Optional[float]:
    """The summed gradient noise a plan may add: `ActConfig.variance_budget`, else
    `noise_fraction` times the measured mini-batch sampling noise (median of the last
    measurements); None when neither applies or nothing is measured yet."""
    cfg = a.config
    if cfg.variance_budget is not None:
        return cfg.variance_budget
    m = a.measured
    if cfg.noise_fraction is None or not m.sensitivity or not m.sampling_noise:
        return None
    if not math.isfinite(m.sampling_noise):
        return None
    return cfg.noise_fraction * m.sampling_noise


def problem(a: Planning, profile: Any) -> tuple[list, int]:
    """(blocks, static bytes) of the MILP for `profile`: the pinned sites are left out of
    the blocks and their stored bytes (all micro-batches in flight) count as static,
    with what is not activations and what no planned site owns."""
    pins = a.pins()
    inflight = memory.inflight()
    blocks = profile.blocks(a.measured.planner_c() or None, inflight=inflight, recompute=True, exclude=pins,
                            coherence=a.measured.planner_coherence(), unbiased_only=not offers_biased(a),
                            min_bits=a.config.min_bits)
    pinned = sum(st.stored(pins[site]) for (_, site), st in profile.sites.items() if site in pins)
    return blocks, a.static_bytes() + profile.other_bytes + inflight * pinned


def solve_alone(a: Planning, profile: Any, budget: int):
    """The plan this rank would choose from `profile` alone (no agreement): the planner's
    answer over `problem(profile)`, for diagnostics and tests."""
    blocks, static = problem(a, profile)
    sol = solve_plan(blocks, budget, static_bytes=static, variance_budget=noise_budget(a),
                     time_resolution=TIME_RESOLUTION, loss_bytes=profile.loss_bytes)
    return profile.plan_from(sol, exclude=a.pins())


def budget_is_a_limit(a: Planning) -> bool:
    """Whether this point's budget is a memory limit (the user's, or a GPU's free memory) and
    not the CPU's reference (`default_budget`: the "compress" plan's bytes). A reference that no
    plan of the choices offered fits (with biased codecs excluded, "compress"'s outlier and
    per-channel codes are not offered) is planned at the tightest plan without a warning: no
    memory runs short."""
    return a.config.budget is not None or agreement.device_free_bytes() is not None


def default_budget(a: Planning, profile: Any, static: int) -> int:
    """The budget of this tracking point: the user's; else the one fixed at the first
    tracking: the free memory minus `GPU_MARGIN` on a GPU, `static` + the "compress" plan's
    bytes on CPU."""
    if a.config.budget is not None:
        return int(a.config.budget)
    if a.budget is not None:
        return a.budget
    free = agreement.device_free_bytes()
    if free is not None:
        budget = int(free[0] + free[1] - GPU_MARGIN * memory.device_memory_bytes())
    else:
        c = a.controller
        compress = plan_from("compress", c.num_layers, c.layers, c.no_fewbit_layers())
        pins = a.pins()
        # all micro-batches in flight on this stage, as the planner counts them
        # (`problem`): stage 0 of PP=2 holds two, and "compress" must fit there too
        blocks = profile.blocks(inflight=memory.inflight(), exclude=pins)
        choice = profile.choice_for(compress, exclude=pins)
        budget = static + evaluate_plan(blocks, choice, loss_bytes=profile.loss_bytes).activation_bytes
    return budget


def decide(a: Planning, profile: Any, blocks: list, static: int, budget: int, reasons: list[str],
           g: Any) -> Decision:
    """The decision of this tracking point, the same on every rank: the source rank chooses
    the output loss (`output_choice.decide`, "auto") and the plan (`solve`), and broadcasts."""
    decision = None
    if agreement.is_source(g):
        # output_loss "auto": stock or chunked output loss, with the plan (`output_choice`)
        out = output_choice.decide(a.controller, blocks, static, budget, noise_budget(a), memory.inflight())
        decision = solve(a, profile, blocks, static if out is None else out.static_bytes, budget, reasons)
        decision = dataclasses.replace(
            decision, output_loss=None if out is None or decision.plan is None else out.choice,
            output=None if out is None else out.to_dict())
    return agreement.broadcast(decision, g)


def feasible_without(blocks: list, budget: int, static: int, noise: Optional[float], sites: list[str],
                     loss_bytes: int = 0) -> bool:
    """Whether a plan meets the noise budget once the site types in `sites` add no noise
    (their c is a stand-in): if so, the stand-ins are why none does now."""
    quiet = [dataclasses.replace(b, sites=tuple(dataclasses.replace(s, sensitivity=0.0) if s.name in sites else s
                                                for s in b.sites)) for b in blocks]
    try:
        solve_plan(quiet, budget, static_bytes=static, variance_budget=noise, time_resolution=TIME_RESOLUTION,
                   loss_bytes=loss_bytes)
    except (InfeasibleVariance, InfeasibleBudget):
        return False
    return True


def in_force_if_as_good(a: Planning, profile: Any, blocks: list, static: int, budget: int,
                        noise: Optional[float], sol: Any) -> Optional[Any]:
    """The plan in force, priced on this point's profile, where it still fits the budget and
    the noise budget and is slower than the solver's `sol` by no more than the time
    resolution; else None. Plans change for a gain, not for the drift of the measured
    figures from point to point, which flips a near-tie one way and back (two norms' inputs
    of one shape, INT4 at one or the other)."""
    c = a.controller
    try:
        current = evaluate_plan(blocks, profile.choice_for(c.pending_plan or c.plan, exclude=a.pins()),
                                loss_bytes=profile.loss_bytes)
    except (ValueError, KeyError):  # a choice this profile does not offer: re-plan
        return None
    if current.activation_bytes + static > budget:
        return None
    if noise is not None and current.variance > noise:
        return None
    if current.overhead_ms > sol.overhead_ms * (1.0 + TIME_RESOLUTION) + 1e-9:
        return None
    return current


def solve(a: Planning, profile: Any, blocks: list, static: int, budget: int,
          reasons: list[str]) -> Decision:
    """The decision of the source rank: a plan, or None with why (`refused`: a user budget
    too small at the first tracking; `failure`: the solver broke). Never raises: every rank
    must learn the outcome."""
    out = Decision(budget=budget, reasons=tuple(reasons))
    it = a.controller.iteration

    noise = noise_budget(a)

    def solve_at(b: int):
        try:
            return solve_plan(blocks, b, static_bytes=static, variance_budget=noise,
                              time_resolution=TIME_RESOLUTION, loss_bytes=profile.loss_bytes)
        except InfeasibleVariance as err:
            # memory is the hard limit: the least noisy plan that fits it, said once -- unless
            # a stand-in c (a type not measured yet, charged the largest measured c) is why
            standins = a.measured.standin_sites()
            if standins and feasible_without(blocks, b, static, noise, standins, profile.loss_bytes):
                log.debug("llm_act: iteration %d: the noise budget is not met with stand-ins for %s; "
                          "the least noisy plan that fits until they are measured", it, ", ".join(standins))
            else:
                a.warn_once("variance", "llm_act: iteration %d: no plan within the memory budget meets "
                             "the noise budget (%s); using the least noisy plan that fits (said once). "
                             "Fix: a larger budget, or a larger noise_fraction / variance_budget", it, err)
            return solve_plan(blocks, b, static_bytes=static, objective="variance",
                              time_resolution=TIME_RESOLUTION, loss_bytes=profile.loss_bytes)

    try:
        try:
            sol = solve_at(budget)
        except InfeasibleBudget as err:
            # a budget the first step accepted against the analytic minimum is not refused
            # again here (the measured minimum can be a little higher: the real outlier
            # counts): it gets the tightest plan and one warning
            accepted = a.first.result is not None and a.first.result.get("min") is not None
            if a.config.budget is not None and not a.run_tracks and not accepted:
                return dataclasses.replace(out, refused=(int(err.budget_bytes), int(err.static_bytes),
                                                         int(err.min_budget_bytes)))
            if budget_is_a_limit(a):
                a.warn_once("tightest", "llm_act: iteration %d: no plan fits the %s budget of %d bytes "
                            "(%.3f GiB); using the tightest plan, %d bytes (%.3f GiB) (said once)", it,
                            "given" if a.config.budget is not None else "derived", budget,
                            budget / 2**30, err.min_budget_bytes, err.min_budget_bytes / 2**30)
            elif not a.run_tracks:
                log.info("llm_act: iteration %d: the CPU's reference budget (the 'compress' plan's %d bytes) is "
                         "below the tightest plan of the choices offered, %d bytes%s; planning at the tightest",
                         it, budget, err.min_budget_bytes, "" if offers_biased(a) else
                         " (biased codecs are excluded: ActConfig.biased_codecs)")
            sol = solve_at(err.min_budget_bytes)
    except Exception as err:  # a re-planning step must never end the run
        return dataclasses.replace(out, failure=f"{type(err).__name__}: {err}")
    sol = in_force_if_as_good(a, profile, blocks, static, budget, noise, sol) or sol
    a.solution = sol
    return dataclasses.replace(
        out, plan=profile.plan_from(sol, exclude=a.pins()), predicted_bytes=sol.activation_bytes + static,
        noise=float(sol.variance) if a.measured.sensitivity else None, noise_budget=noise,
        activation_bytes=sol.activation_bytes, overhead_ms=sol.overhead_ms)
