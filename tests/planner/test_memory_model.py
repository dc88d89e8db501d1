"""One definition of the peak (issue 27, item 3): a plan's memory is its stored tensors plus
the larger of the end of forward (`loss_bytes`: the logits and the loss's bookkeeping) and the
largest block's backward (its rebuilt and decoded tensors plus `grad_bytes`, the gradients in
flight). Fixed plans (`evaluate_plan`) and "auto" (`solve_plan`) count it the same way."""
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
