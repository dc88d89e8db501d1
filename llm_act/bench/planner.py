"""Planner: MILP solve time against model depth, and predicted against measured bytes.

Solve time: `solve_plan` on the analytic profile of a preset GPT (gpt-1.3b shape, one
micro-batch) for 24/48/96/128 layers, at a budget of 20% of the stock activations and the
noise budget of the "compress" plan (what `llm-act plan` solves). Identical layers form one
block with `count` = depth, as measured profiles group them, so the variable count does not
grow with depth; the table gives the variables and the wall time of the solve.

Distinct layers: with per-layer sensitivities every layer is its own block (24-512 of
them); the table gives the default solve's wall time (the fast path, Lagrangian relaxation
with exact per-block choices) and its gap against the best plan a long full-MILP search
finds (60 s; 2 s on 24 layers under `--quick`).

Predicted against measured: for several plans of the bench's GPT block, the per-block bytes
the analytic profile predicts (`evaluate_plan`, stored bytes without the transient peak)
beside the bytes the ledger counts at that block's sites (outside-block tensors -- RoPE
tables, the causal mask -- excluded from both).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Optional

from llm_act import cpu
from llm_act.bench import memory as M
from llm_act.planner import BlockProfile, evaluate_plan, milp, solve_plan
from llm_act.planner.analytic import block_profile
from llm_act.planner.budget import reference_variance
from llm_act.planner.model_shape import ModelShape
from llm_act.planner.presets import model_shape
from llm_act.train import parallel

DEPTHS = (24, 48, 96, 128)
MODEL = "gpt-1.3b"
BUDGET_FRACTION = 0.2
#: the plans compared (scheme names of llm_act.bench.memory)
COMPARED = ("stock", "megatron selective", "megatron full", "ActNN int2", "GACT 4-bit avg",
            "compress (Adacc)", "planner loose", "planner middle", "planner tight")


def _base_block(model: str):
    """(one block of `model`'s analytic profile at micro-batch 1, with the options the
    bench can bind; its stock bytes)."""
    base = M.restricted_block(block_profile(model_shape(model, micro_batch_size=1)))
    return base, sum(s.nbytes for s in base.sites)


def solve_times(depths=DEPTHS, model: str = MODEL) -> list[dict]:
    """[{layers, variables, seconds, activation_fraction, overhead_ms}] per depth."""
    base, per_block = _base_block(model)
    rows = []
    for n in depths:
        blocks = [dataclasses.replace(base, count=n)]
        noise = reference_variance(blocks)
        t0 = time.perf_counter()
        plan = solve_plan(blocks, int(BUDGET_FRACTION * n * per_block), variance_budget=noise)
        wall = time.perf_counter() - t0
        rows.append({"layers": n, "variables": plan.num_variables, "seconds": wall,
                     "activation_fraction": plan.activation_bytes / (n * per_block),
                     "overhead_ms": plan.overhead_ms})
    return rows


#: distinct-layer depths of the fast-path table
DISTINCT_DEPTHS = (24, 48, 96, 192, 512)
#: seconds of the reference MILP search the fast path is measured against
REFERENCE_LIMIT_S = 60.0


def distinct_problem(n: int, model: str = MODEL, seed: int = 0):
    """(blocks, budget bytes, noise budget, uniform block) of `n` distinct layers: each
    layer's sensitivities scaled by a factor in [0.5, 1.5), as GACT-style measurements
    differ per layer, so every layer is its own block; the noise budget is 80% of the
    uniform compress plan's, so it binds, and the memory budget 20% of stock plus one block
    (room for the transient)."""
    import random

    base, per_block = _base_block(model)
    rng = random.Random(seed)
    factors = [0.5 + rng.random() for _ in range(n)]
    uniform_block = BlockProfile(base.sites, count=n).scaled(sum(factors) / n)
    noise = 0.8 * reference_variance([uniform_block])
    budget = int(BUDGET_FRACTION * n * per_block) + per_block
    return [base.scaled(f) for f in factors], budget, noise, uniform_block


#: relative spread of the measured times and noise of the jittered-profile tables
JITTER = 0.03
#: the time resolution the adapter plans measured profiles with (`solve_plan(time_resolution=)`)
TIME_RESOLUTION = milp.TIME_RESOLUTION


def jittered(block: BlockProfile, rng, jitter: float = JITTER) -> BlockProfile:
    """`block` as one more measurement would give it: every time (producer forward, codec
    encode and decode, the whole block) and every site's sensitivity times an independent
    factor in [1 - jitter, 1 + jitter)."""
    def f(x):
        return None if x is None else x * (1 - jitter + 2 * jitter * rng.random())

    sites = tuple(dataclasses.replace(
        st, forward_ms=f(st.forward_ms), sensitivity=f(st.sensitivity),
        codecs=tuple(dataclasses.replace(c, encode_ms=f(c.encode_ms), decode_ms=f(c.decode_ms))
                     for c in st.codecs)) for st in block.sites)
    return dataclasses.replace(block, sites=sites, full_ms=f(block.full_ms))


def jittered_problem(n: int, model: str = MODEL, seed: int = 0, jitter: float = JITTER):
    """`distinct_problem` with every layer's times and per-site noise also differing by
    `jitter` (as measured profiles always do): (blocks, budget, noise budget)."""
    import random

    blocks, budget, noise, _ = distinct_problem(n, model, seed)
    rng = random.Random(seed + 10_000)
    return [jittered(b, rng, jitter) for b in blocks], budget, noise


def jittered_solve_times(depths=DISTINCT_DEPTHS, model: str = MODEL,
                         time_limit: float = REFERENCE_LIMIT_S, seed: int = 0) -> list[dict]:
    """Per depth of jittered layers (`jittered_problem`: times and noise differ per layer):
    the adapter's solve (`time_resolution=TIME_RESOLUTION`, the fast path) -- wall time,
    added time -- against the full MILP's best plan in `time_limit` seconds and the lower
    bound it proved (`Plan.bound_ms`)."""
    rows = []
    for n in depths:
        blocks, budget, noise = jittered_problem(n, model, seed)
        t0 = time.perf_counter()
        plan = solve_plan(blocks, budget, variance_budget=noise, time_resolution=TIME_RESOLUTION)
        wall = time.perf_counter() - t0
        ref = solve_plan(blocks, budget, variance_budget=noise, time_limit=time_limit, fast=False)
        rows.append({"layers": n, "seconds": wall, "overhead_ms": plan.overhead_ms,
                     "reference_ms": ref.overhead_ms, "bound_ms": ref.bound_ms, "optimal": ref.optimal,
                     "time_limit": time_limit, "reference_seconds": ref.solve_seconds,
                     "gap": plan.overhead_ms / ref.overhead_ms - 1 if ref.overhead_ms else 0.0,
                     "gap_to_bound": (plan.overhead_ms / ref.bound_ms - 1) if ref.bound_ms else None})
    return rows


#: measurements of one profile the reproducibility check plans
REPEATS = 8
#: the measurement noise it draws them with (times and noise, relative)
MEASUREMENT_NOISE = 0.02


def reproducibility(n: int = 96, model: str = MODEL, seed: int = 0, repeats: int = REPEATS,
                    noise_level: float = MEASUREMENT_NOISE) -> dict:
    """The same `n` distinct layers measured `repeats` times (every time and noise figure
    off by up to `noise_level`), each planned as the adapter plans (`time_resolution`):
    how many distinct plans, and the spread of their added time on the true profile."""
    import random

    blocks, budget, noise, _ = distinct_problem(n, model, seed)
    rng = random.Random(seed + 20_000)
    costs, plans = [], set()
    for _ in range(repeats):
        measured = [jittered(b, rng, noise_level) for b in blocks]
        plan = solve_plan(measured, budget, variance_budget=noise, time_resolution=TIME_RESOLUTION)
        layers = list(plan.layer_plans().values())
        plans.add(json.dumps(layers, sort_keys=True))
        costs.append(evaluate_plan(blocks, layers).overhead_ms)
    return {"layers": n, "repeats": repeats, "noise": noise_level, "plans": len(plans),
            "spread": max(costs) / min(costs) - 1 if min(costs) > 0 else 0.0,
            "cost_min": min(costs), "cost_max": max(costs)}


def distinct_solve_times(depths=DISTINCT_DEPTHS, model: str = MODEL,
                         time_limit: float = REFERENCE_LIMIT_S, seed: int = 0) -> list[dict]:
    """Per depth of distinct layers (`distinct_problem`): the default `solve_plan` (the
    fast path: Lagrangian relaxation with exact per-block choices) -- its wall time and
    added time -- against the best plan the full MILP finds in `time_limit` seconds
    (`fast=False`), and the best uniform plan (every layer choosing alike, at the mean
    sensitivity). `gap` = fast / reference - 1 (negative: the fast plan is the better)."""
    rows = []
    for n in depths:
        blocks, budget, noise, uniform_block = distinct_problem(n, model, seed)
        uniform = solve_plan([uniform_block], budget, variance_budget=noise)
        t0 = time.perf_counter()
        plan = solve_plan(blocks, budget, variance_budget=noise)
        wall = time.perf_counter() - t0
        ref = solve_plan(blocks, budget, variance_budget=noise, time_limit=time_limit, fast=False)
        rows.append({"layers": n, "variables": ref.num_variables, "seconds": wall,
                     "optimal": ref.optimal, "time_limit": time_limit,
                     "overhead_ms": plan.overhead_ms, "reference_ms": ref.overhead_ms,
                     "reference_seconds": ref.solve_seconds,
                     "gap": plan.overhead_ms / ref.overhead_ms - 1 if ref.overhead_ms else 0.0,
                     "uniform_ms": uniform.overhead_ms})
    return rows


def _analytic_block(shape: ModelShape, scheme: M.Scheme):
    attention = scheme.attention if scheme.convert_attention else "stock"
    return block_profile(M.analytic_shape(shape, attention))


def predicted_block_bytes(shape: ModelShape, scheme: M.Scheme) -> int:
    """Stored bytes of one block under `scheme` by the analytic profile (no peak)."""
    block = _analytic_block(shape, scheme)
    names = {s.name for s in block.sites}
    choice = {s: c for s, c in scheme.choice.items() if s in names}
    plan = evaluate_plan([block], [choice])
    return plan.activation_bytes - plan.peak_bytes


def compare(shape: ModelShape, rows: Optional[list[dict]] = None,
            names=COMPARED, log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """[{scheme, predicted, measured, error}] per block for `names`; `rows`: memory-bench rows
    of this shape to reuse (measured here otherwise)."""
    schemes = {s.name: s for s in M.all_schemes(shape)}
    measured: dict[str, int] = {}
    for r in rows or []:
        if r["shape"] == shape:
            measured[r["scheme"]] = sum(n for (layer, _), n in r["by_site"].items() if layer == 0)
    missing = [n for n in names if n not in measured]
    if missing:

        cpu.install()  # the bench owns its process: megatron-core on CPU needs the stand-ins
        parallel.init_parallel(seed=1234)
        try:
            for n in missing:
                res = M.measure(shape, schemes[n])
                measured[n] = sum(b for (layer, _), b in res["by_site"].items() if layer == 0)
                log(f"  measured {n}")
        finally:
            parallel.destroy_parallel()
    out = []
    for n in names:
        pred = predicted_block_bytes(shape, schemes[n])
        out.append({"scheme": n, "predicted": pred, "measured": measured[n],
                    "error": pred / measured[n] - 1 if measured[n] else float("nan"),
                    "sbh": M.sbh(shape)})
    return out


def solve_table(rows: list[dict]) -> str:
    lines = ["| layers | MILP variables | solve s | activations / stock | added ms/iter (model) |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['variables']} | {r['seconds']:.3f} | "
                     f"{r['activation_fraction']:.3f} | {r['overhead_ms']:.1f} |")
    return "\n".join(lines)


def distinct_table(rows: list[dict]) -> str:
    lines = ["| layers (distinct) | MILP variables | fast solve s | added ms/iter (fast) | "
             "reference MILP (limit s) | reference proven optimal | reference ms/iter | "
             "gap (fast / reference - 1) | best uniform plan ms/iter |",
             "|---:|---:|---:|---:|---:|:---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['variables']} | {r['seconds']:.3f} | "
                     f"{r['overhead_ms']:.3f} | {r['time_limit']:g} | "
                     f"{'yes' if r['optimal'] else 'no (time limit)'} | {r['reference_ms']:.3f} | "
                     f"{r['gap']:+.3%} | {r['uniform_ms']:.3f} |")
    return "\n".join(lines)


def jittered_table(rows: list[dict]) -> str:
    lines = ["| layers (jittered) | fast solve s | added ms/iter (fast) | reference MILP (limit s) | "
             "reference ms/iter | reference bound ms/iter | gap to reference | gap to bound |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bound = "" if r["bound_ms"] is None else f"{r['bound_ms']:.3f}"
        to_bound = "" if r["gap_to_bound"] is None else f"{r['gap_to_bound']:+.3%}"
        lines.append(f"| {r['layers']} | {r['seconds']:.3f} | {r['overhead_ms']:.3f} | {r['time_limit']:g}"
                     f"{'' if not r['optimal'] else ' (optimal)'} | {r['reference_ms']:.3f} | {bound} | "
                     f"{r['gap']:+.3%} | {to_bound} |")
    return "\n".join(lines)


def reproducibility_line(r: dict) -> str:
    return (f"{r['layers']} distinct layers measured {r['repeats']} times (every time and noise "
            f"figure off by up to {r['noise']:.0%}), planned as the adapter plans them (times rounded "
            f"to {TIME_RESOLUTION:.0%}): {r['plans']} distinct plan(s); their added time on the true "
            f"profile spans {r['cost_min']:.4f}-{r['cost_max']:.4f} ms/iter ({r['spread']:.4%}; "
            f"target <= 0.1%).")


def compare_table(rows: list[dict]) -> str:
    lines = ["| plan | predicted B/sbh | measured B/sbh (ledger) | predicted / measured - 1 |",
             "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['predicted'] / r['sbh']:.3f} | "
                     f"{r['measured'] / r['sbh']:.3f} | {r['error']:+.1%} |")
    return "\n".join(lines)

