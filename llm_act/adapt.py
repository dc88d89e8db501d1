"""The adaptive re-planning behind plan "auto" (Adacc sec. 3.4, GACT sec. 4).

Statistics drift during training (outlier channels appear, sensitivities change), so the
plan is revisited at *tracking iterations* whose spacing grows exponentially: 1, 2, 4, ...
iterations apart, at most `ActConfig.adapt_interval_max`. At each one the `Adapter`

1. re-measures the sites on the current batch (`measure_profile`: bytes with the real
   outlier counts, compression ratios, errors; the op times only at the first tracking,
   they do not drift with the data), and every other time GACT's sensitivities and the
   mini-batch sampling noise (`measure_sensitivity`; the planner takes the median of the
   last three measurements of each c_i);
2. reduces them over the ranks (`llm_act.agreement`);
3. solves the MILP on one rank per pipeline stage under the budget and broadcasts the
   decision; every rank switches at this step boundary;
4. warns when the plan's predicted noise dominates the sampling noise.

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
`llm-act plan` refuses it; a derived budget, or a user budget that stops fitting later
(outliers grew), gets the tightest plan and one warning. A re-planning step never ends a
run: any other solver failure keeps the plan in force, warns once and is counted in
`solver_failures` (checkpointed; `summary()` says it).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch

from llm_act import agreement, plans
from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.planner.milp import InfeasibleBudget

log = logging.getLogger("llm_act.controller")

#: a statistic that moved by more than this factor since the last tracking resets the spacing
SHIFT_FACTOR = 2.0
#: the share of device memory left free when the budget comes from the free memory
GPU_MARGIN = 0.05
#: outlier rates are compared as (a + eps) / (b + eps), eps = this many channels' share
_OUTLIER_EPS_CHANNELS = 2
#: the planner uses the median of the last this many sensitivity measurements (a two-draw
#: estimate can be off by 10x on a small batch; one wild draw must not move the plan)
SENS_WINDOW = 3
#: a sensitivity shift counts only for a site carrying at least this share of the plan's
#: predicted noise (two-draw estimates of minor sites fluctuate without consequence)
SENS_SHARE = 0.1


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


def _recompute_available() -> bool:
    try:
        plans.plan_from({0: {"mlp.fc1_input": RECOMPUTE}}, 1)
    except NotImplementedError:
        return False
    return True


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

    def __init__(self, controller: Any):
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
        self.sampling_noise: Optional[float] = None
        self.budget: Optional[int] = None
        self.times: Optional[dict] = None
        self.profile = None  # the last MeasuredProfile (not checkpointed)
        self.solution = None  # the last planner answer (not checkpointed)
        self.noise_ratio: Optional[float] = None
        self.solver_failures = 0
        """tracking points whose solve failed (the plan in force was kept)"""
        self._warned_no_probe = False
        self._warned: set[str] = set()
        """kinds of warning given already (each is said once per run)"""
        self._started = False
        """the checks of the first iteration of this run are done"""
        self._run_tracks = 0
        """tracking points of this run (a resumed run refuses a new budget as a fresh one does)"""

    @property
    def config(self):
        return self.controller.config

    @property
    def active(self) -> bool:
        return self.controller.enabled and self.config.plan == "auto"

    # ---- the schedule --------------------------------------------------------------------
    def after_iteration(self, probe: Optional[Callable[[], Any]]) -> None:
        """Called after every iteration; tracks when one is due."""
        it = self.controller.iteration
        if not self._started:
            self._started = True
            self._check_user_budget(probe)
        if not self.active or it < self.next_track:
            return
        if self.track_count > 0 and not self.config.adapt:
            return
        if probe is None:
            if not self._warned_no_probe:
                log.warning("llm_act: plan 'auto' cannot measure without a probe: pass "
                            "controller.step(probe=fn) or controller.set_probe(fn); the plan stays%s",
                            "" if self.config.budget is None else " and the budget is not checked")
                self._warned_no_probe = True
            self.next_track = it + 1
            return
        self.track(probe)

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
        if self.config.plan != "auto":
            self._check_fixed_budget(probe)

    def _check_fixed_budget(self, probe: Optional[Callable[[], Any]]) -> None:
        """Once, after the first iteration of a run: a fixed plan with a user budget is
        measured on this batch (no codec timing) and refused with `PlanOverBudget` when its
        static memory + stored bytes exceed the budget. The measurement runs the
        memory-efficient attention, so for a plan on stock attention it is a lower bound:
        what it refuses surely does not fit."""
        from llm_act.planner.measure import measure_profile

        c = self.controller
        if probe is None:
            self._warn_once("no_probe_budget", "llm_act: the budget of plan %r is not checked without a "
                            "probe (pass controller.step(probe=fn) or controller.set_probe(fn))",
                            self.config.plan)
            return
        names = {n for choice in c.plan.values() for n in choice.values()} - {KEEP, RECOMPUTE}
        g = agreement.groups()
        profile = agreement.agree_profile(measure_profile(c, probe, times_from={}, codecs=sorted(names)), g)
        need = self._static_bytes() + profile.other_bytes + _inflight() * profile.predicted_bytes(
            c.plan, include_other=False)
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
        from llm_act.planner.measure import measure_profile
        from llm_act.sensitivity import check_noise, measure_sensitivity

        c = self.controller
        it = c.iteration
        g = agreement.groups()
        profile = agreement.agree_profile(measure_profile(c, probe, times_from=self.times), g)
        if self.times is None:
            self.times = profile.times()
        stats = {"outlier": profile.outlier_rates(),
                 "channels": {site: st.shape[-1] for (_, site), st in profile.sites.items() if st.shape}}
        if self.config.sensitivity and self.track_count % 2 == 0:
            sens = measure_sensitivity(c, probe, c.probe_params(), seed=self.config.seed + it)
            fresh = agreement.reduce_dict(sens.c, "mean", g.world if g else None)
            self.c_recent = (self.c_recent + [fresh])[-SENS_WINDOW:]
            self.sensitivity = {site: _median([m[site] for m in self.c_recent if site in m]) for site in fresh}
            sn = agreement.reduce_dict({} if sens.sampling_noise is None else {"s": sens.sampling_noise},
                                       "mean", g.world if g else None)
            self.sampling_noise = sn.get("s")
            stats["c"] = dict(self.sensitivity)
            by_site = profile.noise_by_site(c.plan, self.sensitivity)
            total = sum(by_site.values())
            stats["share"] = {s: v / total for s, v in by_site.items()} if total > 0 else {}
        reasons = self._shifts(stats)
        blocks, static = self.problem(profile)
        stage_group = g.stage if g else None
        static = int(agreement.reduce_dict({"s": static}, "max", stage_group)["s"])
        budget = int(agreement.reduce_dict({"b": self._budget(profile, static)}, "min",
                                           stage_group)["b"])
        decision = None
        if agreement.is_source(g):
            decision = self._solve(profile, blocks, static, budget, reasons)
        decision = agreement.broadcast(decision, g)
        if decision.get("refused") is not None:
            raise BudgetTooSmall(*decision["refused"])
        if decision.get("failure") is not None:
            self.solver_failures += 1
            self._warn_once("failure", "llm_act: iteration %d: the planner failed (%s); the plan in force "
                            "stays (said once; every failure is counted in the run's summary)",
                            it, decision["failure"])
        self.budget = decision["budget"]
        self.profile = profile
        old = c.plan
        if decision["plan"] is not None:
            new = {layer: {**old.get(layer, {}), **self.unmeasured(profile, layer), **choice,
                           **self.pins(layer)}
                   for layer, choice in decision["plan"].items()}
            if new != old:
                c.set_plan(new)
                entry = {
                    "iteration": it,
                    "changes": describe_changes(old, new),
                    "predicted_bytes": decision["predicted_bytes"],
                    "activation_bytes": decision["activation_bytes"],
                    "overhead_ms": decision["overhead_ms"],
                    "reason": "; ".join(decision["reasons"]) or ("first plan" if not self.history else "re-plan"),
                }
                self.history.append(entry)
                log.info("llm_act: iteration %d: plan changed: %s | predicted memory %.3f MiB "
                         "(activations %.3f MiB), overhead %.3f ms/iteration | why: %s",
                         it, entry["changes"], entry["predicted_bytes"] / 2**20,
                         entry["activation_bytes"] / 2**20, entry["overhead_ms"], entry["reason"])
        in_force = c.pending_plan or c.plan
        if self.sensitivity and self.sampling_noise is not None:
            self.noise_ratio = check_noise(profile.noise(in_force, self.sensitivity), self.sampling_noise,
                                           where=f" (iteration {it})")
        self.tracked.append(it)
        self.track_count += 1
        self._run_tracks += 1
        if decision["reasons"]:
            self.resets.append((it, list(decision["reasons"])))
            log.info("llm_act: iteration %d: statistics shifted (%s); tracking interval back to 1",
                     it, "; ".join(decision["reasons"]))
        self._schedule(it, reset=bool(decision["reasons"]))

    def _shifts(self, stats: dict[str, dict[str, float]]) -> list[str]:
        """Sharp shifts against the last tracking (and remember these statistics)."""
        reasons = []
        for site, rate in stats["outlier"].items():
            before = self.last.get("outlier", {}).get(site)
            eps = _OUTLIER_EPS_CHANNELS / max(1, stats["channels"].get(site, 1))
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
        on CPU the parameters and their gradients (+ the attached optimizer's state)."""
        if torch.cuda.is_available():
            return int(torch.cuda.memory_allocated())
        seen, total = set(), 0
        for p in self.controller.probe_params():
            if id(p) not in seen:
                seen.add(id(p))
                total += 2 * p.numel() * p.element_size()
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
        blocks = profile.blocks(self.sensitivity or None, inflight=inflight,
                                recompute=_recompute_available(), exclude=pins)
        pinned = sum(st.stored(pins[site]) for (_, site), st in profile.sites.items() if site in pins)
        return blocks, self._static_bytes() + profile.other_bytes + inflight * pinned

    def solve_alone(self, profile: Any, budget: int):
        """The plan this rank would choose from `profile` alone (no agreement): the planner's
        answer over `problem(profile)`, for diagnostics and tests."""
        from llm_act.planner import solve_plan

        blocks, static = self.problem(profile)
        sol = solve_plan(blocks, budget, static_bytes=static, variance_budget=self.config.variance_budget)
        return profile.plan_from_choice(sol.choice)

    def _budget(self, profile: Any, static: int) -> int:
        if self.config.budget is not None:
            return int(self.config.budget)
        if self.budget is not None:
            return self.budget
        free = agreement.device_free_bytes()
        if free is not None:
            budget = int(free[0] + free[1] - GPU_MARGIN * device_memory_bytes())
        else:
            from llm_act.planner import evaluate_plan

            c = self.controller
            compress = plans.plan_from("compress", c.num_layers, c.layers, c._no_fewbit())
            pins = self.pins()
            blocks = profile.blocks(exclude=pins)
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
        from llm_act.planner import InfeasibleVariance, solve_plan

        out: dict[str, Any] = {"plan": None, "budget": budget, "reasons": reasons,
                               "predicted_bytes": 0, "activation_bytes": 0, "overhead_ms": 0.0,
                               "refused": None, "failure": None}
        it = self.controller.iteration

        def solve(b: int):
            return solve_plan(blocks, b, static_bytes=static, variance_budget=self.config.variance_budget)

        try:
            try:
                sol = solve(budget)
            except InfeasibleBudget as err:
                if self.config.budget is not None and not self._run_tracks:
                    out["refused"] = (int(err.budget_bytes), int(err.static_bytes), int(err.min_budget_bytes))
                    return out
                self._warn_once("tightest", "llm_act: iteration %d: no plan fits the %s budget of %d bytes "
                                "(%.3f GiB); using the tightest plan, %d bytes (%.3f GiB) (said once)", it,
                                "given" if self.config.budget is not None else "derived", budget,
                                budget / 2**30, err.min_budget_bytes, err.min_budget_bytes / 2**30)
                sol = solve(err.min_budget_bytes)
        except InfeasibleVariance as err:
            self._warn_once("variance", "llm_act: iteration %d: no plan meets the noise budget (%s); the "
                            "plan stays (said once)", it, err)
            return out
        except Exception as err:  # a re-planning step must never end the run
            out["failure"] = f"{type(err).__name__}: {err}"
            return out
        self.solution = sol
        out.update(plan=profile.plan_from_choice(sol.choice), predicted_bytes=sol.activation_bytes + static,
                   activation_bytes=sol.activation_bytes, overhead_ms=sol.overhead_ms)
        return out

    def summary(self) -> str:
        """One line for the end of a run: trackings, plan changes, solver failures."""
        return (f"re-planning: {self.track_count} tracking points, {len(self.history)} plan changes, "
                f"{self.solver_failures} solver failures (plan kept)")

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "next_track": self.next_track, "track_count": self.track_count,
            "tracked": list(self.tracked), "resets": [(i, list(r)) for i, r in self.resets],
            "history": [dict(h) for h in self.history],
            "last": {k: dict(v) for k, v in self.last.items()},
            "sensitivity": dict(self.sensitivity), "c_recent": [dict(m) for m in self.c_recent],
            "sampling_noise": self.sampling_noise,
            "budget": self.budget, "times": self.times, "solver_failures": self.solver_failures,
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
        self.sampling_noise = state["sampling_noise"]
        self.budget = state["budget"]
        self.times = state["times"]
        self.solver_failures = int(state.get("solver_failures", 0))


def interval_sequence(n: int, interval_max: int) -> list[int]:
    """The first `n` tracking iterations without shifts: 1, 2, 4, ... (spacing capped)."""
    out, it, stage = [], 1, 0
    for _ in range(n):
        out.append(it)
        it += min(2 ** stage, interval_max)
        stage += 1
    return out

