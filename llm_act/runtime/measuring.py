"""What plan "auto" measures at a tracking point, and the statistics it keeps of it.

One job: the measurements of the `Adapter` (`llm_act.runtime.adapt`) and their bookkeeping.
At a tracking point the sites are measured again on the current batch (`measure_profile`:
bytes with the real outlier counts, compression ratios, errors; the op times only at the
first tracking, they do not drift with the data), and every other time GACT's sensitivities,
the coherence of biased codecs and the mini-batch sampling noise (`measure_sensitivity`),
each reduced over the ranks (`llm_act.runtime.agreement`). The planner takes the median of
the last `SENS_WINDOW` measurements of each figure: a two-draw estimate can be off by 10x on
a small batch, and one wild draw must not move the plan (a probed type's as a share of the
linears' c, which every point measures: `scaled_medians`). To keep a point cheap, every codec
is measured on every site only every `FULL_PROFILE_EVERY` points and the sensitivities of
`SENS_SITES_PER_TRACK` site types in rotation. The gradient-fidelity report
(`llm_act.measurement.fidelity`) is measured here too.

The functions take the `Adapter` and read and update its state (`profile`, `times`,
`c_recent`, `sensitivity`, ...): that state is checkpointed with it.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from llm_act.codecs.registry import KEEP, RECOMPUTE, UNBIASED_CODECS
from llm_act.measurement import fidelity, head_cut, linear_tap
from llm_act.measurement.measure import measure_profile
from llm_act.measurement.sensitivity import measure_sensitivity, sensitive_sites
from llm_act.runtime import agreement
from llm_act.sites import DEFAULT_CODECS, MLP_ACT_INPUT

if TYPE_CHECKING:
    from llm_act.runtime.adapt import Adapter

log = logging.getLogger("llm_act.runtime.controller")  # the adapter speaks as its controller
#: the planner uses the median of the last this many sensitivity measurements (a two-draw
#: estimate can be off by 10x on a small batch; one wild draw must not move the plan)
SENS_WINDOW = 3
#: every this many tracking points every codec is measured again on every site; in between,
#: only the codecs whose bytes depend on the data (outlier channels) and those in force
#: (their errors feed the noise check), the others' figures carried over
FULL_PROFILE_EVERY = 4
#: after the first measurement of every site type, this many probed types are measured
#: again at each sensitivity point, in rotation (each costs a pass; between measurements a
#: probed type's c follows the tapped sites' scale, `scaled_medians`)
SENS_SITES_PER_TRACK = 1


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


# ---- the profile ---------------------------------------------------------------------------
def track_profile(a: "Adapter", probe: Callable[[], Any], g: Any) -> tuple[Any, dict[str, dict]]:
    """The sites measured at this tracking point, agreed over the ranks (`MeasuredProfile`),
    and the statistics a shift is looked for in: the outlier rates of the site types the plan
    in force stores lossily (at a kept or recomputed site they change neither the bytes nor
    the noise; the next solve sees them in the profile anyway), and the channels."""
    c = a.controller
    refresh = a.profile is None or a.track_count % FULL_PROFILE_EVERY == 0
    fresh = None if refresh else sorted(data_codecs(a))
    profile = measure_profile(c, probe, times_from=a.times, codecs=fresh, keep_from=a.profile)
    if not refresh:
        profile.carry_options(a.profile)
    profile = agreement.agree_profile(profile, g)
    if a.times is None:
        a.times = profile.times()
    lossy = fidelity.lossy_sites(c.plan, c.sites)
    stats = {"outlier": {site: rate for site, rate in profile.outlier_rates().items() if site in lossy},
             "channels": {site: st.shape[-1] for (_, site), st in profile.sites.items() if st.shape}}
    return profile, stats


def data_codecs(a: "Adapter") -> set[str]:
    """Codecs re-measured at every tracking point (see FULL_PROFILE_EVERY)."""
    c = a.controller
    return {"outlier_int4"} | ({n for choice in c.plan.values() for n in choice.values()}
                               - {KEEP, RECOMPUTE})


# ---- the sensitivities ---------------------------------------------------------------------
def track_sensitivity(a: "Adapter", probe: Callable[[], Any], profile: Any, stats: dict[str, dict],
                      g: Any) -> None:
    """Every other tracking point (with `ActConfig.sensitivity`): measure the sensitivities,
    coherences and sampling noise, keep their window medians on `a`, and add the sensitivities
    and each site's share of the predicted noise to `stats`."""
    if not (a.config.sensitivity and a.track_count % 2 == 0):
        return
    c = a.controller
    named = named_params(a)
    tapped, probed = split_sites(a)
    sites = sensitivity_sites(a, tapped, probed)
    biased = coherence_due(a, coherence_codecs(a, sites), tapped)
    sens = measure_sensitivity(c, probe, [p for _, p in named], seed=a.config.seed + c.iteration,
                               sites=sites, groups=[fidelity.group_name(n) for n, _ in named],
                               biased=biased, head=head_cut.head_of(a.replay.roots))
    world = g.world if g else None
    fresh = agreement.reduce_dict(sens.c, "mean", world)
    rounds = sens_rounds(probed)
    a.c_recent = (a.c_recent + [fresh])[-SENS_WINDOW * rounds:]
    a.sensitivity = scaled_medians(a.c_recent, tapped)
    if charges_biased(a):
        kappa = agreement.reduce_dict(sens.coherence, "mean", world)
        a.coherence_codecs.update({site: name for site, name in (biased or {}).items() if site in kappa})
        a.coherence_recent = (a.coherence_recent + [kappa])[-SENS_WINDOW * rounds:]
        a.coherence = window_medians(a.coherence_recent)
    sn = agreement.reduce_dict({} if sens.sampling_noise is None else {"s": sens.sampling_noise},
                               "mean", world)
    if "s" in sn:  # one micro-batch's halves: a rough estimate, hence the median
        a.sampling_recent = (a.sampling_recent + [sn["s"]])[-SENS_WINDOW:]
    a.sampling_noise = median(a.sampling_recent) if a.sampling_recent else None
    stats["c"] = plan_relevant_c(a.sensitivity, a.sampling_noise, a.config.variance_budget)
    by_site = profile.noise_by_site(c.plan, a.sensitivity, a.coherence)
    total = sum(by_site.values())
    stats["share"] = {s: v / total for s, v in by_site.items()} if total > 0 else {}


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


def sensitivity_sites(a: "Adapter", tapped: list[str], probed: list[str]) -> list[str]:
    """The site types whose c is measured at this tracking point: every linear's input (its
    c comes from the exact pass, `llm_act.measurement.linear_tap`, at no extra pass) and
    `SENS_SITES_PER_TRACK` of the others in rotation (GACT's c is stable along training;
    each probed type costs a forward/backward pass), all of them the first time when a
    noise budget (`variance_budget`) makes the plan depend on every c. `tapped`, `probed`:
    `split_sites(a)`."""
    first = not a.sensitivity and noise_bounded(a)
    if first or len(probed) <= SENS_SITES_PER_TRACK:
        return tapped + probed
    start = a.sens_next % len(probed)
    a.sens_next = start + SENS_SITES_PER_TRACK
    return tapped + [probed[(start + i) % len(probed)] for i in range(SENS_SITES_PER_TRACK)]


def split_sites(a: "Adapter") -> tuple[list[str], list[str]]:
    """(tapped, probed): the sensitive site types whose c the exact pass gives, and the rest."""
    c = a.controller
    every = sensitive_sites(c)
    tapped = [site for site in every if linear_tap.exact_for(c, site)]
    return tapped, [site for site in every if site not in tapped]


def sens_rounds(probed: list[str]) -> int:
    """Measurements it takes for every probed site type (`split_sites`) to be measured
    SENS_WINDOW times."""
    return max(1, -(-len(probed) // SENS_SITES_PER_TRACK))


def noise_bounded(a: "Adapter") -> bool:
    """Whether plans are held to a noise budget (given, or a fraction of the sampling
    noise): then every site's sensitivity is measured at the first tracking."""
    cfg = a.config
    return cfg.sensitivity and (cfg.variance_budget is not None or cfg.noise_fraction is not None)


def charges_biased(a: "Adapter") -> bool:
    """Whether biased codecs are charged their measured coherence (under a noise budget)."""
    return noise_bounded(a) and a.config.biased_codecs == "charge"


def coherence_codecs(a: "Adapter", sites: Optional[list[str]]) -> Optional[dict[str, str]]:
    """site -> the biased codec whose coherence is measured there (with `charges_biased`):
    the one the plan in force uses at that site, else the site's default codec when it
    is biased, else int4_channel (fewbit3 at the activation's input)."""
    if not charges_biased(a):
        return None
    c = a.controller
    out = {}
    for site in sites or sensitive_sites(c):
        in_force = [ch[site] for ch in c.plan.values() if ch.get(site) not in (None, KEEP, RECOMPUTE)]
        biased = [n for n in in_force if n not in UNBIASED_CODECS]
        default = DEFAULT_CODECS.get(site)
        out[site] = (biased[0] if biased else default if default and default not in UNBIASED_CODECS
                     else "fewbit3" if site == MLP_ACT_INPUT else "int4_channel")
    return out


def coherence_due(a: "Adapter", biased: Optional[dict[str, str]],
                  tapped: list[str]) -> Optional[dict[str, str]]:
    """The sites of `biased` whose coherence is measured at this point: every one of
    `tapped` (the exact pass gives it, no pass of its own), and a probed one (a pass each)
    only where it has no kappa yet for that codec: kappa is a property of the codec's
    rounding against the gradient's structure, as stable as c's share."""
    if biased is None:
        return None
    return {site: name for site, name in biased.items()
            if site in tapped or a.coherence_codecs.get(site) != name or site not in a.coherence}


# ---- the gradient fidelity -----------------------------------------------------------------
def report_fidelity(a: "Adapter", probe: Optional[Callable[[], Any]]) -> None:
    """The gradient-fidelity report of the iteration just ended (`llm_act.measurement.fidelity`),
    when one is due: logged, kept in `a.fidelity`, averaged over the ranks."""
    c = a.controller
    if not a.fidelity_due(c.iteration):  # the iteration that has just ended
        return
    g = agreement.groups()
    probe = probe_on_every_rank(a, probe, g)
    if probe is None:
        return
    a.fidelity_requested = False
    lossy = fidelity.lossy_sites(c.plan, c.sites)
    sites = [lossy[(a.fidelity_next + i) % len(lossy)]
             for i in range(min(fidelity.SITES_PER_REPORT, len(lossy)))]
    a.fidelity_next += len(sites)
    start = time.perf_counter()
    try:
        named = named_params(a)
        sums = fidelity.measure_sums(c, probe, named, c.plan, sites, seed=a.config.seed + 31 * c.iteration,
                                     head=head_cut.head_of(a.replay.roots))
        sums = agreement.reduce_dict(sums, "mean", g.world if g else None)
    finally:
        spent = time.perf_counter() - start
        a.measure_seconds += spent
        a.report_costs.append({"iteration": float(c.iteration), "total": spent})
    report = fidelity.FidelityReport.from_sums(c.iteration, sums)
    a.fidelity = (a.fidelity + [report])[-fidelity.HISTORY:]
    log.info("llm_act: %s", report.format())


def probe_on_every_rank(a: "Adapter", probe: Optional[Callable[[], Any]],
                        g: Any) -> Optional[Callable[[], Any]]:
    """`probe`, else the recorded step's; None unless every rank has one (every rank
    measures or none does: the collectives inside must pair up)."""
    probe = probe or a.replay.probe()
    if g is not None:
        have = agreement.reduce_dict({"p": float(probe is not None)}, "min", g.world)["p"]
        probe = probe if have else None
    return probe


def named_params(a: "Adapter") -> list:
    """(name, parameter) of the watched model, the parameters measuring counts."""
    return fidelity.named_params(a.replay.roots, a.controller.probe_params())
