"""What measuring costs: plan "auto" on the bench GPT in our loop, the share of the run's
wall time its tracking points take (recording nothing extra on other steps; at a tracking
point: the measured profile, the sparse sensitivity passes, the agreement and the solve).

The run measures from its own training steps (`llm_act.measurement.replay`), exactly as in every
other door; the figure is `Adapter.measure_seconds` over the run's wall time, both taken
in this one run (times mean something only as this ratio).
"""
from __future__ import annotations

import time

from llm_act.bench.convergence import train_args
from llm_act.train import parallel
from llm_act.train.data import embedded_corpus
from llm_act.train.loop import quiet_megatron_warnings
from llm_act.train.trainer import Trainer


def run(steps: int = 300, quick: bool = False, seed: int = 1234) -> dict:
    """{steps, seconds, measuring_seconds, fraction, tracked, changes} of one "auto" run."""
    quiet_megatron_warnings()
    args = train_args(steps, seed, quick, extra=("--act-compress", "--act-compress-plan", "auto"))
    parallel.init(args)
    try:
        trainer = Trainer(args, embedded_corpus())
        adapter = trainer.controller.adapter
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        seconds = time.perf_counter() - start
    finally:
        parallel.destroy_parallel()
    return {"steps": steps, "seconds": seconds, "measuring_seconds": adapter.measure_seconds,
            "fraction": adapter.measure_seconds / seconds, "tracked": list(adapter.tracked),
            "changes": len(adapter.history)}


def table(row: dict) -> str:
    return "\n".join([
        "| steps | run wall time | measuring + planning | share of the run | tracking iterations | plan changes |",
        "|---:|---:|---:|---:|---|---:|",
        f"| {row['steps']} | {row['seconds']:.1f} s | {row['measuring_seconds']:.2f} s | "
        f"{100 * row['fraction']:.2f}% | {', '.join(map(str, row['tracked']))} | {row['changes']} |",
    ])
