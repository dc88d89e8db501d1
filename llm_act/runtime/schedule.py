"""When plan "auto" tracks: the exponential backoff and the shifts that reset it.

One job: the spacing of the tracking iterations (Adacc sec. 3.4). Statistics settle as
training goes on, so the tracking points grow apart: 1, 2, 4, ... iterations, at most
`ActConfig.adapt_interval_max`. A sharp shift -- an outlier rate, or the sensitivity of a
site carrying at least `SENS_SHARE` of the predicted noise, that moved by more than
`SHIFT_FACTOR` since the last tracking -- sends the spacing back to 1. The `Adapter`
(`llm_act.runtime.adapt`) keeps the state (`stage`, `next_track`, `last`) and calls these.
"""
from __future__ import annotations

#: a statistic that moved by more than this factor since the last tracking resets the spacing
SHIFT_FACTOR = 2.0
#: outlier rates are compared as (a + eps) / (b + eps), eps = this many channels' share, at
#: least _OUTLIER_EPS_RATE (a change of a few channels of many, within the scatter of a
#: token sample, is not a shift)
_OUTLIER_EPS_CHANNELS = 2
_OUTLIER_EPS_RATE = 0.01
#: a sensitivity shift counts only for a site carrying at least this share of the plan's
#: predicted noise (two-draw estimates of minor sites fluctuate without consequence)
SENS_SHARE = 0.1


def interval(stage: int, interval_max: int) -> int:
    """Iterations from a tracking point at backoff `stage` to the next: 2**stage, capped."""
    return min(2 ** stage, interval_max)


def interval_sequence(n: int, interval_max: int) -> list[int]:
    """The first `n` tracking iterations without shifts: 1, 2, 4, ... (spacing capped)."""
    out, it, stage = [], 1, 0
    for _ in range(n):
        out.append(it)
        it += interval(stage, interval_max)
        stage += 1
    return out


def _ratio(a: float, b: float, eps: float) -> float:
    a, b = abs(a) + eps, abs(b) + eps
    return max(a, b) / min(a, b) if min(a, b) > 0 else (1.0 if a == b else float("inf"))


def _shares_of_common(a: dict[str, float], b: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """`a` and `b` restricted to their common keys, each renormalised to sum to 1 there."""
    common = [k for k in a if k in b]
    sa, sb = sum(a[k] for k in common), sum(b[k] for k in common)
    return ({k: a[k] / sa for k in common} if sa > 0 else {k: a[k] for k in common},
            {k: b[k] / sb for k in common} if sb > 0 else {k: b[k] for k in common})


def shifts(last: dict[str, dict[str, float]], stats: dict[str, dict[str, float]]) -> list[str]:
    """Sharp shifts of `stats` against `last` (the statistics of the last tracking), one
    reason each; `last` is updated to these statistics."""
    reasons = []
    for site, rate in stats["outlier"].items():
        before = last.get("outlier", {}).get(site)
        eps = max(_OUTLIER_EPS_CHANNELS / max(1, stats["channels"].get(site, 1)), _OUTLIER_EPS_RATE)
        if before is not None and _ratio(rate, before, eps) > SHIFT_FACTOR:
            reasons.append(f"outlier rate of {site} {before:.3f}->{rate:.3f}")
    if "c" in stats and last.get("c"):
        now, then = stats["c"], last["c"]
        if stats.get("relative"):  # shares: of the sites measured both times (a newly
            # measured site adds to the sum without moving the others against each other)
            now, then = _shares_of_common(now, then)
        for site, val in now.items():
            before = then.get(site)
            share = max(stats["share"].get(site, 0.0), last.get("share", {}).get(site, 0.0))
            if before is not None and share >= SENS_SHARE and _ratio(val, before, 0.0) > SHIFT_FACTOR:
                reasons.append(f"sensitivity of {site} {before:.3g}->{val:.3g}")
    last["outlier"] = dict(stats["outlier"])
    if "c" in stats:
        last["c"] = dict(stats["c"])
        last["share"] = dict(stats["share"])
    return reasons
