"""Whole-block choices (issue 27, item 1): the planner may recompute a block whole from its
input, kept or stored in 8 bits, and identical layers may split between that and per-site
choices. So "auto" reaches full recompute's memory wherever per-site recomputation cannot
(q, k, v and the attention output are recomputed only with the whole block at run time)."""
from __future__ import annotations

import dataclasses

import pytest

from llm_act.bench.gpu import SHAPE as GPU_SHAPE, _analytic_block
from llm_act.bench.memory import restricted_block
from llm_act.measurement.measured_profile import runtime_block
from llm_act.plan import load_plan_json, recompute_layer
from llm_act.planner import (BlockProfile, InfeasibleBudget, InfeasibleVariance, SiteProfile,
                             evaluate_plan, solve_plan)
from llm_act.planner.analytic import block_profile
from llm_act.planner.classes import block_classes, evaluate_choice
from llm_act.planner.milp_model import TimeLimit, solve_verified
from llm_act.planner.search import _split, _unsplit, full_search
from llm_act.planner.presets import MODELS, model_shape
from llm_act.sites import CHECKPOINT_SITE


def full_recompute(block):
    return evaluate_plan([block], [recompute_layer()])


@pytest.mark.parametrize("name", sorted(MODELS) + ["bench-gpt"])
def test_auto_fits_full_recomputes_memory_without_noise(name):
    """At exactly full recompute's predicted memory and a zero noise budget, a plan exists on
    every preset and on the GPU bench's GPT, with "recompute" only where the runtime offers
    it. Without the whole-block option the same problem has no plan."""
    if name == "bench-gpt":
        block = restricted_block(_analytic_block(GPU_SHAPE, 4))
    else:
        shape = MODELS[name]
        block = runtime_block(block_profile(shape.with_(seq_length=min(shape.seq_length, 4096)),
                                            count=shape.num_layers))
    full = full_recompute(block)
    plan = solve_plan([block], full.activation_bytes, variance_budget=0.0)
    assert plan.activation_bytes <= full.activation_bytes and plan.variance == 0.0
    assert plan.overhead_ms <= full.overhead_ms * (1 + 1e-9)
    with pytest.raises((InfeasibleBudget, InfeasibleVariance)):
        solve_plan([dataclasses.replace(block, full_ms=None)], full.activation_bytes, variance_budget=0.0)


def test_full_recompute_figures():
    """evaluate_plan of Megatron's "full" recompute: every layer stores its input, one block
    is rebuilt at once in backward, and each layer's forward runs again."""
    shape = model_shape("gpt2-medium", num_layers=6)
    block = block_profile(shape, count=6, inflight=2)
    full = full_recompute(block)
    ln1 = next(s for s in block.sites if s.name == CHECKPOINT_SITE)
    rest = sum(s.nbytes for s in block.sites if s.name != CHECKPOINT_SITE)
    assert full.peak_bytes == rest
    assert full.activation_bytes == 2 * 6 * ln1.nbytes + rest
    assert full.overhead_ms == pytest.approx(6 * block.full_ms)
    assert full.full == [{"keep": 6}] and full.layer_choices(0) == [recompute_layer()] * 6
    # the block input in 8 bits: half the stored bytes, its decoded copy joins the transient
    enc = evaluate_plan([block], [recompute_layer("int8")])
    int8 = next(c for c in ln1.codecs if c.name == "int8")
    assert enc.activation_bytes == 2 * 6 * int8.nbytes + rest + ln1.nbytes
    assert enc.variance == pytest.approx(6 * ln1.sensitivity * int8.variance)


def test_a_checkpoint_holding_part_of_its_site():
    """Where the checkpoint site also holds what the block's first op saved of its input (a
    Hugging Face RMSNorm's normalised copy: `BlockProfile.checkpoint_bytes`), whole-block
    recompute stores the input alone -- kept, or that share of the site's int8 code -- and
    rebuilds the rest of the site with the block; the per-site choices still store it all."""
    block = block_profile(model_shape("gpt2-medium", num_layers=6), count=6)
    ln1 = next(s for s in block.sites if s.name == CHECKPOINT_SITE)
    rest = sum(s.nbytes for s in block.sites if s.name != CHECKPOINT_SITE)
    held = ln1.nbytes // 3
    part = dataclasses.replace(block, checkpoint_bytes=held)
    kept = evaluate_plan([part], [recompute_layer()])
    assert kept.peak_bytes == rest + ln1.nbytes - held
    assert kept.activation_bytes == 6 * held + kept.peak_bytes
    int8 = next(c for c in ln1.codecs if c.name == "int8")
    enc = evaluate_plan([part], [recompute_layer("int8")])
    assert enc.activation_bytes == 6 * -(-int8.nbytes * held // ln1.nbytes) + rest + ln1.nbytes
    # the same plan under the whole site's pricing (None) stores the whole site
    assert full_recompute(block).activation_bytes == 6 * ln1.nbytes + rest
    per_site = {s.name: "keep" for s in block.sites}
    assert evaluate_plan([part], [per_site]).activation_bytes == evaluate_plan([block], [per_site]).activation_bytes
    plan = solve_plan([part], kept.activation_bytes, variance_budget=0.0)
    assert plan.activation_bytes <= kept.activation_bytes
    with pytest.raises(ValueError, match="checkpoint_bytes"):
        dataclasses.replace(block, checkpoint_bytes=ln1.nbytes + 1)


def test_an_ordered_evaluation_frees_what_later_blocks_stored():
    """`evaluate_plan(ordered=True)`: blocks in layer order backpropagate last to first, so a
    block recomputed whole before a kept one rebuilds after the kept one has freed what it
    stored; recomputed after it, it rebuilds with everything still held: the planner's bound."""
    block = block_profile(model_shape("gpt2-medium", num_layers=2), count=1)
    keep = {s.name: "keep" for s in block.sites}
    kept_bytes = sum(s.nbytes for s in block.sites)
    whole_then_kept = [recompute_layer(), keep]
    bound = evaluate_plan([block, block], whole_then_kept)
    ordered = evaluate_plan([block, block], whole_then_kept, ordered=True)
    assert bound.peak_bytes == full_recompute(block).peak_bytes
    assert ordered.activation_bytes - ordered.peak_bytes == bound.activation_bytes - bound.peak_bytes
    assert ordered.peak_bytes == max(0, bound.peak_bytes - kept_bytes)
    kept_then_whole = [keep, recompute_layer()]
    assert (evaluate_plan([block, block], kept_then_whole, ordered=True).activation_bytes
            == evaluate_plan([block, block], kept_then_whole).activation_bytes == bound.activation_bytes)


@pytest.mark.parametrize("between", [0.25, 0.5, 0.75])
def test_identical_layers_split_between_whole_and_per_site(between):
    """Between full recompute's memory and the least per-site plan's, with no noise allowed,
    the best plan recomputes some of 8 identical layers whole and plans the others per
    site: faster than recomputing all of them, and as fast as the best split found by
    trying every count."""
    n = 8
    block = runtime_block(block_profile(model_shape("gpt2-medium", num_layers=n), count=n))
    full = full_recompute(block)
    per_site = solve_plan([dataclasses.replace(block, full_ms=None)], 2**50, variance_budget=0.0,
                          objective="time")
    least_site = min_memory(dataclasses.replace(block, full_ms=None))
    assert least_site > full.activation_bytes
    budget = int(full.activation_bytes + between * (least_site - full.activation_bytes))
    plan = solve_plan([block], budget, variance_budget=0.0)
    whole = sum(plan.full[0].values())
    assert 0 < whole < n, plan.full
    assert plan.activation_bytes <= budget and plan.overhead_ms < full.overhead_ms
    assert plan.overhead_ms >= per_site.overhead_ms
    classes, _ = block_classes([block])
    tried = []
    for w in range(1, n):
        sol = solve_verified(_split(classes, 0, w), "time", budget, 0.0, TimeLimit(10.0))[0]
        if sol is not None:
            tried.append(evaluate_choice(classes, *_unsplit(classes, 0, sol))[2])
    assert plan.overhead_ms == pytest.approx(min(tried), rel=1e-9)
    # the per-layer plan: whole layers first, each a full recompute choice; its figures are
    # those of the layers evaluated one by one
    layers = plan.layer_choices(0)
    assert layers[:whole] == [recompute_layer()] * whole and layers[whole:] == [plan.choice[0]] * (n - whole)
    one = dataclasses.replace(block, count=1)
    each = [evaluate_plan([one], [c]) for c in layers]
    assert sum(e.overhead_ms for e in each) == pytest.approx(plan.overhead_ms)
    assert max(e.peak_bytes for e in each) == plan.peak_bytes
    assert sum(e.activation_bytes - e.peak_bytes for e in each) + plan.peak_bytes == plan.activation_bytes
    # and its JSON form reads back as those layers
    assert load_plan_json(plan.to_dict(), n) == dict(enumerate(
        {**recompute_layer(), **c} if c == recompute_layer() else c for c in layers))
    assert plan.layer_plans() == dict(enumerate(layers))


def min_memory(block) -> int:
    """The least memory of any plan of `block` that adds no noise."""
    classes, _ = block_classes([block])
    return sum(evaluate_choice(classes, *full_search(classes, "memory", None, 0.0, TimeLimit(10.0))[0])[:2])


def test_whole_blocks_only_where_offered():
    """No `full_ms`, no whole-block option: a plan that fits only by recomputing blocks whole
    is refused, and `evaluate_plan` of full recompute falls back to the per-site figures."""
    block = runtime_block(block_profile(model_shape("gpt2-medium", num_layers=4), count=4))
    bare = dataclasses.replace(block, full_ms=None)
    with pytest.raises(ValueError, match="not in the block"):
        evaluate_plan([bare], [recompute_layer()])
    with pytest.raises(ValueError, match="not an option here"):
        evaluate_plan([bare], [{s.name: "recompute" for s in bare.sites if s.name != CHECKPOINT_SITE}])
    with pytest.raises(ValueError, match="full_ms"):
        BlockProfile((SiteProfile("x", 8, 1.0),), full_ms=1.0)


def test_a_split_pipeline_stage_is_planned_fast():
    """96 identical layers with the whole-block option: the split search stays well under
    the planner's time budget (a handful of small solves)."""
    shape = model_shape("gpt-1.3b", num_layers=96)
    block = runtime_block(block_profile(shape, count=96))
    full = full_recompute(block)
    plan = solve_plan([block], int(full.activation_bytes * 1.3), variance_budget=0.0)
    assert 0 < sum(plan.full[0].values()) < 96
    assert plan.solve_seconds < 2.0
