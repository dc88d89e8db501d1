"""On CPU, plan "auto"'s default budget is the memory of the "compress" plan with every
micro-batch in flight on this pipeline stage (1F1B: p - k), as the planner counts them.

Counted with one in flight, stage 0 of PP=2 got a budget "compress" itself did not fit, so
the planner was driven to int1/int2 codecs at 3x the mini-batch sampling noise (seen in
Megatron-LM's `pretrain()` at PP=2, docs/megatron_lm.md). One rank here; the stage's
in-flight count is what `llm_act.runtime.memory.inflight` reports (set to 2, as on stage 0 of 2).
"""
import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply
from llm_act.plan import resolve
from llm_act.planner import evaluate_plan
from llm_act.runtime import memory
from tests import testing as T
from tests import gpt_runs as R

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def test_cpu_default_budget_counts_every_micro_batch_in_flight(monkeypatch):
    monkeypatch.setattr(memory, "inflight", lambda: 2)
    model = R.build(dropout=0.1, num_layers=2)
    controller = apply(model, ActConfig(plan="auto", sensitivity=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, pos, labels = T.gpt_batch(R.BATCH, R.SEQ, R.VOCAB, generator=torch.Generator().manual_seed(7))
    model(ids, pos, None, labels=labels).float().mean().backward()
    opt.step()  # the step boundary: iteration 1 is tracked
    a = controller.adapter
    assert controller.iteration == 1 and a.measured.profile is not None
    static = a.static_bytes() + a.measured.profile.other_bytes
    compress = resolve(ActConfig(plan="compress"), 2)
    at = {n: evaluate_plan(a.measured.profile.blocks(inflight=n), a.measured.profile.choice_for(compress)).activation_bytes
          for n in (1, 2)}
    assert at[2] > at[1]
    assert a.budget == static + at[2]
    # "compress" fits, so the chosen plan stores no more than it and costs no more time
    chosen = evaluate_plan(a.measured.profile.blocks(inflight=2, recompute=True), a.measured.profile.choice_for(controller.plan))
    assert chosen.activation_bytes <= at[2]
