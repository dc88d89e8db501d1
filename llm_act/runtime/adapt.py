"""The adaptive re-planning behind plan "auto" (Adacc sec. 3.4, GACT sec. 4): the `Adapter`.

Statistics drift during training (outlier channels appear, sensitivities change), so the
plan is revisited at *tracking iterations* whose spacing grows exponentially: 1, 2, 4, ...
iterations apart, at most `ActConfig.adapt_interval_max`. At each one the `Adapter`

0. takes the current batch from the probe given (`controller.step(probe=...)`,
   `set_probe`) or, in every door without one, from the training step the controller's
   hooks recorded (`llm_act.measurement.replay`: the same forward, its loss linearised at the output);
1. re-measures the sites (from the tracking iteration's own training step, `StepTap`, after
   the first point) and runs one round of measuring passes for the sensitivities and the
   sampling noise (`llm_act.runtime.measuring`), reduced over the ranks
   (`llm_act.runtime.agreement`);
2. solves the MILP on one rank per pipeline stage under the budget and the noise budget and
   broadcasts the decision (`llm_act.runtime.solving`; the plan in force stays where it is
   as good within the time resolution); every rank switches at this step boundary;
3. warns when the plan's predicted noise dominates the sampling noise.

Independently of the plan mode, every `ActConfig.fidelity_every` iterations (or on
request) the recorded step is run again exact and compressed and the relative gradient
error is reported (`llm_act.measurement.fidelity`).

This module keeps the Adapter's state (checkpointed with `state_dict`) and the order of a
tracking point; each job it composes lives in a module of its own:

- `llm_act.runtime.schedule`: when to track (the backoff, and the sharp shifts that reset it);
- `llm_act.runtime.measuring`: what a tracking point measures, and the window medians kept;
- `llm_act.runtime.solving`: the planner's problem, the budget, the decision and its failures;
- `llm_act.runtime.budget_check`: the first iteration's refusal of a user budget
  (`BudgetTooSmall`, `PlanOverBudget`, `FirstForward` for the doors without a probe);
- `llm_act.runtime.memory`: micro-batches in flight, device and static memory.

Every plan change is logged in one line and kept in `history`. `ActConfig.codecs` pins
sites: the planner chooses the other sites around them. `adapt=False` solves once, at the
first tracking, and keeps that plan. A re-planning step never ends a run: a solver failure
keeps the plan in force, warns once and is counted in `solver_failures` (checkpointed;
`summary()` says it).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from llm_act.codecs.registry import KEEP
from llm_act.measurement import fidelity
from llm_act.measurement.replay import StepReplay
from llm_act.measurement.sensitivity import check_noise
from llm_act.measurement.step_tap import StepTap
from llm_act.runtime import agreement, memory, output_choice, schedule, solving
from llm_act.runtime.budget_check import BudgetTooSmall, check_user_budget, FirstForward
from llm_act.runtime.logs import speaks_for_stage
from llm_act.runtime.measuring import Measurements, round_label
from llm_act.runtime.plan_owner import PlanOwner
from llm_act.runtime.round_guard import RoundGuard

# Re-exported: the errors a run raises (`BudgetTooSmall`, `PlanOverBudget`) and the check the
# patches name (`FirstForward`) lived here before this module was split by job (issue 29);
# users and the patches' docs refer to them as `llm_act.runtime.adapt.<name>`.
from llm_act.runtime.budget_check import PlanOverBudget  # noqa: F401  (re-export)

log = logging.getLogger("llm_act.runtime.controller")


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

    def __init__(self, controller: PlanOwner):
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
        """the statistics of the last tracking point (`schedule.shifts` compares the next)"""
        self.budget: Optional[int] = None
        self.solution = None  # the last planner answer (not checkpointed)
        self.noise_ratio: Optional[float] = None
        self.solver_failures = 0
        """tracking points whose solve failed (the plan in force was kept)"""
        #: non-finite values past the codecs' side lists, as last read (`check_overflow`)
        self.overflow_seen = 0
        self._overflow_since = 0
        self.output_decision: Optional[dict[str, Any]] = None
        """the last output-loss decision (`output_choice.OutputChoice.to_dict()`; None where the
        planner does not choose it)"""
        self._warned_no_probe = False
        self._warned: set[str] = set()
        """kinds of warning given already (each is said once per run)"""
        self._started = False
        """the checks of the first iteration of this run are done"""
        self._run_start: Optional[float] = None
        self.run_tracks = 0
        """tracking points of this run (a resumed run refuses a new budget as a fresh one does)"""
        self.first = FirstForward(controller, self.pins, self.static_bytes, self.warn_once)
        """the first forward's measurement, from hooks on the model (no probe needed)"""
        self.replay = StepReplay(lambda: self.measure_due() or self.measured.fidelity_due(),
                                 on_record=self._tap_step)
        """the training step recorded for measuring where no probe is given"""
        self.measure_seconds = 0.0
        """wall time spent measuring and planning at tracking points (this run)"""
        self._phases: Optional[dict[str, float]] = None
        self.track_costs: list[dict[str, Any]] = []
        """per tracking point of this run: its iteration, the seconds of each phase ("step tap",
        "profile", "sensitivity", "solve": agreement and planner, "total") and its "round" in
        words (`measuring.round_label`; empty where the point ran none)"""
        self.report_costs: list[dict[str, float]] = []
        """per gradient-fidelity report of this run: its iteration and seconds ("total")"""
        self.round = RoundGuard(fatal=(BudgetTooSmall, PlanOverBudget, agreement.Disagreement,
                                       agreement.CollectiveError))
        """runs each tracking point and report so that a failure skips it on every rank and
        training goes on (`round_guard`); its `skipped` list and count reach `summary()`"""
        self.measured = Measurements(controller, self.replay, self.round, self.warn_once)
        """what is measured: the profile, the sensitivities, the sampling noise, the fidelity
        reports and their windows (`llm_act.runtime.measuring`)"""

    @property
    def config(self):
        return self.controller.config

    @property
    def active(self) -> bool:
        """Whether plan "auto" is in charge."""
        return self.measured.active

    # ---- the schedule --------------------------------------------------------------------
    def measure_due(self) -> bool:
        """Whether the iteration running now (not yet counted) is a tracking iteration
        that must record its training step (`llm_act.measurement.replay`): no probe given."""
        m = self.measured
        return (m.active and m.measurable and self.controller.iteration + 1 >= self.next_track
                and (self.track_count == 0 or self.config.adapt) and m.replayed)

    def after_iteration(self, probe: Optional[Callable[[], Any]]) -> None:
        """Called after every iteration; reports the gradient fidelity and tracks when due
        (with `probe`, else with the training step the hooks recorded)."""
        m = self.measured
        try:
            reported = m.fidelity_due(self.controller.iteration)
            if reported:
                self.round.run("the gradient-fidelity report", self.controller.iteration,
                               lambda: m.report_fidelity(probe, self._book_report))
            points = self.track_count
            self._after_iteration(probe)
            if reported or self.track_count != points:  # a point that syncs anyway
                self.check_overflow()
        finally:
            self.replay.clear()
            if m.step_tap is not None:
                m.step_tap.remove()
                m.step_tap = None

    def _book_report(self, seconds: float) -> None:
        """Count a gradient-fidelity report's time as measuring (`measuring_fraction`)."""
        self.measure_seconds += seconds
        self.report_costs.append({"iteration": float(self.controller.iteration), "total": seconds})

    def check_overflow(self) -> int:
        """Read the codecs' non-finite overflow (`Controller.nonfinite_overflow`, one transfer)
        and warn once per reading that finds more than the last: those values decoded to NaN
        instead of their exact value. Returns the count."""
        c = self.controller
        count = c.nonfinite_overflow()
        if count > self.overflow_seen:
            log.warning("llm_act: iteration %d: %d non-finite values (NaN, +-Inf) did not fit the "
                        "codecs' side lists since iteration %d and decoded to NaN (an Inf lost its "
                        "sign; nothing became finite): the loss scaler sees them as NaN; %d in all",
                        c.iteration, count - self.overflow_seen, self._overflow_since, count)
        self.overflow_seen, self._overflow_since = count, c.iteration
        return count

    def _tap_step(self) -> None:
        """The recorded step's first forward of a tracking iteration: measure the training
        step itself (`StepTap`: the sites' samples, the linears' c) until the boundary."""
        m = self.measured
        if m.step_tap is not None or not self.measure_due():
            return
        try:  # inside the training step's forward: a failure here must not stop it
            named = m.named_params()
            tapped, _ = m.split_sites()
            m.step_tap = StepTap(self.controller, tapped, [p for _, p in named],
                                 [fidelity.group_name(n) for n, _ in named]).install()
        except Exception as err:  # noqa: BLE001 -- the point then measures with passes of its own
            m.step_tap = None
            self.warn_once("tap", "llm_act: iteration %d: the training step could not be tapped for "
                            "measuring (%s: %s); tracking points measure with passes of their own",
                            self.controller.iteration + 1, type(err).__name__, err)

    def _after_iteration(self, probe: Optional[Callable[[], Any]]) -> None:
        it = self.controller.iteration
        if self._run_start is None:
            self._run_start = time.perf_counter()
        if not self._started:
            self._started = True
            check_user_budget(self.controller, self.first, probe, self.static_bytes, self.warn_once)
        if not self.active or it < self.next_track:
            return
        if self.track_count > 0 and not self.config.adapt:
            return
        if not self.measured.measurable:
            self.warn_once("generic_auto", "llm_act: plan 'auto' measures and re-plans megatron-core "
                            "layers; these blocks are compressed through the generic saved-tensor hooks "
                            "(a Hugging Face-style model), where it keeps the 'compress' plan it starts "
                            "from (name a plan, or pin codecs with ActConfig.codecs, to choose another)")
            return
        probe = self.measured.probe_on_every_rank(probe, agreement.groups())
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
        # what the training step paid for its tap (`StepTap`): this point's, though spent in the step
        tap = self.measured.step_tap
        tapped = tap.seconds if tap is not None else 0.0
        self._phases = {"iteration": float(it), "step tap": tapped}
        before = self.measured.last_round
        done = False
        try:
            done = self.round.run("the tracking point", it, lambda: self.track(probe))
            if not done and not self.round.committed:
                self._schedule(it, reset=False)  # on every rank alike: all skipped before the commit
        finally:
            spent = time.perf_counter() - start + tapped
            self.measure_seconds += spent
            last = self.measured.last_round
            ran = round_label(last) if last is not before else ""
            self.track_costs.append({**self._phases, "total": spent, "round": ran if done else "skipped"})

    def _schedule(self, it: int, reset: bool) -> None:
        if reset:
            self.stage = 0
        self.next_track = it + schedule.interval(self.stage, self.config.adapt_interval_max)
        self.stage += 1

    # ---- one tracking point ----------------------------------------------------------------
    def track(self, probe: Callable[[], Any]) -> None:
        """One tracking point: measure, look for shifts, decide (the same on every rank),
        switch to the decided plan, and schedule the next point."""
        c = self.controller
        it = c.iteration
        g = agreement.groups()
        clock = time.perf_counter()
        m = self.measured
        profile, stats = m.track_profile(probe, g, self.track_count)
        clock = self._phase("profile", clock)
        m.track_sensitivity(probe, profile, stats, g, self.track_count)
        clock = self._phase("sensitivity", clock)
        reasons = schedule.shifts(self.last, stats)
        blocks, static = self.problem(profile)
        stage_group = g.stage if g else None
        static = int(agreement.reduce_dict({"s": static}, "max", stage_group)["s"])
        stock = output_choice.stock_static(c, static, memory.inflight())  # the default budget's output loss
        budget = int(agreement.reduce_dict({"b": self._budget(profile, stock)}, "min",
                                           stage_group)["b"])
        decision = solving.decide(self, profile, blocks, static, budget, reasons, g)
        if decision.refused is not None:
            raise BudgetTooSmall(*decision.refused)
        if decision.failure is not None:
            self.solver_failures += 1
            self.warn_once("failure", "llm_act: iteration %d: the planner failed (%s); the plan in force "
                            "stays (said once; every failure is counted in the run's summary)",
                            it, decision.failure)
        self._phase("solve", clock)
        reset = bool(decision.reasons)
        if g is not None:  # every stage keeps the same schedule (they track together)
            reset = bool(agreement.reduce_dict({"r": float(reset)}, "max", g.world)["r"])
        if decision.plan is not None:  # a plan the layers cannot bind skips the point here
            c.check_accepted(self._next_plan(profile, decision))
        # every rank measured and decided: the schedule first, then what this rank switches
        self.round.commit()
        self.tracked.append(it)
        self.track_count += 1
        self.run_tracks += 1
        self._schedule(it, reset=reset)
        self.budget = decision.budget
        m.profile = profile
        self.output_decision = decision.output
        if decision.plan is not None:
            self._switch(it, profile, decision)
        in_force = c.pending_plan or c.plan
        if m.sensitivity and m.sampling_noise is not None:
            # measured figures only: a stand-in c (the largest measured) would warn of a guess
            self.noise_ratio = check_noise(profile.noise(in_force, m.sensitivity, m.coherence),
                                           m.sampling_noise, where=f" (iteration {it})")
        if decision.reasons:
            self.resets.append((it, list(decision.reasons)))
            log.info("llm_act: iteration %d: statistics shifted (%s); tracking interval back to 1",
                     it, "; ".join(decision.reasons))

    def _switch(self, it: int, profile: Any, decision: solving.Decision) -> None:
        """Set the decided plan and output loss; a change is logged and kept in `history`."""
        c = self.controller
        old = c.plan
        new = self._next_plan(profile, decision)
        output_moved = c.set_output_loss(decision.output_loss)
        if new == old and not output_moved:
            return
        if new != old:
            c.set_plan(new)
        entry = {
            "iteration": it,
            "changes": "; ".join(([describe_changes(old, new)] if new != old else [])
                                 + ([output_moved] if output_moved else [])),
            "predicted_bytes": decision.predicted_bytes,
            "activation_bytes": decision.activation_bytes,
            "overhead_ms": decision.overhead_ms,
            "reason": "; ".join(decision.reasons) or ("first plan" if not self.history else "re-plan"),
        }
        self.history.append(entry)
        entry["noise"] = decision.noise
        entry["output_loss"] = decision.output_loss
        vb = decision.noise_budget
        out = decision.output
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

    def _next_plan(self, profile: Any, decision: solving.Decision) -> dict[int, dict[str, str]]:
        """The plan `decision` puts in force: each decided layer's choice over the plan in force,
        its unmeasured sites kept, the user's pins on top."""
        old = self.controller.plan
        return {layer: {**old.get(layer, {}), **self.unmeasured(profile, layer), **choice, **self.pins(layer)}
                for layer, choice in decision.plan.items()}

    def _phase(self, name: str, since: float) -> float:
        """Book the seconds since `since` to phase `name` of this tracking point; now."""
        now = time.perf_counter()
        phases = self._phases
        if phases is not None:
            phases[name] = phases.get(name, 0.0) + now - since
        return now

    # ---- what the planner is given (`solving`) --------------------------------------------
    def static_bytes(self) -> int:
        """Memory that is not activations (`memory.static_bytes`) of the watched model."""
        return memory.static_bytes(self.replay.roots or self.first.roots, self.controller.probe_params)

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
        """(blocks, static bytes) of the MILP for `profile` (`solving.problem`)."""
        return solving.problem(self, profile)

    def solve_alone(self, profile: Any, budget: int):
        """The plan this rank would choose from `profile` alone (`solving.solve_alone`)."""
        return solving.solve_alone(self, profile, budget)

    def _budget(self, profile: Any, static: int) -> int:
        """The budget of this tracking point (`solving.default_budget`; tests replace it)."""
        return solving.default_budget(self, profile, static)

    def noise_budget(self) -> Optional[float]:
        """The summed gradient noise a plan may add (`solving.noise_budget`)."""
        return solving.noise_budget(self)

    def warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log warning `msg` the first time a warning of `kind` is given in this run."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(msg, *args)

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
        last = self.measured.fidelity[-1] if self.measured.fidelity else None
        fid = "" if last is None else (
            f"; gradient fidelity at iteration {last.iteration}: relative error {last.total:.3g}"
            + ("" if last.noise_ratio is None else f", {last.format_noise()}"))
        skipped = self.round.skipped_total
        skips = "" if not skipped else f", {skipped} measurements skipped after a failure (plan kept)"
        return (f"re-planning: {self.track_count} tracking points, {len(self.history)} plan changes, "
                f"{self.solver_failures} solver failures (plan kept){skips}{spent}{fid}; "
                f"{self.overflow_text()}")

    def overflow_text(self) -> str:
        """The summary's words on the non-finite overflow, read now (a sync: the run's end)."""
        count = self.check_overflow()
        return (f"{count} non-finite values past the codecs' side lists (decoded to NaN)" if count
                else "every non-finite value decoded exactly")

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "next_track": self.next_track, "track_count": self.track_count,
            "tracked": list(self.tracked), "resets": [(i, list(r)) for i, r in self.resets],
            "history": [dict(h) for h in self.history],
            "last": {k: dict(v) for k, v in self.last.items()},
            "budget": self.budget, "solver_failures": self.solver_failures,
            "skipped": self.round.skipped_total,
            **self.measured.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = int(state["stage"])
        self.next_track = int(state["next_track"])
        self.track_count = int(state["track_count"])
        self.tracked = list(state["tracked"])
        self.resets = [(int(i), list(r)) for i, r in state.get("resets", [])]
        self.history = [dict(h) for h in state["history"]]
        self.last = {k: dict(v) for k, v in state["last"].items()}
        self.budget = state["budget"]
        self.solver_failures = int(state.get("solver_failures", 0))
        self.measured.load_state_dict(state)
        self.round.skipped_total = int(state.get("skipped", 0))
