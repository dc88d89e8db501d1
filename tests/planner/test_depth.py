"""The planner at real depth: per-layer sensitivities make every layer its own block, and
the default solve (the fast path: Lagrangian relaxation of both budget rows with exact
per-block choices) plans them with no stall, within a hair of a long MILP search, fitting
both budgets exactly and choosing the same plan every time."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("pulp")

from llm_act.bench import planner as P  # noqa: E402
from llm_act.planner import evaluate_plan, solve_plan  # noqa: E402
from llm_act.planner import fast, milp, milp_model  # noqa: E402
from llm_act.planner.classes import block_classes  # noqa: E402


def _fits(blocks, plan, budget, noise):
    got = evaluate_plan(blocks, plan.choice)  # exact figures, integer bytes
    assert got.activation_bytes == plan.activation_bytes <= budget
    assert got.variance <= noise * (1 + 1e-6)
    assert got.overhead_ms == pytest.approx(plan.overhead_ms, rel=1e-12)


def test_96_distinct_blocks_plan_fast_fit_and_repeat(monkeypatch):
    """The speed goal (96 distinct blocks in well under 0.5 s: about 0.25 s here) lives in
    `llm-act bench planner`; this test checks what makes it fast -- no MILP over the 96
    distinct classes is ever built -- and that the plan is exact and repeatable."""
    blocks, budget, noise, uniform_block = P.distinct_problem(96)
    sizes = []
    real_model = milp_model._Model
    monkeypatch.setattr(milp_model, "_Model", lambda classes, *a, **k: sizes.append(len(classes)) or
                        real_model(classes, *a, **k))
    t0 = time.perf_counter()
    plan = solve_plan(blocks, budget, variance_budget=noise)
    wall = time.perf_counter() - t0
    print(f"\n96 distinct blocks: {wall:.3f} s, {plan.overhead_ms:.3f} ms/iter")
    assert sizes and max(sizes) < 96  # only the merged (uniform) MILP ran
    assert not plan.optimal  # the fast path proves nothing
    _fits(blocks, plan, budget, noise)
    uniform = solve_plan([uniform_block], budget, variance_budget=noise)
    assert plan.overhead_ms < uniform.overhead_ms  # per-layer choices pay
    again = solve_plan(list(blocks), budget, variance_budget=noise)
    assert again.choice == plan.choice and again.overhead_ms == plan.overhead_ms


def test_24_distinct_blocks_within_one_percent_of_a_long_search():
    blocks, budget, noise, _ = P.distinct_problem(24, seed=1)
    plan = solve_plan(blocks, budget, variance_budget=noise)
    _fits(blocks, plan, budget, noise)
    ref = solve_plan(blocks, budget, variance_budget=noise, time_limit=8.0, fast=False)
    _fits(blocks, ref, budget, noise)
    print(f"\n24 distinct blocks: fast {plan.overhead_ms:.4f} ms, MILP (8 s) {ref.overhead_ms:.4f} ms, "
          f"gap {plan.overhead_ms / ref.overhead_ms - 1:+.3%}")
    # issue 27: within 0.5% (0.93% before the fast path also tried the uniform plan's partly
    # decoded attention group opened; +0.19% now)
    assert plan.overhead_ms <= ref.overhead_ms * 1.005


def test_24_jittered_blocks_within_half_a_percent_of_a_long_search():
    """Times and noise both differing by a few percent per layer (as measured profiles do):
    still the fast path, as the adapter solves it (times rounded to their noise), within
    0.5% of a long MILP search and above the bound that search proves."""
    blocks, budget, noise = P.jittered_problem(24, seed=1)
    classes, _ = block_classes(blocks)
    assert len(classes) == 24 and fast.fast_applies(classes, "time", budget, noise, None)
    plan = solve_plan(blocks, budget, variance_budget=noise, time_resolution=milp.TIME_RESOLUTION)
    _fits(blocks, plan, budget, noise)
    assert not plan.optimal and plan.bound_ms is None  # the fast path: no MILP over 24 classes
    ref = solve_plan(blocks, budget, variance_budget=noise, time_limit=8.0, fast=False)
    _fits(blocks, ref, budget, noise)
    print(f"\n24 jittered blocks: fast {plan.overhead_ms:.4f} ms, MILP (8 s) {ref.overhead_ms:.4f} ms "
          f"(bound {ref.bound_ms}), gap {plan.overhead_ms / ref.overhead_ms - 1:+.3%}")
    assert plan.overhead_ms <= ref.overhead_ms * 1.005
    assert ref.bound_ms is not None and ref.bound_ms <= ref.overhead_ms * (1 + 1e-9)
    assert plan.overhead_ms >= ref.bound_ms * (1 - 1e-9)


def test_plans_repeat_under_measurement_noise():
    """The same 48 distinct layers measured 4 times (every time and noise figure off by up
    to 2%) give plans whose added time on the true profile agrees within 0.1%."""
    got = P.reproducibility(48, repeats=4)
    print(f"\n{got}")
    assert got["spread"] <= 1e-3


def test_fast_path_applies_only_where_it_is_meant_to():
    blocks, budget, noise, _ = P.distinct_problem(3)
    assert 3 < fast.FAST_MIN_CLASSES
    small = solve_plan(blocks, budget, variance_budget=noise, time_limit=20.0)
    assert small.optimal  # few distinct blocks: the exact MILP, proven
    forced = solve_plan(blocks, budget, variance_budget=noise, fast=True)
    _fits(blocks, forced, budget, noise)
    # forced on 3 blocks (where it never runs) it stays close; its 0.5% is held at 24+ blocks
    # (above): its transient bound (the reference plan's recomputed sites) is loosest here
    assert not forced.optimal and forced.overhead_ms <= small.overhead_ms * 1.05
    # many distinct blocks: the fast path, but only for the time objective under a noise budget
    many, budget, noise, _ = P.distinct_problem(fast.FAST_MIN_CLASSES)
    classes, _ = block_classes(many)
    assert fast.fast_applies(classes, "time", budget, noise, None)
    assert not fast.fast_applies(classes, "time", budget, None, None)
    assert not fast.fast_applies(classes, "variance", budget, noise, None)
    assert not fast.fast_applies(classes, "time", budget, noise, False)
    assert not fast.fast_applies(classes[:3], "time", budget, noise, None)
