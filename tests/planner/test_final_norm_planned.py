"""The final norm's input in the plan and the analytic planner: the last layer's plan carries
its choice (`Plan.layer_plans`), the recompute plans keep it, it is never recomputed, and the
last pipeline stage plans it as a block of its own (`analytic.outer_profile`) instead of
counting it in `static_memory.outer_bytes`."""
from __future__ import annotations

import pytest

from llm_act.codecs.registry import check_choice
from llm_act.plan import compress_layer, is_whole, keep_layer, plan_from, recompute_layer, selective_layer
from llm_act.planner import evaluate_plan, solve_plan
from llm_act.planner.analytic import block_profile, outer_profile, stage_blocks
from llm_act.planner.milp import InfeasibleBudget
from llm_act.planner.presets import model_shape
from llm_act.planner.static_memory import loss_bytes, outer_bytes
from llm_act.sites import FINAL_NORM_INPUT, LN1_INPUT

SHAPE = model_shape("gpt2-medium", seq_length=1024, micro_batch_size=4)


def test_fixed_plans_and_choices():
    assert keep_layer()[FINAL_NORM_INPUT] == "keep"
    assert compress_layer()[FINAL_NORM_INPUT] == compress_layer()[LN1_INPUT] == "outlier_int4"
    assert recompute_layer()[FINAL_NORM_INPUT] == recompute_layer("int8")[FINAL_NORM_INPUT] == "keep"
    assert selective_layer()[FINAL_NORM_INPUT] == "keep"
    with pytest.raises(ValueError, match="cannot be recomputed"):
        check_choice(FINAL_NORM_INPUT, "recompute")
    with pytest.raises(ValueError, match="only to dropout-mask sites"):
        check_choice(FINAL_NORM_INPUT, "regen")
    # a block recomputed whole leaves the final norm's input to its own choice
    block = block_profile(SHAPE)
    assert is_whole({**recompute_layer(), FINAL_NORM_INPUT: "int8"}, block)
    # a JSON plan names it in the last layer's block
    plan = plan_from({"version": 1, "blocks": [{"layers": [0, 22], "choice": {}},
                                               {"layers": [23, 23], "choice": {FINAL_NORM_INPUT: "int4"}}]}, 24)
    assert plan[23][FINAL_NORM_INPUT] == "int4" and plan[0][FINAL_NORM_INPUT] == "keep"


def test_the_last_stage_plans_it_as_its_own_block():
    pp2 = model_shape("gpt2-medium", seq_length=1024, micro_batch_size=4, pp=2)
    first, last = stage_blocks(pp2, 0), stage_blocks(pp2, 1)
    assert len(first) == 1 and len(last) == 2
    final = last[1]
    assert final == outer_profile(pp2, inflight=1) and final.count == 1 and final.full_ms is None
    site = final.sites[0]
    n_hid = 1024 * 4 * 1024
    assert site.name == FINAL_NORM_INPUT and site.nbytes == n_hid * 2 + 8 * 1024 * 4
    assert not site.recomputable
    assert {c.name for c in site.codecs} >= {"outlier_int4", "int8", "int4"}
    # counted once: no longer in the fixed outer bytes or the end-of-forward floor
    assert "final_norm.input" not in outer_bytes(pp2, 1)
    # sensitivities reach it through stage_blocks
    assert stage_blocks(pp2, 1, sensitivity={FINAL_NORM_INPUT: 3.0})[1].sites[0].sensitivity == 3.0


def test_the_planner_compresses_it_when_memory_is_tight():
    blocks = stage_blocks(SHAPE, 0, gradients=True)
    peak = dict(loss_bytes=loss_bytes(SHAPE), input_bytes=0)
    keep = evaluate_plan(blocks, [{}, {}], **peak).activation_bytes
    squeezed = evaluate_plan(blocks, [{}, {FINAL_NORM_INPUT: "outlier_int4"}], **peak).activation_bytes
    assert squeezed < keep  # the loss event binds "keep" here: the final norm's saving is seen
    try:
        solve_plan(blocks, 0, **peak)
    except InfeasibleBudget as err:
        least = err.min_budget_bytes
    plan = solve_plan(blocks, least, **peak)
    assert plan.choice[1][FINAL_NORM_INPUT] not in ("keep", "recompute")
    layers = plan.layer_plans()
    assert sorted(layers) == list(range(24))  # the extra block adds no layer
    assert layers[23][FINAL_NORM_INPUT] == plan.choice[1][FINAL_NORM_INPUT]
    assert FINAL_NORM_INPUT not in layers[0]
    assert solve_plan(blocks, 10**12, **peak).choice[1][FINAL_NORM_INPUT] == "keep"
