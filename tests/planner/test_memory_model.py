"""One definition of the peak (issue 27, item 3): a plan's memory is its stored tensors plus
the larger of the end of forward (`loss_bytes`: the logits and the loss's bookkeeping, and
`input_bytes` when the first block encodes its checkpoint) and the largest block's backward
(its rebuilt and decoded tensors plus the gradients in flight: `grad_bytes`, or per backward
stage `stage_bytes`). Fixed plans (`evaluate_plan`) and "auto" (`solve_plan`) count it the
same way."""
from __future__ import annotations

import dataclasses

import pytest

from llm_act.plan import recompute_layer
from llm_act.planner import InfeasibleBudget, evaluate_plan, solve_plan
from llm_act.planner.analytic import block_profile
from llm_act.planner.presets import model_shape


def _block(grad=0):
    return dataclasses.replace(block_profile(model_shape("gpt2-medium", num_layers=4), count=4),
                               grad_bytes=grad)


@pytest.mark.parametrize("loss, grad", [(0, 0), (10**9, 0), (0, 3 * 10**7), (10**6, 3 * 10**7)])
def test_peak_is_the_larger_of_the_loss_and_a_blocks_backward(loss, grad):
    block = _block(grad)
    bare = evaluate_plan([_block()], [recompute_layer()])
    stored = bare.activation_bytes - bare.peak_bytes
    full = evaluate_plan([block], [recompute_layer()], loss_bytes=loss)
    assert full.peak_bytes == max(loss, bare.peak_bytes + grad)
    assert full.activation_bytes == stored + full.peak_bytes
    # the planner counts the same: at exactly that memory the plan fits (or a cheaper one
    # does), one byte less than the least plan does not
    plan = solve_plan([block], full.activation_bytes, variance_budget=0.0, loss_bytes=loss)
    assert plan.activation_bytes <= full.activation_bytes
    assert plan.peak_bytes >= loss and plan.peak_bytes >= grad
    got = evaluate_plan([block], [plan.choice[0]] if not plan.full[0] else [recompute_layer()],
                        loss_bytes=loss)
    if not plan.full[0] or sum(plan.full[0].values()) == block.count:
        assert got.activation_bytes == plan.activation_bytes


def test_a_large_loss_hides_the_transient():
    """With the end of forward above any block's backward, the least plan stores the least
    and rebuilds as much as it likes: its memory is its stored bytes plus the loss."""
    block = _block()
    with pytest.raises(InfeasibleBudget) as base:
        solve_plan([block], 0)
    loss = 10**10  # far above any block's transient
    with pytest.raises(InfeasibleBudget) as more:
        solve_plan([block], 0, loss_bytes=loss)
    least = more.value.min_budget_bytes
    assert loss < least < base.value.min_budget_bytes + loss
    plan = solve_plan([block], least, loss_bytes=loss)
    assert plan.peak_bytes == loss and plan.activation_bytes == least
    with pytest.raises(InfeasibleBudget):
        solve_plan([block], least - 1, loss_bytes=loss)


# ---- the transient per backward stage (`llm_act.planner.transient`) ------------------------

def _site(name, nbytes, inputs=()):
    from llm_act.planner import SiteProfile
    from llm_act.planner.profile import CodecOption

    return SiteProfile(name, nbytes, None if name == "ln1.input" else 1.0, inputs,
                       (CodecOption("int8", nbytes // 2, 0.1, 0.01),), 1.0)


#: a toy block: 10 bytes of attention output, 100 of the MLP's input, 1000 of its hidden
#: tensor, with gradients of 7 (attention stage) and 5000 (MLP stage) in flight
STAGED = dict(sites=(_site("ln1.input", 10), _site("attn.out", 10, ("ln1.input",)),
                     _site("ln2.input", 100, ("attn.out", "ln1.input")),
                     _site("mlp.fc2_input", 1000, ("ln2.input",))),
              stage_bytes=(("mlp", 5000), ("attention", 7)))


def _staged_peak(choice):
    from llm_act.planner import BlockProfile

    return evaluate_plan([BlockProfile(**STAGED)], [choice]).peak_bytes


def test_each_stage_holds_its_own_sites_and_gradients():
    from llm_act.planner.transient import transient_bytes

    assert _staged_peak({}) == 5000  # keep: the MLP stage's gradients
    # the MLP stage rebuilds fc2's input; attn.out decoded in the attention stage is not added
    assert _staged_peak({"mlp.fc2_input": "recompute", "attn.out": "int8"}) == 5000 + 1000
    # a rebuild of ln2.input reads attn.out: recomputed too, it is rebuilt and held then
    assert _staged_peak({"ln2.input": "recompute", "attn.out": "recompute"}) == 5000 + 100 + 10
    assert _staged_peak({"ln2.input": "recompute", "attn.out": "int8"}) == 5000 + 100 + 10  # decoded to rebuild
    assert _staged_peak({"attn.out": "recompute"}) == 5000  # the attention stage: 7 + 10
    # without stages (a measured profile): one stage, every site at once
    assert transient_bytes([10, 10, 100, 1000], ["keep", "int8", "keep", "recompute"],
                           ["ln1.input", "attn.out", "ln2.input", "mlp.fc2_input"]) == 1010


@pytest.mark.parametrize("budget", [6000, 6134, 6135, 6200, 6500, 7000, 8000, 20000])
def test_the_planner_prices_stages_as_evaluate_plan_does(budget):
    """The MILP's staged peak (carry variables, big-M decode rows) agrees with the exact
    figures: its plan fits, and is what `evaluate_plan` says of its choice."""
    from llm_act.planner import BlockProfile

    block = BlockProfile(**STAGED, count=3)
    try:
        plan = solve_plan([block], budget, fast=False)
    except InfeasibleBudget as err:
        # the input stored in int8 (3 x 5); the MLP stage rebuilds everything and decodes
        # the input to: 5000 + 1000 + 100 + 10 + 10
        assert budget < err.min_budget_bytes == 6135
        return
    again = evaluate_plan([block], [plan.choice[0]])
    assert plan.activation_bytes == again.activation_bytes <= budget
    assert plan.peak_bytes == again.peak_bytes


def test_an_encoded_first_checkpoint_keeps_the_stage_input_at_the_loss():
    from llm_act.planner import BlockProfile

    block = BlockProfile(**STAGED)
    kept = evaluate_plan([block], [{}], loss_bytes=9000, input_bytes=10)
    coded = evaluate_plan([block], [{"ln1.input": "int8"}], loss_bytes=9000, input_bytes=10)
    assert kept.peak_bytes == 9000 and coded.peak_bytes == 9010
    # the planner sees it: at the kept plan's memory minus 1 byte nothing fits but that
    # trade; with the raw input held, encoding the checkpoint saves 5 - 10 < 0
    plan = solve_plan([block], kept.activation_bytes, loss_bytes=9000, input_bytes=10, fast=False)
    assert plan.choice[0].get("ln1.input", "keep") == "keep"
