"""What plan "auto" measures at a tracking point, and the statistics it keeps of it.

One job: the measurements of the `Adapter` (`llm_act.runtime.adapt`) and their bookkeeping.
A tracking point costs about a training step (issue 27: at most 1.5, and 2% of a run):

- the profile (`track_profile`): at the first point, and where the shapes change, a full
  one (`measure_profile`: a keep and a capture forward, every codec's bytes and errors,
  each codec and producer timed once at the run's shapes, kept with the profile); at every
  later point it is rebuilt from the tracking iteration's own training step
  (`llm_act.measurement.step_tap.StepTap`: a sample of every site's tensor, whatever the
  plan stores there), with no pass of its own (`profile_from_samples`);
- one round of measuring passes (`track_sensitivity`, `next_round`): the exact pass, whose
  halves' difference gives the mini-batch sampling noise, and one probed site type, or a
  plain round for a biased codec's coherence. A linear's input takes its c from the
  tracking iteration's own backward. Where the adapter measures from the training step
  (no probe given), the passes replay the first rows of the step's batch, as many as fit
  `ROW_PASSES` passes over the whole batch (`round_rows`), and scale to the whole batch.

Every figure is reduced over the ranks (`llm_act.runtime.agreement`). The planner takes the
median of the last `SENS_WINDOW` measurements of each figure: a two-draw estimate can be off
by 10x on a small batch, and one wild draw must not move the plan (a probed type's as a share
of the linears' c, which every point measures: `scaled_medians`). What is not measured yet is
charged a stand-in (`planner_c`, `planner_coherence`), and the rounds go first to what the
plan in force depends on. The
gradient-fidelity report (`llm_act.measurement.fidelity`) is measured here too.

`Measurements` owns what is measured (the profile and its times, the windows of c, of the
coherences and of the sampling noise, the last round, the fidelity reports) and its own
`state_dict`, which the `Adapter` checkpoints. It sees the controller through `PlanOwner`
and never the Adapter, which passes the tracking point's index and books the time spent.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from llm_act.codecs.registry import KEEP, RECOMPUTE, unbiased_at
from llm_act.measurement import fidelity, head_cut, linear_tap
from llm_act.measurement.fidelity import FidelityReport
from llm_act.measurement.measure import measure_profile, profile_from_samples
from llm_act.measurement.measured_profile import MeasuredProfile
from llm_act.measurement.replay import StepReplay
from llm_act.measurement.sensitivity import measure_sensitivity, sensitive_sites
from llm_act.measurement.step_tap import StepTap
from llm_act.runtime import agreement
from llm_act.runtime.plan_owner import PlanOwner
from llm_act.runtime.round_guard import PeerFailed, RoundGuard
from llm_act.sites import DEFAULT_CODECS, MLP_ACT_INPUT

log = logging.getLogger("llm_act.runtime.controller")  # the adapter speaks as its controller
#: the planner uses the median of the last this many sensitivity measurements (a two-draw
#: estimate can be off by 10x on a small batch; one wild draw must not move the plan)
SENS_WINDOW = 3
#: every codec's errors are measured again at every site once every this many tracking
#: points, a share of the sites at each (`track_profile`); the codecs in force and
#: outlier_int4 (its outlier rate is watched) at every site at every point
FULL_PROFILE_EVERY = 4
#: timed runs (after one warm-up) of each codec and producer at the first tracking point:
#: times are taken once per run and kept (`MeasuredProfile.times`)
TIMING_REPEATS = 2


def median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def window_medians(recent: list[dict[str, float]]) -> dict[str, float]:
    """site -> the median of its last SENS_WINDOW values over `recent` measurements."""
    seen = {site for m in recent for site in m}
    return {site: median([m[site] for m in recent if site in m][-SENS_WINDOW:]) for site in seen}


def scaled_medians(recent: list[dict[str, float]], tapped: list[str]) -> dict[str, float]:
    """The window medians of c (`window_medians`), a probed site's scaled to now: each of
    its values is taken as a share of the tapped sites' summed c of the same measurement
    (every measurement has them all: the exact pass gives them) and multiplied by the
    tapped sites' summed medians. A probed type is measured once every few points, while
    early in training every gradient shrinks, c with it; its share of c does not."""
    out = window_medians(recent)
    total = lambda m: sum(m[s] for s in tapped) if all(s in m for s in tapped) else 0.0  # noqa: E731
    now = sum(out.get(s, 0.0) for s in tapped)
    if not tapped or now <= 0:
        return out
    for site in set(out) - set(tapped):
        shares = [m[site] / total(m) for m in recent if site in m and total(m) > 0][-SENS_WINDOW:]
        if shares:
            out[site] = median(shares) * now
    return out


def _same_sites(new: Any, old: Any) -> bool:
    """Whether two profiles hold the same sites at the same shapes (figures carry over)."""
    return set(new.sites) == set(old.sites) and all(
        new.sites[k].shape == old.sites[k].shape and new.sites[k].dtype == old.sites[k].dtype for k in new.sites)


#: a round whose passes backpropagate the halves' difference (`measure_sensitivity`'s
#: `signed`): its exact pass gives the sampling noise, its probes the probed types' c
SIGNED = "signed"
#: a round of plain passes (the halves' mean): a biased codec's coherence
PLAIN = "plain"
#: probed site types (or coherences) one round measures once every type is measured (the
#: rotation; more rows per type); a round catching up on types never measured takes as
#: many as fit its rows' budget at `MIN_ROWS` rows (`capacity`)
ITEMS_PER_ROUND = 1
#: the fewest rows a round replays (the halves of a signed pass)
MIN_ROWS = 2
#: a round's passes take at most this many passes' worth of the recorded batch's rows (a
#: pass over the whole batch costs about a training step's forward and backward)
ROW_PASSES = 1.0
#: the first tracking point also takes the full profile (a keep and a capture forward,
#: every codec timed): its round, the exact pass alone, gets a quarter
FIRST_ROW_PASSES = 0.25
#: what the linears' coherences add to a plain pass, in passes: at each linear its biased
#: codec's error on the input and that error's weight-gradient product (CPU references)
COHERENCE_TAP_PASSES = 0.25
#: the coherence a biased codec is charged at a site where it is not measured yet (issue
#: 28 measured 1.0-9.4 on the bench GPT, INT4 with one scale per channel at the attention's
#: input the most): a noise budget that binds keeps such codecs out until it is measured
STANDIN_KAPPA = 10.0


def round_label(r: Optional[dict[str, Any]]) -> str:
    """A round in words, for the overhead bench's table: its kind, what it measured, on how
    many rows ("signed: attn.v, attn.q; 2 of 8 rows", "plain: the coherence of ln1.input; 2 of 8
    rows")."""
    if not r:
        return ""
    what = ", ".join(r["sites"]) if r["kind"] == SIGNED else (
        "the coherence of " + ", ".join(r["biased"]) if r["biased"] else ", ".join(r["sites"]))
    rows = "the whole batch" if r.get("rows") is None else "{} of {} rows".format(*r["rows"])
    return f"{r['kind']}: {what or 'the exact pass alone'}; {rows}"


def round_rows(batch: Optional[int], passes: float, budget: float) -> Optional[int]:
    """The rows of a recorded batch of `batch` samples that a round of `passes` passes runs:
    the largest even number with passes x rows <= budget x batch, at least 2; None for the
    whole batch (a batch of two or fewer, or one whose rows cannot be told)."""
    if batch is None or batch <= 2:
        return None
    rows = int(budget * batch / max(1, passes)) // 2 * 2
    rows = max(2, rows)
    return None if rows >= batch else rows


def plan_relevant_c(c: dict[str, float], sampling_noise: Optional[float],
                    variance_budget: Optional[float]) -> dict[str, float]:
    """The sensitivities the schedule looks for shifts in (`llm_act.runtime.schedule.shifts`):
    under a noise budget relative to the sampling noise (`noise_fraction`), each site's
    share of the summed c -- early in training every gradient shrinks, c and the sampling
    noise together, which is no shift, and the sampling noise of one micro-batch's halves is
    too rough to divide by; under an absolute `variance_budget`, c itself."""
    total = sum(v for v in c.values() if v > 0)
    if variance_budget is not None or total <= 0:
        return dict(c)
    return {site: v / total for site, v in c.items()}


def sens_rounds(probed: list[str]) -> int:
    """Measurements it takes for every probed site type (`split_sites`) to be measured
    SENS_WINDOW times."""
    return max(1, -(-len(probed) // ITEMS_PER_ROUND))


class Measurements:
    """What plan "auto" has measured of one controller's layers, and the windows its medians
    come from; checkpointed with `state_dict`. `guard` runs the measurements so that a failure
    skips them on every rank (`round_guard`); `warn_once(kind, msg, *args)` says each kind of
    warning once per run (the Adapter's)."""

    def __init__(self, controller: PlanOwner, replay: StepReplay, guard: RoundGuard,
                 warn_once: Callable[..., None]):
        self.controller = controller
        self.replay = replay
        """the training step recorded for measuring where no probe is given"""
        self.guard = guard
        self.warn_once = warn_once
        self.profile: Optional[MeasuredProfile] = None
        """the last measured profile (checkpointed as plain data)"""
        self.times: Optional[dict] = None
        """each codec's and producer's times, taken at the first tracking point and kept"""
        self.sensitivity: dict[str, float] = {}
        """c_i the planner uses: the median of the last `SENS_WINDOW` measurements"""
        self.c_recent: list[dict[str, float]] = []
        self.coherence: dict[str, float] = {}
        """site type -> kappa a biased codec's noise is charged at (`biased_codecs="charge"`):
        the median of the last SENS_WINDOW measurements"""
        self.coherence_recent: list[dict[str, float]] = []
        self.coherence_codecs: dict[str, str] = {}
        """site type -> the biased codec its last coherence was measured with"""
        self.sampling_noise: Optional[float] = None
        self.sampling_recent: list[float] = []
        """the last SENS_WINDOW measurements of the mini-batch sampling noise"""
        self.sampling_groups_recent: list[dict[str, float]] = []
        """the same per parameter group"""
        self.last_round: Optional[dict[str, Any]] = None
        """what the last tracking point's round of measuring passes measured (`next_round`:
        kind, sites, biased codecs, rows)"""
        self.rows_refused = False
        """the recorded step could not be replayed on its first rows: measure on the whole batch"""
        self.step_tap: Optional[StepTap] = None
        """the tracking iteration's own training step, measured (`StepTap`): installed on its
        first recorded forward, removed at the step boundary"""
        self.fidelity: list[FidelityReport] = []
        """the last `fidelity.HISTORY` gradient-fidelity reports"""
        self.fidelity_requested = False
        self.fidelity_next = 0
        """where the rotation of the sites a fidelity report measures alone continues"""

    @property
    def config(self):
        return self.controller.config

    @property
    def active(self) -> bool:
        """Whether plan "auto" is in charge (it keeps the sampling noise its points measure)."""
        return self.controller.enabled and self.config.plan == "auto"

    @property
    def replayed(self) -> bool:
        """Whether this iteration is measured from the recorded training step (the loop gave
        no probe: `controller.step(probe=...)`, `set_probe`)."""
        return not self.controller.probe_given

    @property
    def measurable(self) -> bool:
        """Whether the controlled sites can be measured: megatron-core layers (modules that
        store each site). The generic path's blocks (`BlockSites`) are not measured."""
        return bool(self.controller.layers)

    def fidelity_due(self, iteration: Optional[int] = None) -> bool:
        """Whether `iteration` (default: the one running now, not yet counted) ends with a
        gradient-fidelity report (`ActConfig.fidelity_every`, or `Controller.request_fidelity()`)."""
        c = self.controller
        it = c.iteration + 1 if iteration is None else iteration
        every = self.config.fidelity_every
        return (c.enabled and self.measurable
                and (self.fidelity_requested or (every > 0 and it % every == 0)))

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What is measured, as plain data (the keys of the Adapter's checkpoint they had)."""
        return {
            "sensitivity": dict(self.sensitivity), "c_recent": [dict(m) for m in self.c_recent],
            "coherence": dict(self.coherence), "coherence_recent": [dict(m) for m in self.coherence_recent],
            "coherence_codecs": dict(self.coherence_codecs),
            "sampling_noise": self.sampling_noise, "times": self.times,
            "profile": None if self.profile is None else self.profile.to_dict(),
            "sampling_recent": list(self.sampling_recent),
            "sampling_groups_recent": [dict(m) for m in self.sampling_groups_recent],
            "fidelity": [r.to_dict() for r in self.fidelity], "fidelity_next": self.fidelity_next,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sensitivity = dict(state["sensitivity"])
        self.c_recent = [dict(m) for m in state.get("c_recent", [])]
        self.coherence = dict(state.get("coherence", {}))
        self.coherence_recent = [dict(m) for m in state.get("coherence_recent", [])]
        self.coherence_codecs = dict(state.get("coherence_codecs", {}))
        self.sampling_noise = state["sampling_noise"]
        self.times = state["times"]
        self.profile = MeasuredProfile.from_dict(state["profile"]) if state.get("profile") else None
        self.sampling_recent = [float(v) for v in state.get("sampling_recent", [])]
        self.sampling_groups_recent = [dict(m) for m in state.get("sampling_groups_recent", [])]
        self.fidelity = [FidelityReport.from_dict(r) for r in state.get("fidelity", [])]
        self.fidelity_next = int(state.get("fidelity_next", 0))

    # ---- the profile ------------------------------------------------------------------------------
    def track_profile(self, probe: Callable[[], Any], g: Any, point: int) -> tuple[Any, dict[str, dict]]:
        """The sites measured at this tracking point, agreed over the ranks (`MeasuredProfile`),
        and the statistics a shift is looked for in: the outlier rates of the site types the plan
        in force stores lossily (at a kept or recomputed site they change neither the bytes nor
        the noise; the next solve sees them in the profile anyway), and the channels."""
        c = self.controller
        fresh = sorted(self.data_codecs())
        # every codec at a share of the sites in turn: each (layer, site) every FULL_PROFILE_EVERY points
        pairs = [(layer, site) for layer in c.layers for site in c.sites(layer)]
        turn = {key for i, key in enumerate(pairs) if i % FULL_PROFILE_EVERY == point % FULL_PROFILE_EVERY}
        # each finding below is this rank's (its batch's shapes); the passes it decides on hold
        # collectives, so every rank of the stage takes the same path
        def anywhere(flag: bool) -> bool:
            return agreement.any_rank(flag, g)

        profile = None
        if self.profile is not None:
            if self.step_tap is not None and self.step_tap.samples:
                # from the tracking iteration's own step: no pass (None: the shapes moved)
                profile = profile_from_samples(c, self.step_tap.samples, self.profile, codecs=fresh,
                                               all_codecs_at=turn)
            if anywhere(profile is None):  # a probe given: its capture pass
                profile = measure_profile(c, probe, times_from=self.times, codecs=fresh, keep_from=self.profile,
                                          all_codecs_at=turn, repeats=TIMING_REPEATS, any_rank=anywhere)
                if anywhere(not _same_sites(profile, self.profile)):
                    profile = None
                else:
                    profile.carry_options(self.profile)
        if profile is None:
            # the first point (or new shapes): every codec on the first layer of each group of
            # identical layers, those of the plan on every layer
            profile = measure_profile(c, probe, times_from=self.times, keep_from=self.profile, every_layer=fresh,
                                      repeats=TIMING_REPEATS, any_rank=anywhere)
        profile = agreement.agree_profile(profile, g)
        if self.times is None:
            self.times = profile.times()
        lossy = fidelity.lossy_sites(c.plan, c.sites)
        stats = {"outlier": {site: rate for site, rate in profile.outlier_rates().items() if site in lossy},
                 "channels": {site: st.shape[-1] for (_, site), st in profile.sites.items() if st.shape}}
        return profile, stats

    def data_codecs(self) -> set[str]:
        """Codecs re-measured at every tracking point (see FULL_PROFILE_EVERY)."""
        c = self.controller
        return {"outlier_int4"} | ({n for choice in c.plan.values() for n in choice.values()}
                                   - {KEEP, RECOMPUTE})

    # ---- the sensitivities ------------------------------------------------------------------------
    def track_sensitivity(self, probe: Callable[[], Any], profile: Any, stats: dict[str, dict],
                          g: Any, point: int) -> None:
        """At every tracking point (with `ActConfig.sensitivity`): one round of measuring passes
        (`next_round`), whose figures join the window medians kept here; add the measured
        sensitivities and each site's share of the predicted noise to `stats`. Every linear's
        input takes its c from the tracking iteration's own backward (`StepTap`) where the step
        was recorded, else from the round's exact pass."""
        if not self.config.sensitivity:
            return
        c = self.controller
        named = self.named_params()
        tapped, probed = self.split_sites()
        first = point == 0
        budget = FIRST_ROW_PASSES if first else ROW_PASSES
        # the first point also takes the full profile: its round is the exact pass alone
        kind, sites, biased = (self.next_round(tapped, probed, self.capacity(budget)) if not first
                               else (SIGNED, [], {}))
        step = self.step_tap.linear if self.step_tap is not None and self.step_tap.linear.c_l else None
        passes = (1 + len(sites) if kind == SIGNED else
                  1 + 2 * len(sites) + (COHERENCE_TAP_PASSES if set(biased) & set(tapped) else 0.0))
        samp_groups = window_medians(self.sampling_groups_recent)
        sens, rows = self.on_rows(probe, passes, budget, lambda forward, rows: measure_sensitivity(
            c, forward, [p for _, p in named], seed=self.config.seed + c.iteration,
            sites=tapped + sites, groups=[fidelity.group_name(n) for n, _ in named],
            biased=biased or None, head=head_cut.head_of(self.replay.roots),
            signed=kind == SIGNED, sampling=kind == SIGNED, rows=rows, tapped_from=step,
            sampling_from=(self.sampling_noise, samp_groups) if self.sampling_noise else None))
        world = g.world if g else None
        # a plain round's probed c stays out of the windows: in bf16 a probe's gradient
        # difference carries a floor of re-rounded intermediates that the signed and the plain
        # passes see differently (2-3x on the bench GPT), and a window mixing them would move
        # for nothing; a linear's c is analytic (`linear_tap`), the same in both
        measured = {site: v for site, v in sens.c.items() if kind == SIGNED or site in tapped}
        fresh = agreement.reduce_dict(measured, "mean", world)
        if fresh:
            self.c_recent = (self.c_recent + [fresh])[-SENS_WINDOW * sens_rounds(probed):]
        self.sensitivity = scaled_medians(self.c_recent, tapped)
        if self.coherence_recent or biased:
            # a site whose c is 0 has no noise to charge: its kappa cannot be measured, and is 1
            kappa = agreement.reduce_dict({**{site: 1.0 for site in biased}, **sens.coherence}, "mean", world)
            self.coherence_codecs.update({site: name for site, name in biased.items() if site in kappa})
            self.coherence_recent = (self.coherence_recent + [kappa])[-SENS_WINDOW * len(sensitive_sites(c)):]
            self.coherence = window_medians(self.coherence_recent)
        sn = agreement.reduce_dict({} if sens.sampling_noise is None else {"s": sens.sampling_noise},
                                   "mean", world)
        if "s" in sn:  # one micro-batch's halves: a rough estimate, hence the median
            self.sampling_recent = (self.sampling_recent + [sn["s"]])[-SENS_WINDOW:]
            groups = agreement.reduce_dict(sens.sampling_by_group, "mean", world)
            self.sampling_groups_recent = (self.sampling_groups_recent + [groups])[-SENS_WINDOW:]
        self.sampling_noise = median(self.sampling_recent) if self.sampling_recent else None
        self.last_round = {"kind": kind, "sites": list(sites), "biased": dict(biased), "rows": rows}
        stats["c"] = plan_relevant_c(self.settled_c(), self.sampling_noise, self.config.variance_budget)
        stats["relative"] = self.config.variance_budget is None
        by_site = profile.noise_by_site(c.plan, self.planner_c(), self.planner_coherence())
        total = sum(by_site.values())
        stats["share"] = {s: v / total for s, v in by_site.items()} if total > 0 else {}

    def replayed_rows(self) -> Optional[int]:
        """The rows of the recorded training step where the adapter measures from it, None where
        a probe given by the loop measures (its batch cannot be cut) or a cut failed (`on_rows`)."""
        return self.replay.batch_rows() if self.replayed and self.replay.calls and not self.rows_refused else None

    def round_forward(self, probe: Callable[[], Any], passes: float, budget: float
                      ) -> tuple[Callable[[], Any], Optional[tuple[int, int]]]:
        """(the closure `passes` passes measure with, (its rows, the batch's rows) or None): the
        recorded step on its first `round_rows` rows for the row `budget` where the adapter
        measures from the training step (a probe given by the loop runs whole)."""
        batch = self.replayed_rows()
        rows = round_rows(batch, passes, budget)
        if rows is None:
            return probe, None
        return self.replay.probe(rows=rows), (rows, batch)

    def on_rows(self, probe: Callable[[], Any], passes: float, budget: float,
                measure: Callable[[Callable[[], Any], Optional[tuple[int, int]]], Any]) -> tuple[Any, Any]:
        """(`measure(forward, rows)`, rows) on the closure `round_forward` gives; where the
        recorded step cannot be replayed on its first rows (a model whose arguments the cut
        misreads), on the whole batch from then on, said once. Every rank of a model-parallel
        group records the same arguments, so they fail alike and fall back together. A failure
        the whole batch repeats is not the cut's: it is raised (`round_guard` skips the point)."""
        forward, rows = self.round_forward(probe, passes, budget)
        if rows is None:
            return measure(forward, None), None
        try:
            return measure(forward, rows), rows
        except torch.OutOfMemoryError:
            raise  # the whole batch would need more
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            if isinstance(err, PeerFailed):
                raise
            out = measure(probe, None)  # raises where the failure is not the cut's
            self.rows_refused = True
            self.warn_once("rows", "llm_act: iteration %d: the recorded step could not be replayed on its first "
                         "rows (%s: %s); plan 'auto' measures on the whole batch from now on (a tracking point "
                         "then costs more than a training step)", self.controller.iteration, type(err).__name__, err)
            return out, None

    def capacity(self, budget: float) -> int:
        """Probed types a signed round catching up may take: those whose passes fit the row
        `budget` at `MIN_ROWS` rows each, beside the exact pass (1 where the rows cannot be cut:
        a probe given by the loop, a batch of two)."""
        batch = self.replayed_rows()
        if batch is None or batch <= MIN_ROWS:
            return ITEMS_PER_ROUND
        return max(ITEMS_PER_ROUND, int(budget * batch / MIN_ROWS) - 1)

    def next_round(self, tapped: list[str], probed: list[str],
                   catch_up: int = ITEMS_PER_ROUND) -> tuple[str, list[str], dict[str, str]]:
        """(kind, probed site types, site -> biased codec) of this point's round, the first of:

        1. a probed type never measured that the plan in force stores lossily (its c is a
           stand-in until then: `planner_c`), where no coherence is due;
        2. the coherences of the linears' inputs not measured yet, all at once (the exact pass
           of a plain round gives them, `linear_tap`): until a site's coherence is measured
           a biased codec there is charged `STANDIN_KAPPA` (`planner_coherence`);
        3. a probed site's coherence not measured yet, those the plan stores lossily first
           (a plain round: the exact pass, the site's c and its biased codec's pass);
        4. a probed type never measured (those stored lossily first);
        5. the probed type measured longest ago (GACT's c is stable along training; between its
           measurements a probed type's c follows the linears', `scaled_medians`).

        Plain rounds (2, 3) and signed ones (1, 4, 5, which also give the sampling noise: it
        falls fast early in training) take turns while both have work. A signed round that
        catches up on types never measured takes up to `catch_up` of them (`capacity`)."""
        c = self.controller
        measured = {site for m in self.c_recent for site in m}
        lossy = set(fidelity.lossy_sites(c.plan, c.sites))
        never = sorted((site for site in probed if site not in measured), key=lambda s: s not in lossy)
        first = [site for site in never if site in lossy][:catch_up]
        after_plain = self.last_round is not None and self.last_round.get("kind") == PLAIN
        due = {} if after_plain else self.coherence_due(self.charged_codecs(tapped + probed))
        if first and not due:
            return SIGNED, never[:catch_up], {}
        linears = {site: name for site, name in due.items() if site in tapped}
        if linears:
            return PLAIN, [], linears
        todo = sorted((site for site in due if site in probed), key=lambda s: (s not in lossy, probed.index(s)))
        if todo:
            return PLAIN, todo[:ITEMS_PER_ROUND], {site: due[site] for site in todo[:ITEMS_PER_ROUND]}
        if never:
            return SIGNED, never[:catch_up], {}
        if not probed:
            return SIGNED, [], {}
        age = {site: max((i for i, m in enumerate(self.c_recent) if site in m), default=-1) for site in probed}
        return SIGNED, sorted(probed, key=lambda s: (age[s], probed.index(s)))[:ITEMS_PER_ROUND], {}

    def settled_c(self) -> dict[str, float]:
        """The measured c of the site types whose window holds `SENS_WINDOW` measurements: a
        shift is looked for in those alone (one or two draws of a probed type, measured every
        few points on a few rows, move by 2x and more from batch to batch)."""
        return {site: v for site, v in self.sensitivity.items() if sum(site in m for m in self.c_recent) >= SENS_WINDOW}

    def standin_sites(self) -> list[str]:
        """The sensitive site types whose c is not measured yet (`planner_c` charges them a
        stand-in)."""
        return [site for site in sensitive_sites(self.controller) if site not in self.sensitivity]

    def planner_c(self) -> dict[str, float]:
        """The c the planner charges: the measured window medians (`self.sensitivity`), and for a
        sensitive site type not measured yet the largest measured c (a stand-in; measuring
        rounds go first to the types the plan stores lossily, `next_round`)."""
        out = dict(self.sensitivity)
        if not out:
            return out
        top = max(out.values())
        for site in sensitive_sites(self.controller):
            out.setdefault(site, top)
        return out

    def planner_coherence(self) -> dict[str, float]:
        """The coherences a biased codec is charged (`measured_profile.charged_error`, with
        `charges_biased`): the measured ones, and `STANDIN_KAPPA` at a site not measured yet."""
        out = dict(self.coherence)
        if self.charges_biased():
            for site in sensitive_sites(self.controller):
                out.setdefault(site, STANDIN_KAPPA)
        return out

    def split_sites(self) -> tuple[list[str], list[str]]:
        """(tapped, probed): the sensitive site types whose c the exact pass gives, and the rest."""
        c = self.controller
        every = sensitive_sites(c)
        tapped = [site for site in every if linear_tap.exact_for(c, site)]
        return tapped, [site for site in every if site not in tapped]

    def noise_bounded(self) -> bool:
        """Whether plans are held to a noise budget (given, or a fraction of the sampling
        noise)."""
        cfg = self.config
        return cfg.sensitivity and (cfg.variance_budget is not None or cfg.noise_fraction is not None)

    def charges_biased(self) -> bool:
        """Whether biased codecs are charged their measured coherence (under a noise budget)."""
        return self.noise_bounded() and self.config.biased_codecs == "charge"

    def charged_codecs(self, sites: Optional[list[str]]) -> dict[str, str]:
        """site -> the charged codec whose coherence is measured there (with `charges_biased`;
        else none): the first that every layer holding the site accepts (`Controller.accepts`:
        a gated MLP takes no few-bit codec) and that is not unbiased at the site
        (`registry.unbiased_at`: at a site whose backward is linear in the stored value every
        lossy codec is charged): the one the plan in force uses there, else the site's default
        codec, else fewbit3 at the activation's input, else int4_channel."""
        if not self.charges_biased():
            return {}
        c = self.controller
        out = {}
        for site in sensitive_sites(c) if sites is None else sites:
            layers = [layer for layer in c.layers if site in c.sites(layer)]
            in_force = [c.plan.get(layer, {}).get(site) for layer in layers]
            fallback = ["fewbit3"] if site == MLP_ACT_INPUT else []
            for name in [*in_force, DEFAULT_CODECS.get(site), *fallback, "int4_channel"]:
                if (name not in (None, KEEP, RECOMPUTE) and not unbiased_at(name, site)
                        and all(c.accepts(layer, site, name) for layer in layers)):
                    out[site] = name
                    break
        return out

    def coherence_due(self, biased: dict[str, str]) -> dict[str, str]:
        """The sites of `biased` whose coherence is not measured for that codec yet: kappa is a
        property of the codec's rounding against the gradient's structure, as stable as c's
        share, so it is measured once per codec (again when its figures aged out of the window)."""
        return {site: name for site, name in biased.items()
                if self.coherence_codecs.get(site) != name or site not in self.coherence}

    # ---- the gradient fidelity --------------------------------------------------------------------
    def report_fidelity(self, probe: Optional[Callable[[], Any]], book: Callable[[float], None]) -> None:
        """The gradient-fidelity report of the iteration just ended (`llm_act.measurement.fidelity`),
        when one is due: logged, kept in `self.fidelity`, averaged over the ranks."""
        c = self.controller
        if not self.fidelity_due(c.iteration):  # the iteration that has just ended
            return
        g = agreement.groups()
        probe = self.probe_on_every_rank(probe, g)
        if probe is None:
            return
        self.fidelity_requested = False
        lossy = fidelity.lossy_sites(c.plan, c.sites)
        sites = [lossy[(self.fidelity_next + i) % len(lossy)]
                 for i in range(min(fidelity.SITES_PER_REPORT, len(lossy)))]
        self.fidelity_next += len(sites)
        start = time.perf_counter()
        try:
            named = self.named_params()
            # plan "auto" keeps the sampling variance (its tracking points measure it) and sits
            # in the measuring budget: its report replays the step's first rows, as a round
            # does; a fixed plan's measures the halves of the whole batch
            known = window_medians(self.sampling_groups_recent) if self.active and self.sampling_groups_recent else None

            def sums_of(forward, rows):
                samp = known if known is None or rows is None else {k: v * rows[0] / rows[1] for k, v in known.items()}
                return fidelity.measure_sums(c, forward, named, c.plan, sites, seed=self.config.seed + 31 * c.iteration,
                                             head=head_cut.head_of(self.replay.roots), sampling=samp)

            sums, rows = (self.on_rows(probe, 2 + len(sites), ROW_PASSES, sums_of) if known
                              else (sums_of(probe, None), None))
            sums = agreement.reduce_dict(sums, "mean", g.world if g else None)
            self.guard.commit()  # the report's last collective: what follows is this rank's alone
        finally:
            book(time.perf_counter() - start)
        report = fidelity.FidelityReport.from_sums(c.iteration, sums, rows)
        self.fidelity = (self.fidelity + [report])[-fidelity.HISTORY:]
        log.info("llm_act: %s", report.format())

    def probe_on_every_rank(self, probe: Optional[Callable[[], Any]],
                            g: Any) -> Optional[Callable[[], Any]]:
        """`probe`, else the recorded step's; None unless every rank has one (every rank
        measures or none does: the collectives inside must pair up)."""
        probe = probe or self.replay.probe()
        if g is not None:
            have = agreement.reduce_dict({"p": float(probe is not None)}, "min", g.world)["p"]
            probe = probe if have else None
        return probe

    def named_params(self) -> list:
        """(name, parameter) of the watched model, the parameters measuring counts."""
        return fidelity.named_params(self.replay.roots, self.controller.probe_params())
