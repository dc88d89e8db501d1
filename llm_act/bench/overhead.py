"""What measuring costs (`llm-act bench overhead`): plan "auto" on the bench GPT in our loop,
the share of the run's wall time its tracking points take, and what each one costs in
training steps (issue 27: at most 2% of a 1,000-step run with a budget, no tracking point
above 1.5 steps).

The run measures from its own training steps (`llm_act.measurement.replay`), exactly as in
every other door. A tracking point's phases come from `Adapter.track_costs` (the step tap's
hooks inside the tracking iteration's own training step, the measured profile, the
sensitivity passes, agreement and solve) and its measuring round in words
(`measuring.round_label`); its cost in steps is its seconds over
the median step of the same run that tracked nothing. Both are taken in this one run (times
mean something only as these ratios). With `budget_fraction`, "auto" gets the budget that
lets it store that fraction of stock's bytes in the layers (`convergence.budget_for`, from a
3-step stock run of the same model), as the convergence bench's "auto" rows do.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

from llm_act.bench import convergence as C
from llm_act.train import parallel
from llm_act.train.data import embedded_corpus
from llm_act.train.loop import quiet_megatron_warnings
from llm_act.train.trainer import Trainer

#: the issue's targets
TARGET_SHARE = 0.02
TARGET_STEPS_PER_POINT = 1.5


def run(steps: int = 1000, quick: bool = False, seed: int = 1234,
        budget_fraction: Optional[float] = None) -> dict:
    """{steps, seconds, measuring_seconds, fraction, tracked, changes, budget, step_s,
    points: [{iteration, step tap, profile, sensitivity, solve, total, steps, round}], reports: [{iteration, total,
    steps}] (the gradient-noise reports)} of one "auto" run."""
    quiet_megatron_warnings()
    data = embedded_corpus()
    model = C.QUICK_MODEL if quick else C.MODELS[0]
    parallel.init(C.train_args(steps, seed, quick))
    try:
        budget = None
        extra = ["--act-compress", "--act-compress-plan", "auto"]
        if budget_fraction is not None:
            stock = C.train_one(model, "stock", seed, 3, data, quick=quick)
            budget = C.budget_for(stock, budget_fraction)
            extra += ["--act-compress-budget", str(budget)]
        trainer = Trainer(C.train_args(steps, seed, quick, extra=tuple(extra)), data)
        adapter = trainer.controller.adapter
        times = []
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        seconds = time.perf_counter() - start
    finally:
        parallel.destroy_parallel()
    tracked = {int(p["iteration"]) for p in adapter.track_costs + adapter.report_costs}
    # step i (0-based) runs iteration i + 1; the first steps also build caches: skip 2
    quiet = [t for i, t in enumerate(times) if i + 1 not in tracked and i >= 2] or times
    step_s = statistics.median(quiet)
    points = [{**p, "steps": p["total"] / step_s} for p in adapter.track_costs]
    reports = [{**p, "steps": p["total"] / step_s} for p in adapter.report_costs]
    return {"steps": steps, "seconds": seconds, "measuring_seconds": adapter.measure_seconds,
            "fraction": adapter.measure_seconds / seconds, "tracked": list(adapter.tracked),
            "changes": len(adapter.history), "budget": budget, "budget_fraction": budget_fraction,
            "step_s": step_s, "points": points, "reports": reports}


def table(row: dict) -> str:
    """The run's line, then one line per tracking point."""
    budget = ("none (the compress plan's memory)" if row.get("budget") is None
              else f"{row['budget']} B ({row['budget_fraction']:g} of stock's layer bytes)")
    lines = [
        "| steps | budget | run wall time | median step | measuring + planning | share of the run "
        f"(target <= {100 * TARGET_SHARE:g}%) | plan changes |",
        "|---:|---|---:|---:|---:|---:|---:|",
        f"| {row['steps']} | {budget} | {row['seconds']:.1f} s | {1000 * row['step_s']:.1f} ms | "
        f"{row['measuring_seconds']:.2f} s | {100 * row['fraction']:.2f}% | {row['changes']} |",
    ]
    if row.get("points"):
        lines += ["", f"| tracking iteration | step tap | profile | sensitivity | agreement + solve | total | in steps "
                      f"(target <= {TARGET_STEPS_PER_POINT:g}) | round |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p in row["points"]:
            lines.append(f"| {int(p['iteration'])} | {1000 * p.get('step tap', 0.0):.0f} ms | "
                         f"{1000 * p.get('profile', 0.0):.0f} ms | "
                         f"{1000 * p.get('sensitivity', 0.0):.0f} ms | {1000 * p.get('solve', 0.0):.0f} ms | "
                         f"{1000 * p['total']:.0f} ms | {p['steps']:.1f} | {p.get('round', '')} |")
    if row.get("reports"):
        lines += ["", "| gradient-noise report at iteration | total | in steps |", "|---:|---:|---:|"]
        lines += [f"| {int(p['iteration'])} | {1000 * p['total']:.0f} ms | {p['steps']:.1f} |" for p in row["reports"]]
    return "\n".join(lines)
