"""The adaptive re-planning behind plan "auto" (Adacc sec. 3.4, GACT sec. 4).

Statistics drift during training (outlier channels appear, sensitivities change), so the
plan is revisited at *tracking iterations* whose spacing grows exponentially: 1, 2, 4, ...
iterations apart, at most `ActConfig.adapt_interval_max`. At each one the `Adapter`

0. takes the current batch from the probe given (`controller.step(probe=...)`,
   `set_probe`) or, in every door without one, from the training step the controller's
   hooks recorded (`llm_act.measurement.replay`: the same forward, its loss linearised at the output);
1. re-measures the sites on the current batch (`measure_profile`: bytes with the real
   outlier counts, compression ratios, errors; the op times only at the first tracking,
   they do not drift with the data), and every other time GACT's sensitivities and the
   mini-batch sampling noise (`measure_sensitivity`; the planner takes the median of the
   last three measurements of each c_i);
2. reduces them over the ranks (`llm_act.runtime.agreement`);
3. solves the MILP on one rank per pipeline stage under the budget and the noise budget
   (`ActConfig.variance_budget`, else `noise_fraction` of the measured sampling noise, per
   parameter group) and broadcasts the decision; every rank switches at this step boundary;
4. warns when the plan's predicted noise dominates the sampling noise.

Independently of the plan mode, every `ActConfig.fidelity_every` iterations (or on
request) the recorded step is run again exact and compressed and the relative gradient
error is reported (`llm_act.measurement.fidelity`).

A sharp shift -- an outlier rate, or the sensitivity of a site carrying at least 10% of the
predicted noise, that moved by more than 2x since the last tracking -- resets the spacing to
1. Every plan change is logged in one line and kept in
`history`. The budget is `ActConfig.budget` (the whole device, static memory included) or,
fixed at the first tracking: on a GPU the memory this process can use after the first
iteration minus a 5% margin, on CPU static + the memory of the "compress" plan.
`ActConfig.codecs` pins sites: the planner chooses the other sites around them.
`adapt=False` solves once, at the first tracking, and keeps that plan.

A budget no plan fits: a user-given `ActConfig.budget` is refused at the first tracking
(`BudgetTooSmall`, a ValueError naming the smallest budget that works, on every rank), as
`llm-act plan` refuses it. Where no probe is given (the DeepSpeed and Megatron-LM doors, a
plain loop) the same refusals come from the real first step, through hooks the controller
installs on the model (`FirstForward`): a fixed plan over the budget raises
`PlanOverBudget`, a budget below the smallest any plan fits (analytic profile of the
megatron-core layers at the observed shape) `BudgetTooSmall`; a budget that check accepted is not refused again at the first tracking
(the measured minimum may be a little higher). A derived budget, or a user
budget that stops fitting later (outliers grew), gets the tightest plan and one warning. A
re-planning step never ends a run: any other solver failure keeps the plan in force, warns
once and is counted in `solver_failures` (checkpointed; `summary()` says it).
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from llm_act.codecs.fewbit import ACTIVATIONS
from llm_act.codecs.registry import KEEP, RECOMPUTE, UNBIASED_CODECS
from llm_act.ledger import current_ledger, SavedTensorLedger
from llm_act.measurement import fidelity
from llm_act.measurement.fidelity import FidelityReport
from llm_act.measurement.measure import measure_profile
from llm_act.measurement.replay import StepReplay
from llm_act.measurement.sensitivity import check_noise, measure_sensitivity, sensitive_sites
from llm_act.plan import plan_from
from llm_act.planner import evaluate_plan, InfeasibleVariance, solve_plan
from llm_act.planner.analytic import block_profile, DeviceModel, DTYPES, ModelShape
from llm_act.planner.budget import min_budget
from llm_act.planner.milp import TIME_RESOLUTION, InfeasibleBudget
from llm_act.runtime import agreement, output_choice
from llm_act.runtime.logs import speaks_for_stage
from llm_act.sites import DEFAULT_CODECS

if TYPE_CHECKING:
    from llm_act.runtime.controller import Controller  # it owns this Adapter

log = logging.getLogger("llm_act.runtime.controller")

#: a statistic that moved by more than this factor since the last tracking resets the spacing
SHIFT_FACTOR = 2.0
#: the share of device memory left free when the budget comes from the free memory
GPU_MARGIN = 0.05
#: outlier rates are compared as (a + eps) / (b + eps), eps = this many channels' share, at
#: least _OUTLIER_EPS_RATE (a change of a few channels of many, within the scatter of a
#: token sample, is not a shift)
_OUTLIER_EPS_CHANNELS = 2
_OUTLIER_EPS_RATE = 0.01
#: the planner uses the median of the last this many sensitivity measurements (a two-draw
#: estimate can be off by 10x on a small batch; one wild draw must not move the plan)
SENS_WINDOW = 3
#: a sensitivity shift counts only for a site carrying at least this share of the plan's
#: predicted noise (two-draw estimates of minor sites fluctuate without consequence)
SENS_SHARE = 0.1
#: every this many tracking points every codec is measured again on every site; in between,
#: only the codecs whose bytes depend on the data (outlier channels) and those in force
#: (their errors feed the noise check), the others' figures carried over
FULL_PROFILE_EVERY = 4
#: after the first measurement of every site type, this many types are measured again at
#: each sensitivity point, in rotation (sparse sampling: the cost of a point stays small)
SENS_SITES_PER_TRACK = 2


class BudgetTooSmall(InfeasibleBudget):
    """A user-given activation budget that no plan fits, refused at the first tracking;
    the message names the setting and the smallest budget that works."""

    def __init__(self, budget_bytes: int, static_bytes: int, min_budget_bytes: int):
        super().__init__(budget_bytes, static_bytes, min_budget_bytes)
        gb_up = math.ceil(min_budget_bytes / 1e6) / 1e3  # rounded up to the MB: passing it back works
        self.args = (
            f"the activation budget of {budget_bytes} bytes ({budget_bytes / 1e9:.3f} GB) is "
            f"too small: with {static_bytes} bytes ({static_bytes / 2**30:.3f} GiB) of static memory "
            f"(parameters, gradients, optimizer state, tensors no site owns) the smallest budget any plan fits is "
            f"{min_budget_bytes} bytes = {min_budget_bytes / 1e9:.3f} GB = {min_budget_bytes / 2**30:.3f} GiB; "
            f"raise --act-compress-budget (the 'budget' key of the DeepSpeed 'activation_compression' "
            f"section, ActConfig.budget) to at least {gb_up:.3f}GB, or leave it unset",)


class PlanOverBudget(ValueError):
    """A fixed plan (not "auto") that holds more than the user-given budget, refused at the
    first iteration: nothing would re-plan it to fit."""

    def __init__(self, plan: str, budget_bytes: int, needed_bytes: int):
        self.budget_bytes, self.needed_bytes = budget_bytes, needed_bytes
        gb_up = math.ceil(needed_bytes / 1e6) / 1e3
        super().__init__(
            f"plan {plan!r} holds at least {needed_bytes} bytes ({needed_bytes / 1e9:.3f} GB, static "
            f"memory included), more than the activation budget of {budget_bytes} bytes "
            f"({budget_bytes / 1e9:.3f} GB): raise --act-compress-budget (ActConfig.budget) to at least "
            f"{gb_up:.3f}GB, or use plan 'auto', which chooses per site to fit the budget")


def _inflight() -> int:
    """Micro-batches in flight on this pipeline stage under 1F1B: p - k."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_pipeline_model_parallel_world_size() - ps.get_pipeline_model_parallel_rank()
    except Exception:  # megatron-core absent
        pass
    return 1


def device_memory_bytes() -> Optional[int]:
    """Total memory of the current GPU; None on CPU."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def _window_medians(recent: list[dict[str, float]]) -> dict[str, float]:
    """site -> the median of its last SENS_WINDOW values over `recent` measurements."""
    seen = {site for m in recent for site in m}
    return {site: _median([m[site] for m in recent if site in m][-SENS_WINDOW:]) for site in seen}


def _ratio(a: float, b: float, eps: float) -> float:
    a, b = abs(a) + eps, abs(b) + eps
    return max(a, b) / min(a, b) if min(a, b) > 0 else (1.0 if a == b else float("inf"))


def describe_changes(old: dict, new: dict) -> str:
    """'site: old->new (layers a-b)' for every choice that moved."""
    moved: dict[tuple[str, str, str], list[int]] = {}
    for layer in sorted(new):
        for site, choice in new[layer].items():
            before = old.get(layer, {}).get(site, KEEP)
            if before != choice:
                moved.setdefault((site, before, choice), []).append(layer)
    parts = []
    for (site, a, b), layers in moved.items():
        span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}" \
            if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))
        parts.append(f"{site}: {a}->{b} (layers {span})")
    return "; ".join(parts) or "nothing"


class Adapter:
    """Tracking schedule, measurements and plan decisions of one Controller."""

    def __init__(self, controller: "Controller"):
        self.controller = controller
        self.stage = 0
        """backoff stage: the next interval is min(2**stage, adapt_interval_max)"""
        self.next_track = 1
        self.track_count = 0
        self.tracked: list[int] = []
        self.resets: list[tuple[int, list[str]]] = []
        """(iteration, reasons) of every reset of the tracking interval"""
        self.history: list[dict[str, Any]] = []
        self.last: dict[str, dict[str, float]] = {}
        self.sensitivity: dict[str, float] = {}
        """c_i the planner uses: the median of the last SENS_WINDOW measurements"""
        self.c_recent: list[dict[str, float]] = []
        self.coherence: dict[str, float] = {}
        """site type -> kappa a biased codec's noise is charged at (`biased_codecs="charge"`):
        the median of the last SENS_WINDOW measurements"""
        self.coherence_recent: list[dict[str, float]] = []
        self.sampling_noise: Optional[float] = None
        self.budget: Optional[int] = None
        self.times: Optional[dict] = None
        self.profile = None  # the last MeasuredProfile (not checkpointed)
        self.solution = None  # the last planner answer (not checkpointed)
        self.noise_ratio: Optional[float] = None
        self.solver_failures = 0
        """tracking points whose solve failed (the plan in force was kept)"""
        self.output_decision: Optional[dict[str, Any]] = None
        """the last output-loss decision (`output_choice.OutputChoice.to_dict()`; None where the
        planner does not choose it)"""
        self._warned_no_probe = False
        self._warned: set[str] = set()
        """kinds of warning given already (each is said once per run)"""
        self._started = False
        """the checks of the first iteration of this run are done"""
        self._run_start: Optional[float] = None
        self._run_tracks = 0
        """tracking points of this run (a resumed run refuses a new budget as a fresh one does)"""
        self.first = FirstForward(self)
        """the first forward's measurement, from hooks on the model (no probe needed)"""
        self.replay = StepReplay(lambda: self.measure_due() or self.fidelity_due())
        """the training step recorded for measuring where no probe is given"""
        self.measure_seconds = 0.0
        """wall time spent measuring and planning at tracking points (this run)"""
        self._phases: Optional[dict[str, float]] = None
        self.track_costs: list[dict[str, float]] = []
        """per tracking point of this run: its iteration and the seconds of each phase
        ("profile", "sensitivity", "solve": agreement and planner, "total")"""
        self.sens_next = 0
        """where the rotation of sparsely sampled sensitivity sites continues"""
        self.sampling_recent: list[float] = []
        """the last SENS_WINDOW measurements of the mini-batch sampling noise"""
        self.fidelity: list[Any] = []
        """the last `fidelity.HISTORY` gradient-fidelity reports (`FidelityReport`)"""
        self.fidelity_requested = False
        self.fidelity_next = 0
        """where the rotation of the sites a fidelity report measures alone continues"""

    @property
    def config(self):
        return self.controller.config

    @property
    def active(self) -> bool:
        return self.controller.enabled and self.config.plan == "auto"

    @property
    def measurable(self) -> bool:
        """Whether the controlled sites can be measured: megatron-core layers (modules that
        store each site). The generic path's blocks (`BlockSites`) are not measured."""
        return any(isinstance(m, torch.nn.Module) for m in self.controller.all_modules())

    # ---- the schedule --------------------------------------------------------------------
    def measure_due(self) -> bool:
        """Whether the iteration running now (not yet counted) is a tracking iteration
        that must record its training step (`llm_act.measurement.replay`): no probe given."""
        c = self.controller
        return (self.active and self.measurable and c.iteration + 1 >= self.next_track
                and (self.track_count == 0 or self.config.adapt)
                and c._probe is None and c._step_probe is None)

    def fidelity_due(self, iteration: Optional[int] = None) -> bool:
        """Whether `iteration` (default: the one running now, not yet counted) ends with a
        gradient-fidelity report (`ActConfig.fidelity_every`, or `Controller.request_fidelity()`)."""
        c = self.controller
        it = c.iteration + 1 if iteration is None else iteration
        every = self.config.fidelity_every
        return (c.enabled and self.measurable
                and (self.fidelity_requested or (every > 0 and it % every == 0)))

    def after_iteration(self, probe: Optional[Callable[[], Any]]) -> None:
        """Called after every iteration; reports the gradient fidelity and tracks when due
        (with `probe`, else with the training step the hooks recorded)."""
        try:
            self._report_fidelity(probe)
            self._after_iteration(probe)
        finally:
            self.replay.clear()

    def _report_fidelity(self, probe: Optional[Callable[[], Any]]) -> None:
        """The gradient-fidelity report of the iteration just ended (`llm_act.measurement.fidelity`),
        when one is due: logged, kept in `fidelity`, averaged over the ranks."""
        c = self.controller
        if not self.fidelity_due(c.iteration):  # the iteration that has just ended
            return
        g = agreement.groups()
        probe = self._probe_on_every_rank(probe, g)
        if probe is None:
            return
        self.fidelity_requested = False
        lossy = fidelity.lossy_sites(c.plan)
        sites = [lossy[(self.fidelity_next + i) % len(lossy)]
                 for i in range(min(fidelity.SITES_PER_REPORT, len(lossy)))]
        self.fidelity_next += len(sites)
        start = time.perf_counter()
        try:
            named = self._named_params()
            sums = fidelity.measure_sums(c, probe, named, c.plan, sites, seed=self.config.seed + 31 * c.iteration)
            sums = agreement.reduce_dict(sums, "mean", g.world if g else None)
        finally:
            self.measure_seconds += time.perf_counter() - start
        report = fidelity.FidelityReport.from_sums(c.iteration, sums)
        self.fidelity = (self.fidelity + [report])[-fidelity.HISTORY:]
        log.info("llm_act: %s", report.format())

    def _probe_on_every_rank(self, probe: Optional[Callable[[], Any]], g: Any) -> Optional[Callable[[], Any]]:
        """`probe`, else the recorded step's; None unless every rank has one (every rank
        measures or none does: the collectives inside must pair up)."""
        probe = probe or self.replay.probe()
        if g is not None:
            have = agreement.reduce_dict({"p": float(probe is not None)}, "min", g.world)["p"]
            probe = probe if have else None
        return probe

    def _named_params(self) -> list:
        """(name, parameter) of the watched model, the parameters measuring counts."""
        return fidelity.named_params(self.replay.roots, self.controller.probe_params())

    def _after_iteration(self, probe: Optional[Callable[[], Any]]) -> None:
        it = self.controller.iteration
        if self._run_start is None:
            self._run_start = time.perf_counter()
        if not self._started:
            self._started = True
            self._check_user_budget(probe)
        if not self.active or it < self.next_track:
            return
        if self.track_count > 0 and not self.config.adapt:
            return
        if not self.measurable:
            self._warn_once("generic_auto", "llm_act: plan 'auto' measures and re-plans megatron-core "
                            "layers; these blocks are compressed through the generic saved-tensor hooks "
                            "(a Hugging Face-style model), where it keeps the 'compress' plan it starts "
                            "from (name a plan, or pin codecs with ActConfig.codecs, to choose another)")
            return
        probe = self._probe_on_every_rank(probe, agreement.groups())
        if probe is None:
            if not self._warned_no_probe:
                log.warning("llm_act: plan 'auto' could not measure at iteration %d: no training forward "
                            "of the watched model was recorded with its backward on every rank (is the "
                            "model's forward called through the module, and is the controller watching "
                            "it: controller.watch(model)?); the plan stays and measuring is tried again "
                            "at the next iteration", it)
                self._warned_no_probe = True
            self.next_track = it + 1
            return
        start = time.perf_counter()
        self._phases = {"iteration": float(it)}
        try:
            self.track(probe)
        finally:
            spent = time.perf_counter() - start
            self.measure_seconds += spent
            self.track_costs.append({**self._phases, "total": spent})

    def _check_user_budget(self, probe: Optional[Callable[[], Any]]) -> None:
        """After the first iteration of a run, a user-given budget: a warning when it is more
        than the GPU's total memory; for a fixed plan, `_check_fixed_budget`."""
        budget = self.config.budget
        if not self.controller.enabled or budget is None:
            return
        total = device_memory_bytes()
        if total is not None and budget > total:
            log.warning("llm_act: the activation budget of %.3f GB (--act-compress-budget) is more than the "
                        "%.3f GB this GPU has; a plan made for it may run out of memory", budget / 1e9, total / 1e9)
        if probe is None:
            self.first.check_at_boundary()
        elif self.config.plan != "auto":
            self._check_fixed_budget(probe)

    def _check_fixed_budget(self, probe: Optional[Callable[[], Any]]) -> None:
        """Once, after the first iteration of a run: a fixed plan with a user budget is
        measured on this batch (no codec timing) and refused with `PlanOverBudget` when its
        static memory + stored bytes + backward transient (the planner's peak for "auto":
        `MeasuredProfile.transient_bytes`) exceed the budget. The measurement runs the
        memory-efficient attention, so for a plan on stock attention it is a lower bound:
        what it refuses surely does not fit."""
        c = self.controller
        if probe is None:
            self._warn_once("no_probe_budget", "llm_act: the budget of plan %r is not checked without a "
                            "probe (pass controller.step(probe=fn) or controller.set_probe(fn))",
                            self.config.plan)
            return
        names = {n for choice in c.plan.values() for n in choice.values()} - {KEEP, RECOMPUTE}
        g = agreement.groups()
        profile = agreement.agree_profile(measure_profile(c, probe, times_from={}, codecs=sorted(names)), g)
        # stored (all micro-batches in flight) + the backward transient, as "auto" counts it
        need = self._static_bytes() + profile.other_bytes + _inflight() * profile.predicted_bytes(
            c.plan, include_other=False) + profile.transient_bytes(c.plan)
        need = int(agreement.reduce_dict({"n": need}, "max", g.stage if g else None)["n"])
        if need > self.config.budget:
            raise PlanOverBudget(self.config.plan, int(self.config.budget), need)

    def _schedule(self, it: int, reset: bool) -> None:
        if reset:
            self.stage = 0
        self.next_track = it + min(2 ** self.stage, self.config.adapt_interval_max)
        self.stage += 1

    # ---- one tracking point ----------------------------------------------------------------
    def track(self, probe: Callable[[], Any]) -> None:
        c = self.controller
        it = c.iteration
        g = agreement.groups()
        clock = time.perf_counter()
        refresh = self.profile is None or self.track_count % FULL_PROFILE_EVERY == 0
        fresh = None if refresh else sorted(self.data_codecs())
        profile = measure_profile(c, probe, times_from=self.times, codecs=fresh, keep_from=self.profile)
        if not refresh:
            profile.carry_options(self.profile)
        profile = agreement.agree_profile(profile, g)
        if self.times is None:
            self.times = profile.times()
        stats = {"outlier": profile.outlier_rates(),
                 "channels": {site: st.shape[-1] for (_, site), st in profile.sites.items() if st.shape}}
        clock = self._phase("profile", clock)
        if self.config.sensitivity and self.track_count % 2 == 0:
            named = self._named_params()
            sites = self.sensitivity_sites()
            sens = measure_sensitivity(c, probe, [p for _, p in named], seed=self.config.seed + it,
                                       sites=sites, groups=[fidelity.group_name(n) for n, _ in named],
                                       biased=self.coherence_codecs(sites))
            fresh = agreement.reduce_dict(sens.c, "mean", g.world if g else None)
            self.c_recent = (self.c_recent + [fresh])[-SENS_WINDOW * self._sens_rounds():]
            self.sensitivity = _window_medians(self.c_recent)
            if self.charges_biased():
                kappa = agreement.reduce_dict(sens.coherence, "mean", g.world if g else None)
                self.coherence_recent = (self.coherence_recent + [kappa])[-SENS_WINDOW * self._sens_rounds():]
                self.coherence = _window_medians(self.coherence_recent)
            sn = agreement.reduce_dict({} if sens.sampling_noise is None else {"s": sens.sampling_noise},
                                       "mean", g.world if g else None)
            if "s" in sn:  # one micro-batch's halves: a rough estimate, hence the median
                self.sampling_recent = (self.sampling_recent + [sn["s"]])[-SENS_WINDOW:]
            self.sampling_noise = _median(self.sampling_recent) if self.sampling_recent else None
            stats["c"] = dict(self.sensitivity)
            by_site = profile.noise_by_site(c.plan, self.sensitivity, self.coherence)
            total = sum(by_site.values())
            stats["share"] = {s: v / total for s, v in by_site.items()} if total > 0 else {}
        clock = self._phase("sensitivity", clock)
        reasons = self._shifts(stats)
        blocks, static = self.problem(profile)
        stage_group = g.stage if g else None
        static = int(agreement.reduce_dict({"s": static}, "max", stage_group)["s"])
        stock = output_choice.stock_static(c, static, _inflight())  # the default budget's output loss
        budget = int(agreement.reduce_dict({"b": self._budget(profile, stock)}, "min",
                                           stage_group)["b"])
        decision = None
        if agreement.is_source(g):
            # output_loss "auto": stock or chunked output loss, with the plan (`output_choice`)
            out = output_choice.decide(c, blocks, static, budget, self.noise_budget(), _inflight())
            decision = self._solve(profile, blocks, static if out is None else out.static_bytes, budget, reasons)
            decision["output_loss"] = None if out is None or decision["plan"] is None else out.choice
            decision["output"] = None if out is None else out.to_dict()
        decision = agreement.broadcast(decision, g)
        if decision.get("refused") is not None:
            raise BudgetTooSmall(*decision["refused"])
        if decision.get("failure") is not None:
            self.solver_failures += 1
            self._warn_once("failure", "llm_act: iteration %d: the planner failed (%s); the plan in force "
                            "stays (said once; every failure is counted in the run's summary)",
                            it, decision["failure"])
        self._phase("solve", clock)
        self.budget = decision["budget"]
        self.profile = profile
        self.output_decision = decision.get("output")
        old = c.plan
        if decision["plan"] is not None:
            new = {layer: {**old.get(layer, {}), **self.unmeasured(profile, layer), **choice,
                           **self.pins(layer)}
                   for layer, choice in decision["plan"].items()}
            output_moved = c.set_output_loss(decision.get("output_loss"))
            if new != old or output_moved:
                if new != old:
                    c.set_plan(new)
                entry = {
                    "iteration": it,
                    "changes": "; ".join(([describe_changes(old, new)] if new != old else [])
                                         + ([output_moved] if output_moved else [])),
                    "predicted_bytes": decision["predicted_bytes"],
                    "activation_bytes": decision["activation_bytes"],
                    "overhead_ms": decision["overhead_ms"],
                    "reason": "; ".join(decision["reasons"]) or ("first plan" if not self.history else "re-plan"),
                }
                self.history.append(entry)
                entry["noise"] = decision.get("noise")
                entry["output_loss"] = decision.get("output_loss")
                vb = decision.get("noise_budget")
                out = decision.get("output")
                say = log.info if speaks_for_stage() else log.debug  # one line per stage
                say("llm_act: iteration %d: plan changed: %s | predicted memory %.3f MiB of the "
                    "%.3f MiB budget (activations %.3f MiB), predicted noise %s (noise budget %s), "
                    "overhead %.3f ms/iteration%s | why: %s | plan now, per block:\n%s",
                    it, entry["changes"], entry["predicted_bytes"] / 2**20, self.budget / 2**20,
                    entry["activation_bytes"] / 2**20,
                    "unknown" if entry["noise"] is None else f"{entry['noise']:.3g}",
                    "none" if vb is None else f"{vb:.3g}", entry["overhead_ms"],
                    "" if out is None else " | " + output_choice.OutputChoice(**out).describe(),
                    entry["reason"], c.describe(new))
        reset = bool(decision["reasons"])
        if g is not None:  # every stage keeps the same schedule (they track together)
            reset = bool(agreement.reduce_dict({"r": float(reset)}, "max", g.world)["r"])
        in_force = c.pending_plan or c.plan
        if self.sensitivity and self.sampling_noise is not None:
            self.noise_ratio = check_noise(profile.noise(in_force, self.sensitivity, self.coherence),
                                           self.sampling_noise,
                                           where=f" (iteration {it})")
        self.tracked.append(it)
        self.track_count += 1
        self._run_tracks += 1
        if decision["reasons"]:
            self.resets.append((it, list(decision["reasons"])))
            log.info("llm_act: iteration %d: statistics shifted (%s); tracking interval back to 1",
                     it, "; ".join(decision["reasons"]))
        self._schedule(it, reset=reset)

    def _phase(self, name: str, since: float) -> float:
        """Book the seconds since `since` to phase `name` of this tracking point; now."""
        now = time.perf_counter()
        phases = self._phases
        if phases is not None:
            phases[name] = phases.get(name, 0.0) + now - since
        return now

    def data_codecs(self) -> set[str]:
        """Codecs re-measured at every tracking point (see FULL_PROFILE_EVERY)."""
        c = self.controller
        return {"outlier_int4"} | ({n for choice in c.plan.values() for n in choice.values()}
                                   - {KEEP, RECOMPUTE})

    def sensitivity_sites(self) -> Optional[list[str]]:
        """The site types whose c is measured at this tracking point: `SENS_SITES_PER_TRACK`
        in rotation (GACT's c is stable along training; each measured type costs two
        forward/backward passes), all of them the first time when a noise budget
        (`variance_budget`) makes the plan depend on every c."""
        every = sensitive_sites(self.controller)
        first = not self.sensitivity and self.noise_bounded()
        if first or len(every) <= SENS_SITES_PER_TRACK:
            return every
        start = self.sens_next % len(every)
        self.sens_next = start + SENS_SITES_PER_TRACK
        return [every[(start + i) % len(every)] for i in range(SENS_SITES_PER_TRACK)]

    def charges_biased(self) -> bool:
        """Whether biased codecs are charged their measured coherence (under a noise budget)."""
        return self.noise_bounded() and self.config.biased_codecs == "charge"

    def offers_biased(self) -> bool:
        """Whether the planner may choose a biased codec: not under a noise budget with
        `biased_codecs="exclude"`."""
        return not (self.noise_bounded() and self.config.biased_codecs == "exclude")

    def coherence_codecs(self, sites: Optional[list[str]]) -> Optional[dict[str, str]]:
        """site -> the biased codec whose coherence is measured there (with `charges_biased`):
        the one the plan in force uses at that site, else the site's default codec when it
        is biased, else int4_channel (fewbit3 at the activation's input)."""
        if not self.charges_biased():
            return None
        c = self.controller
        out = {}
        for site in sites or sensitive_sites(c):
            in_force = [ch[site] for ch in c.plan.values() if ch.get(site) not in (None, KEEP, RECOMPUTE)]
            biased = [n for n in in_force if n not in UNBIASED_CODECS]
            default = DEFAULT_CODECS.get(site)
            out[site] = (biased[0] if biased else default if default and default not in UNBIASED_CODECS
                         else "fewbit3" if site == "mlp.act_input" else "int4_channel")
        return out

    def _sens_rounds(self) -> int:
        """Measurements it takes for every site type to be measured SENS_WINDOW times."""
        return max(1, -(-len(sensitive_sites(self.controller)) // SENS_SITES_PER_TRACK))

    def _shifts(self, stats: dict[str, dict[str, float]]) -> list[str]:
        """Sharp shifts against the last tracking (and remember these statistics)."""
        reasons = []
        for site, rate in stats["outlier"].items():
            before = self.last.get("outlier", {}).get(site)
            eps = max(_OUTLIER_EPS_CHANNELS / max(1, stats["channels"].get(site, 1)), _OUTLIER_EPS_RATE)
            if before is not None and _ratio(rate, before, eps) > SHIFT_FACTOR:
                reasons.append(f"outlier rate of {site} {before:.3f}->{rate:.3f}")
        if "c" in stats and self.last.get("c"):
            for site, val in stats["c"].items():
                before = self.last["c"].get(site)
                share = max(stats["share"].get(site, 0.0), self.last.get("share", {}).get(site, 0.0))
                if before is not None and share >= SENS_SHARE and _ratio(val, before, 0.0) > SHIFT_FACTOR:
                    reasons.append(f"sensitivity of {site} {before:.3g}->{val:.3g}")
        self.last["outlier"] = dict(stats["outlier"])
        if "c" in stats:
            self.last["c"] = dict(stats["c"])
            self.last["share"] = dict(stats["share"])
        return reasons

    def _static_bytes(self) -> int:
        """Memory that is not activations: on a GPU what is allocated between iterations;
        on CPU the weights and gradients of every parameter of the watched model
        (`Controller.watch`: embeddings and output layer included; under ZeRO-3 this rank's
        partition), else of the controlled layers."""
        if torch.cuda.is_available():
            return int(torch.cuda.memory_allocated())
        roots = self.replay.roots or self.first.roots
        params = ([p for root in roots for p in root.parameters()] if roots
                  else self.controller.probe_params())
        seen, total = set(), 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                local = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
                total += 2 * int(local.numel() if local is not None else p.numel()) * p.element_size()
        return total

    def unmeasured(self, profile: Any, layer: int) -> dict[str, str]:
        """Planned sites of `layer` the profile did not see stored (the memory-efficient
        attention stores no `attn.softmax` and regenerates its dropout mask from the RNG
        state, whatever the choice): "keep", so a plan says what really happens there."""
        return {s: KEEP for s in self.controller.sites(layer) if (layer, s) not in profile.sites}

    def pins(self, layer: Optional[int] = None) -> dict[str, str]:
        """`ActConfig.codecs`: sites the user fixed; the planner chooses around them."""
        c = self.controller
        sites = c.sites(layer) if layer is not None else None
        return {s: n for s, n in self.config.codecs.items() if sites is None or s in sites}

    def problem(self, profile: Any) -> tuple[list, int]:
        """(blocks, static bytes) of the MILP for `profile`: the pinned sites are left out of
        the blocks and their stored bytes (all micro-batches in flight) count as static,
        with what is not activations and what no planned site owns."""
        pins = self.pins()
        inflight = _inflight()
        blocks = profile.blocks(self.sensitivity or None, inflight=inflight, recompute=True, exclude=pins,
                                coherence=self.coherence, unbiased_only=not self.offers_biased())
        pinned = sum(st.stored(pins[site]) for (_, site), st in profile.sites.items() if site in pins)
        return blocks, self._static_bytes() + profile.other_bytes + inflight * pinned

    def solve_alone(self, profile: Any, budget: int):
        """The plan this rank would choose from `profile` alone (no agreement): the planner's
        answer over `problem(profile)`, for diagnostics and tests."""
        blocks, static = self.problem(profile)
        sol = solve_plan(blocks, budget, static_bytes=static, variance_budget=self.noise_budget(),
                         time_resolution=TIME_RESOLUTION)
        return profile.plan_from(sol)

    def _budget(self, profile: Any, static: int) -> int:
        if self.config.budget is not None:
            return int(self.config.budget)
        if self.budget is not None:
            return self.budget
        free = agreement.device_free_bytes()
        if free is not None:
            budget = int(free[0] + free[1] - GPU_MARGIN * device_memory_bytes())
        else:
            c = self.controller
            compress = plan_from("compress", c.num_layers, c.layers, c.no_fewbit_layers())
            pins = self.pins()
            # all micro-batches in flight on this stage, as the planner counts them
            # (`problem`): stage 0 of PP=2 holds two, and "compress" must fit there too
            blocks = profile.blocks(inflight=_inflight(), exclude=pins)
            choice = [{s: n for s, n in ch.items() if s not in pins} for ch in profile.choice_for(compress)]
            budget = static + evaluate_plan(blocks, choice).activation_bytes
        return budget

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(msg, *args)

    def _solve(self, profile: Any, blocks: list, static: int, budget: int,
               reasons: list[str]) -> dict[str, Any]:
        """The decision of the source rank, as plain data for the broadcast: a plan, or
        None with why (`refused`: a user budget too small at the first tracking; `failure`:
        the solver broke). Never raises: every rank must learn the outcome."""
        out: dict[str, Any] = {"plan": None, "budget": budget, "reasons": reasons,
                               "predicted_bytes": 0, "activation_bytes": 0, "overhead_ms": 0.0,
                               "refused": None, "failure": None}
        it = self.controller.iteration

        noise = self.noise_budget()

        def solve(b: int):
            try:
                return solve_plan(blocks, b, static_bytes=static, variance_budget=noise,
                                  time_resolution=TIME_RESOLUTION)
            except InfeasibleVariance as err:
                # memory is the hard limit: the least noisy plan that fits it, said once
                self._warn_once("variance", "llm_act: iteration %d: no plan within the memory budget meets "
                                "the noise budget (%s); using the least noisy plan that fits (said once). "
                                "Fix: a larger budget, or a larger noise_fraction / variance_budget", it, err)
                return solve_plan(blocks, b, static_bytes=static, objective="variance",
                                  time_resolution=TIME_RESOLUTION)

        try:
            try:
                sol = solve(budget)
            except InfeasibleBudget as err:
                # a budget the first step accepted against the analytic minimum is not refused
                # again here (the measured minimum can be a little higher: the real outlier
                # counts): it gets the tightest plan and one warning
                accepted = self.first.result is not None and self.first.result.get("min") is not None
                if self.config.budget is not None and not self._run_tracks and not accepted:
                    out["refused"] = (int(err.budget_bytes), int(err.static_bytes), int(err.min_budget_bytes))
                    return out
                self._warn_once("tightest", "llm_act: iteration %d: no plan fits the %s budget of %d bytes "
                                "(%.3f GiB); using the tightest plan, %d bytes (%.3f GiB) (said once)", it,
                                "given" if self.config.budget is not None else "derived", budget,
                                budget / 2**30, err.min_budget_bytes, err.min_budget_bytes / 2**30)
                sol = solve(err.min_budget_bytes)
        except Exception as err:  # a re-planning step must never end the run
            out["failure"] = f"{type(err).__name__}: {err}"
            return out
        self.solution = sol
        out.update(plan=profile.plan_from(sol), predicted_bytes=sol.activation_bytes + static,
                   noise=float(sol.variance) if self.sensitivity else None, noise_budget=noise,
                   activation_bytes=sol.activation_bytes, overhead_ms=sol.overhead_ms)
        return out

    def noise_bounded(self) -> bool:
        """Whether plans are held to a noise budget (given, or a fraction of the sampling
        noise): then every site's sensitivity is measured at the first tracking."""
        return self.config.sensitivity and (self.config.variance_budget is not None
                                            or self.config.noise_fraction is not None)

    def noise_budget(self) -> Optional[float]:
        """The summed gradient noise a plan may add: `ActConfig.variance_budget`, else
        `noise_fraction` times the measured mini-batch sampling noise (median of the last
        measurements); None when neither applies or nothing is measured yet."""
        if self.config.variance_budget is not None:
            return self.config.variance_budget
        if self.config.noise_fraction is None or not self.sensitivity or not self.sampling_noise:
            return None
        if not math.isfinite(self.sampling_noise):
            return None
        return self.config.noise_fraction * self.sampling_noise

    def measuring_fraction(self) -> Optional[float]:
        """Share of this run's wall time (since its first training forward, or since the
        first tracking point) spent measuring and planning; None before any."""
        start = self.replay.first_forward_time or self._run_start
        if start is None:
            return None
        elapsed = time.perf_counter() - start
        return self.measure_seconds / elapsed if elapsed > 0 else None

    def summary(self) -> str:
        """One line for the end of a run: trackings, plan changes, solver failures, and the
        share of the run's time spent measuring."""
        frac = self.measuring_fraction()
        spent = "" if frac is None or not self.track_count else (
            f"; measuring and planning took {self.measure_seconds:.2f} s, {100 * frac:.1f}% of the run's time")
        last = self.fidelity[-1] if self.fidelity else None
        fid = "" if last is None else (
            f"; gradient fidelity at iteration {last.iteration}: relative error {last.total:.3g}"
            + ("" if last.noise_ratio is None else f", {last.format_noise()}"))
        return (f"re-planning: {self.track_count} tracking points, {len(self.history)} plan changes, "
                f"{self.solver_failures} solver failures (plan kept){spent}{fid}")

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "next_track": self.next_track, "track_count": self.track_count,
            "tracked": list(self.tracked), "resets": [(i, list(r)) for i, r in self.resets],
            "history": [dict(h) for h in self.history],
            "last": {k: dict(v) for k, v in self.last.items()},
            "sensitivity": dict(self.sensitivity), "c_recent": [dict(m) for m in self.c_recent],
            "coherence": dict(self.coherence), "coherence_recent": [dict(m) for m in self.coherence_recent],
            "sampling_noise": self.sampling_noise,
            "budget": self.budget, "times": self.times, "solver_failures": self.solver_failures,
            "sens_next": self.sens_next, "sampling_recent": list(self.sampling_recent),
            "fidelity": [r.to_dict() for r in self.fidelity], "fidelity_next": self.fidelity_next,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = int(state["stage"])
        self.next_track = int(state["next_track"])
        self.track_count = int(state["track_count"])
        self.tracked = list(state["tracked"])
        self.resets = [(int(i), list(r)) for i, r in state.get("resets", [])]
        self.history = [dict(h) for h in state["history"]]
        self.last = {k: dict(v) for k, v in state["last"].items()}
        self.sensitivity = dict(state["sensitivity"])
        self.c_recent = [dict(m) for m in state.get("c_recent", [])]
        self.coherence = dict(state.get("coherence", {}))
        self.coherence_recent = [dict(m) for m in state.get("coherence_recent", [])]
        self.sampling_noise = state["sampling_noise"]
        self.budget = state["budget"]
        self.times = state["times"]
        self.solver_failures = int(state.get("solver_failures", 0))
        self.sens_next = int(state.get("sens_next", 0))
        self.sampling_recent = [float(v) for v in state.get("sampling_recent", [])]

        self.fidelity = [FidelityReport.from_dict(r) for r in state.get("fidelity", [])]
        self.fidelity_next = int(state.get("fidelity_next", 0))


def interval_sequence(n: int, interval_max: int) -> list[int]:
    """The first `n` tracking iterations without shifts: 1, 2, 4, ... (spacing capped)."""
    out, it, stage = [], 1, 0
    for _ in range(n):
        out.append(it)
        it += min(2 ** stage, interval_max)
        stage += 1
    return out


def _outer_saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (opening the ledger's would shadow them)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except Exception:  # an API of torch's internals: when it is gone, assume none
        return False


def _counting(ledger: Any) -> bool:
    """Whether an active ledger still counts live (no backward event froze it yet)."""
    return bool(getattr(ledger, "_active", False)) and getattr(ledger, "_snapshot", None) is None


class FirstForward:
    """The budget check of the doors that give no probe (DeepSpeed's `initialize`,
    Megatron-LM's `pretrain()` around `apply`, a plain PyTorch loop), measured on the real
    first training step through hooks the controller installs itself (`Controller.watch`).

    A forward pre-hook on each root module opens a `SavedTensorLedger` for the first forward
    of that root (only with a user budget and no probe) and a forward hook closes it, so the
    ledger holds what the plan in force stores for backward (compressed layers report their
    encoded bytes), per (layer, site). Where the loop has a ledger of its own open around the
    forward (our trainer measures its first iteration), ours would hide the tensors from it
    (only the innermost saved-tensor hooks fire), so the forward's share is read off that
    ledger as the difference of its live table; under other saved-tensor hooks (CPU offload)
    the forward is not measured and the next one is. A pre-hook on the first controlled
    megatron-core `TransformerLayer` records the [s, b, h] input it sees. Once every root has
    run one measured forward the hooks are removed: nothing runs on later steps.

    With a user budget (`ActConfig.budget`) and no probe, the check runs at the first step
    boundary (`engine.step()`, an attached optimizer's step, the exit of `controller.step()`)
    when something advances the controller, else at the end of the first forward (the
    Megatron-LM door, where nothing may ever advance it):

    - a fixed plan: static memory + the bytes outside the controlled layers + the layers'
      bytes x the micro-batches in flight, against the budget: `PlanOverBudget`;
    - plan "auto" on megatron-core layers: the smallest budget any plan fits, from the
      analytic profile (`llm_act.planner.analytic.block_profile`) of the layers'
      `TransformerConfig` at the observed s, b and dtype, with the same static memory and the
      measured bytes outside the layers: `BudgetTooSmall` below it. ("auto" cannot re-plan
      without a probe yet, so a budget above that edge but below what the plan in force
      holds is warned about once.)
    - plan "auto" on other models (the generic path has no analytic model): a one-time
      warning that the smallest budget is not known, with what the plan in force holds.

    The figures are reduced (max, `llm_act.runtime.agreement`, with its timeouts) over every rank at a
    step boundary, so every rank of the job decides the same and raises together; inside the
    first forward (no boundary) over the ranks of this pipeline stage only (a world-wide
    collective there would wait for later stages that wait for this one), so under pipeline
    parallelism in that door the stage over budget stops and the launcher ends the others.
    On a GPU the static memory inside the first forward is what was allocated before it (no
    optimizer state yet): the refusal is then a lower bound.
    """

    def __init__(self, adapter: "Adapter"):
        self.adapter = adapter
        self.handles: list[Any] = []
        self.roots: list[Any] = []
        self.layers: list[Any] = []
        self.by_site: dict[tuple[Optional[int], str], int] = {}
        self.measured_roots: set[int] = set()
        self.shape: Optional[tuple[int, ...]] = None
        self.dtype: Optional[torch.dtype] = None
        self.static_before: Optional[int] = None
        self.measured = False
        self.checked = False
        self.boundary_seen = False
        self.result: Optional[dict[str, Any]] = None
        """what the check found: need, static, min (for tests and logs)"""
        self._ledgers: dict[int, Any] = {}

    @property
    def controller(self):
        return self.adapter.controller

    # ---- hooks ---------------------------------------------------------------------------
    def install(self, roots: list[Any], layers: Optional[list[Any]] = None) -> None:
        if self.handles or self.measured:
            return  # already watching (apply inside initialize) or done
        self.roots = [r for r in roots if isinstance(r, torch.nn.Module)]
        self.layers = list(layers or [])
        for root in self.roots:
            self.handles.append(root.register_forward_pre_hook(self._pre))
            self.handles.append(root.register_forward_hook(self._post, always_call=True))
        if self.layers:
            first = min(self.layers, key=lambda m: int(getattr(m, "layer_number", 0)))
            self.handles.append(first.register_forward_pre_hook(self._layer_pre, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module: Any, args: Any) -> None:
        key = id(module)
        if key in self.measured_roots or key in self._ledgers or not torch.is_grad_enabled():
            return
        c = self.controller
        if c.config.budget is None or c._step_probe is not None or c._probe is not None:
            self.remove()  # nothing to check here (no budget, or the probe path checks it)
            return
        outer = current_ledger()
        if outer is None and _outer_saved_tensor_hooks():
            return  # saved-tensor hooks of the user's (CPU offload...): ours would hide them
        if outer is not None and not _counting(outer):
            return  # a ledger frozen by a backward: this forward cannot be told apart; the next one
        if self.static_before is None and torch.cuda.is_available():
            self.static_before = int(torch.cuda.memory_allocated())
        if outer is not None:
            # the loop counts this forward already (our trainer's ledger): opening ours would
            # hide the tensors from it, so this forward's share is read off it as a difference
            self._ledgers[key] = (outer, outer.by_site())
            return
        ledger = SavedTensorLedger()
        ledger.__enter__()
        self._ledgers[key] = ledger

    def _layer_pre(self, module: Any, args: Any, kwargs: Any = None) -> None:
        if self.shape is not None:
            return
        # torch calls a kwargs hook without kwargs when hooks are removed mid-iteration
        # (the root module is the first layer itself)
        x = args[0] if args else (kwargs or {}).get("hidden_states")
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            self.shape, self.dtype = tuple(int(n) for n in x.shape), x.dtype

    def _post(self, module: Any, args: Any, output: Any) -> None:
        import sys

        ledger = self._ledgers.pop(id(module), None)
        if ledger is None:
            return
        if isinstance(ledger, tuple):
            outer, before = ledger
            if sys.exc_info()[0] is not None or not _counting(outer):
                return  # failed, or the outer ledger froze inside this forward: the next one
            table = {k: n - before.get(k, 0) for k, n in outer.by_site().items()}
        else:
            ledger.__exit__(None, None, None)
            if sys.exc_info()[0] is not None:
                return  # the forward itself failed: nothing measured
            table = ledger.by_site()
        for key, n in table.items():
            if n > 0:
                self.by_site[key] = self.by_site.get(key, 0) + int(n)
        self.measured_roots.add(id(module))
        if len(self.measured_roots) < len(self.roots):
            return
        self.measured = True
        self.remove()
        c = self.controller
        if self.checked:
            return  # the boundary check ran before this rank measured
        if c._step_probe is not None or c._probe is not None:
            return  # the probe path checks (adapt._check_user_budget)
        if (c.boundary is not None or c._in_step) and not self.boundary_seen:
            return  # checked at the step boundary, where the static memory is complete
        self.check(self._static_now())

    # ---- the check -----------------------------------------------------------------------
    def _static_now(self) -> int:
        """Static memory (`Adapter._static_bytes`); on a GPU before the first forward where no
        boundary was seen: what was allocated then (no optimizer state yet)."""
        if torch.cuda.is_available() and self.static_before is not None and not self.boundary_seen:
            return self.static_before
        return self.adapter._static_bytes()

    def check_at_boundary(self) -> None:
        """The first step boundary without a probe (see the class docstring)."""
        self.boundary_seen = True
        if not self.checked:
            # every rank joins, measured or not, so none waits for another
            self.check(self._static_now())

    def check(self, static: int) -> None:
        a, c = self.adapter, self.controller
        cfg = c.config
        self.checked = True
        self.remove()
        if not c.enabled or cfg.budget is None:
            return
        budget = int(cfg.budget)
        layers = set(c.layers)
        values: dict[str, float] = {}
        why = ""
        if self.measured:
            inner = sum(n for (layer, _), n in self.by_site.items() if layer in layers)
            outer = sum(n for (layer, _), n in self.by_site.items() if layer not in layers)
            inflight = _inflight()
            values = {"need": static + outer + inflight * inner, "static": static + outer}
            if cfg.plan == "auto":
                minimum, why = self.min_budget(static + outer, inflight)
                if minimum is not None:
                    values["min"] = minimum
        # at a step boundary every rank of the job is between iterations: reduce over all of
        # them (pipeline stages included: the budget is per device, the figure the largest
        # stage's), so every rank stops together; inside a forward (no boundary) only over
        # this stage's ranks, which run it in step (the next stage still waits for this one)
        g = agreement.groups()
        r = agreement.reduce_dict(values, "max", None if self.boundary_seen or g is None else g.stage)
        if "need" not in r:
            a._warn_once("first_unmeasured", "llm_act: the activation budget of %d bytes is not checked: "
                         "the first step's forward was not measured (it ran under another ledger or "
                         "saved-tensor hooks, or outside the model's own forward)", budget)
            return
        need, static_all = int(r["need"]), int(r["static"])
        minimum = int(r["min"]) if "min" in r else None
        self.result = {"need": need, "static": static_all, "min": minimum, "budget": budget}
        if cfg.plan != "auto":
            if need > budget:
                raise PlanOverBudget(cfg.plan, budget, need)
            log.info("llm_act: plan %r holds %d bytes (%.3f GB, static memory included) on the first "
                     "step, within the activation budget of %d bytes", cfg.plan, need, need / 1e9, budget)
            return
        if minimum is not None:
            if budget < minimum:
                raise BudgetTooSmall(budget, static_all, minimum)
            if need > budget:
                log.info("llm_act: plan 'auto' fits the activation budget of %d bytes (the smallest is %d "
                         "bytes); the plan in force holds %d bytes (static memory included) and is "
                         "re-planned at the first tracking point", budget, minimum, need)
            return
        a._warn_once("auto_unchecked", "llm_act: plan 'auto': the smallest activation budget any plan "
                     "fits is not known here (%s), so the budget of %d bytes is not checked against it; "
                     "the plan in force holds %d bytes (%.3f GB, static memory included) on the first "
                     "step%s", why, budget, need, need / 1e9,
                     " -- more than the budget" if need > budget else "")

    def model_shape(self, tconfig: Any, count: int):
        """The analytic `ModelShape` of layers built from `tconfig` at the observed input."""
        s_local, b, h = self.shape
        tp = int(getattr(tconfig, "tensor_model_parallel_size", 1) or 1)
        sp = bool(getattr(tconfig, "sequence_parallel", False))
        heads = int(tconfig.num_attention_heads)
        kv = getattr(tconfig, "kv_channels", None)
        if kv is not None and int(kv) * heads != int(tconfig.hidden_size):
            raise ValueError(f"kv_channels={kv} is not hidden_size / num_attention_heads")
        act = getattr(getattr(tconfig, "activation_func", None), "__name__", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} has no analytic model")
        dtype = next((k for k, v in DTYPES.items() if v == self.dtype), None)
        if dtype is None:
            raise ValueError(f"activations in {self.dtype}")
        rope = any(getattr(m, "position_embedding_type", None) == "rope"
                   for root in self.roots for m in root.modules())
        return ModelShape(
            count, int(tconfig.hidden_size), heads, s_local * tp if sp else s_local, b,
            ffn_hidden_size=tconfig.ffn_hidden_size, num_query_groups=tconfig.num_query_groups,
            gated_linear_unit=bool(tconfig.gated_linear_unit), activation=act, dtype=dtype, tp=tp,
            sequence_parallel=sp, qk_layernorm=bool(getattr(tconfig, "qk_layernorm", False)),
            dropout=float(max(tconfig.hidden_dropout or 0.0, tconfig.attention_dropout or 0.0)),
            bias=bool(tconfig.add_bias_linear), normalization=str(tconfig.normalization),
            position_embedding="rope" if rope else "learned_absolute",
            attention=self.controller.config.attention)

    def min_budget(self, static: int, inflight: int) -> tuple[Optional[int], str]:
        """(the smallest budget any plan fits, static included; or None, why not)."""
        import dataclasses

        if not self.layers:
            return None, "the model has no megatron-core layers, and the generic path has no analytic model"
        if self.shape is None:
            return None, "the first layer's input was not seen"
        device = DeviceModel() if torch.cuda.is_available() else DeviceModel.cpu()
        pins = self.adapter.pins()
        controlled = set(self.controller.layers)
        counts: dict[int, list] = {}
        for layer in self.layers:
            if int(layer.layer_number) - 1 in controlled:
                counts.setdefault(id(layer.config), [layer.config, 0])[1] += 1
        blocks, pinned = [], 0
        try:
            for tconfig, count in counts.values():
                block = block_profile(self.model_shape(tconfig, count), device, count=count, inflight=inflight)
                sites = []
                for st in block.sites:
                    if st.name in pins:
                        name = pins[st.name]
                        stored = st.nbytes if name == KEEP else 0 if name == RECOMPUTE else next(
                            (o.nbytes for o in st.codecs if o.name == name), st.nbytes)
                        pinned += count * inflight * stored
                        continue
                    sites.append(dataclasses.replace(st, inputs=tuple(i for i in st.inputs if i not in pins)))
                blocks.append(dataclasses.replace(block, sites=tuple(sites)))
            return int(min_budget(blocks, static + pinned, self.controller.config.variance_budget)), ""
        except ValueError as err:
            return None, f"no analytic model for these layers: {err}"
