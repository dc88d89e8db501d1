"""Plan "auto" measures and re-plans from the training steps themselves, in every door,
with no probe and no call of ours in the loop (`llm_act.measurement.replay`, `Controller.watch`):

- a plain PyTorch loop (forward, backward, `optimizer.step()`) around `apply`;
- Megatron-LM's train step (megatron-core's schedule, an optimizer that steps fp32 master
  copies, not the model's parameters);
- DeepSpeed ZeRO 0-3 through `llm_act.patches.deepspeed.initialize`;
- our own loop under pipeline parallelism (`launch/pretrain_gpt.py`, PP=2, torchrun).

In each, a loose budget keeps far more than the "compress" plan and a tight one stores
less, and the plan is printed at the start and at every change. CPU, gloo.
"""
from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.ledger import SavedTensorLedger
from llm_act.runtime.adapt import BudgetTooSmall
from llm_act.runtime.controller import ANY_OPTIMIZER
from tests import gpt_runs as R
from tests.test_budget_doors import _ds_steps, _engine, _plain_steps, pp2_run

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

LOOSE = 10**9
STEPS = 4


def _stored(model) -> int:
    """Bytes one forward of `model` holds for backward (the plan in force)."""
    ids, pos, labels = R.batch(seed=99)
    with SavedTensorLedger() as ledger:
        out = model(ids, pos, None, labels=labels)
    out.float().mean().backward()
    model.zero_grad(set_to_none=True)
    return ledger.total_bytes


@pytest.fixture(scope="module")
def figures():
    """(bytes the "compress" plan stores, the smallest budget "auto" accepts)."""
    from llm_act.patches.megatron import apply

    model = R.build(num_layers=2)
    apply(model, ActConfig(plan="compress"))
    compress = _stored(model)
    model = R.build(num_layers=2)
    apply(model, ActConfig(plan="auto", budget=1))
    with pytest.raises(BudgetTooSmall) as caught:
        _plain_steps(model, 1)
    return compress, caught.value.min_budget_bytes


def _replanned(controller, steps=STEPS):
    assert controller.iteration == steps and controller._probe is None
    assert controller.adapter.tracked == [1, 2, 4][: len([t for t in (1, 2, 4) if t <= steps])]
    assert controller.history and controller.history[0]["reason"] == "first plan"
    assert controller.adapter.replay.calls == {}  # the recorded step is let go at the boundary


def _memory(controller, plan=None) -> int:
    """Activation memory of `plan` (default: the plan in force) in the planner's terms, on
    the controller's last measured profile: bytes stored + the backward transient."""
    from llm_act.plan import plan_from
    from llm_act.planner import evaluate_plan

    profile = controller.adapter.measured.profile
    if plan is None:
        plan = controller.plan
    elif plan == "compress":
        plan = plan_from("compress", controller.num_layers, controller.layers, controller.no_fewbit_layers())
    blocks = profile.blocks(recompute=True)
    return evaluate_plan(blocks, profile.choice_for(plan)).activation_bytes


def _tight_and_loose(figures, stored_loose, tight_controller):
    """The loose budget's plan stores far more than "compress"; the tight budget's plan
    takes less activation memory than "compress" would on the same measured step."""
    compress, _ = figures
    assert stored_loose > 2 * compress, (stored_loose, compress)
    tight, reference = _memory(tight_controller), _memory(tight_controller, "compress")
    assert tight < reference, (tight, reference)


def test_a_plain_loop_replans_with_no_call_of_ours(figures, caplog):
    from llm_act.patches.megatron import apply

    stored = {}
    with caplog.at_level(logging.INFO, logger="llm_act"):
        for budget in (figures[1], LOOSE):
            model = R.build(num_layers=2)
            controller = apply(model, ActConfig(plan="auto", budget=budget))
            _plain_steps(model, STEPS)
            _replanned(controller)
            assert controller.boundary == ANY_OPTIMIZER
            stored[budget] = (_stored(model), controller)
    _tight_and_loose(figures, stored[LOOSE][0], stored[figures[1]][1])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "plan in force at the start ('auto' starts from 'compress'" in text
    changed = [r.getMessage() for r in caplog.records if "plan changed" in r.getMessage()]
    assert changed and all("of the" in m and "noise budget" in m and "why: first plan" in m
                           # (layer 1's plan also carries the final norm's input: a line of its own
                           # when that is encoded)
                           and "plan now, per block:\nlayers [0" in m for m in changed[:1]), changed


def test_an_optimizer_that_does_not_train_the_model_does_not_advance_it():
    from llm_act.patches.megatron import apply

    model = R.build(num_layers=2)
    controller = apply(model, ActConfig(plan="auto"))
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(1, 2)).sum().backward()
    opt.step()  # no forward of the watched model before it
    assert controller.iteration == 0
    _plain_steps(model, 1)
    opt.step()  # a second optimizer after the step's boundary: not another iteration
    assert controller.iteration == 1


def _megatron_lm_steps(model, steps):
    """What Megatron-LM's `train_step` does: megatron-core's schedule over the micro-batches,
    then an optimizer whose torch optimizer steps fp32 master copies (Megatron's
    Float16/Distributed optimizers), never the model's parameters."""
    import functools

    from megatron.core.pipeline_parallel import get_forward_backward_func

    params = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().clone().float()) for p in params]
    inner = torch.optim.AdamW(masters, lr=1e-3)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        ids, pos, labels = next(data_iterator)
        return model(ids, pos, None, labels=labels), loss_func

    for i in range(steps):
        batches = [R.batch(seed=10 * i + m) for m in range(2)]
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=2, seq_length=R.SEQ, micro_batch_size=R.BATCH, forward_only=False)
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        inner.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
                p.grad = None


def test_megatron_lm_train_step_replans(figures):
    from llm_act.patches.megatron import apply

    stored = {}
    for budget in (figures[1], LOOSE):
        model = R.build(num_layers=2)
        controller = apply(model, ActConfig(plan="auto", budget=budget))
        _megatron_lm_steps(model, STEPS)
        _replanned(controller)
        stored[budget] = (_stored(model), controller)
    _tight_and_loose(figures, stored[LOOSE][0], stored[figures[1]][1])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_zero_replans(figures, stage):
    stored = {}
    for budget in (figures[1], LOOSE):
        engine = _engine(R.build(num_layers=2), {"plan": "auto", "budget": budget},
                         zero={"stage": stage})
        _ds_steps(engine, STEPS)
        _replanned(engine.act_controller)
        assert engine.act_controller.boundary == "engine.step()"
        ids, pos, labels = R.batch(seed=99)
        with SavedTensorLedger() as ledger:
            out = engine(ids, pos, None, labels=labels)
        engine.backward(out.float().mean())
        stored[budget] = (ledger.total_bytes, engine.act_controller)
    _tight_and_loose(figures, stored[LOOSE][0], stored[figures[1]][1])


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [("--pipeline-model-parallel-size", "2"),
                                      ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
                                      ()], ids=["pp2", "tp2-sp", "dp2"])
def test_our_loop_replans_under_every_parallelism(tmp_path, parallel):
    """`pretrain_gpt.py` on two ranks (torchrun): PP=2 (each stage records its own steps --
    the first stage's token batch, the second stage's received activations -- and plans its
    own blocks; both keep the same tracking schedule, so their collectives pair up), TP=2
    with sequence parallelism (each rank measures its shard; statistics reduced, one plan
    broadcast), DP=2 (each replica its own batch). No rank waits; the run ends normally.
    The gradient-fidelity reports (every 2 iterations here) are combined over the ranks the
    same way: each stage or shard its own parameters, one report."""
    proc = pp2_run(tmp_path, ["--train-iters", "4", "--act-compress-fidelity-every", "2"], timeout=400,
                   env={"LLM_ACT_COLLECTIVE_TIMEOUT": "120"}, parallel=parallel)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "could not measure" not in proc.stdout + proc.stderr
    assert re.search(r"re-planning: 3 tracking points, [1-9]\d* plan changes, 0 solver failures", proc.stdout), \
        proc.stdout[-3000:]
    fid = re.search(r"gradient fidelity at iteration 4: relative error ([0-9.e+-]+)", proc.stdout)
    assert fid and 0 < float(fid.group(1)) < 1, proc.stdout[-3000:]
    assert "plan changed" in proc.stdout and "plan in force" in proc.stdout
