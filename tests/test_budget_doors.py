"""An impossible `budget` is refused at the start in the doors that give the controller no
probe, measured on the real first training step through the hooks the controller installs
itself (`llm_act.runtime.budget_check.FirstForward`):

- DeepSpeed (`llm_act.patches.deepspeed.initialize`) with a megatron-core GPT: the first
  `engine.step()` raises `BudgetTooSmall` (plan "auto", the smallest budget any plan fits,
  from the analytic profile at the observed shape) or `PlanOverBudget` (a fixed plan, what it
  stores on that step + static memory); the figure each names trains;
- `apply()` in a plain torch loop (Megatron-LM's door: nothing advances the controller): the
  first forward raises the same way;
- DeepSpeed with a Hugging Face-style model (the generic path): a fixed plan is checked the
  same way; plan "auto" is refused at the first tracking point (the first step's boundary),
  from the blocks measured there, with the smallest budget, which trains.

CPU, one gloo rank (megatron-core's parallel state up), a torch optimizer (no DeepSpeed op
to build).
"""
from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.runtime.adapt import BudgetTooSmall, PlanOverBudget
from tests import testing as T
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

#: above the static memory of the test GPT (weights and gradients, 1.03 MB), below what any
#: plan needs on top of it
BUDGET = 1_060_000


def _ds_env():
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")


def _engine(model, section, zero=None, micro_batch=R.BATCH):
    """A DeepSpeed engine (our `initialize`, a torch AdamW) over `model` with the
    activation_compression `section` (ZeRO stage 0 unless `zero` says)."""
    from llm_act.patches.deepspeed import initialize

    _ds_env()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": zero or {"stage": 0}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**6, "activation_compression": section}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return initialize(model=model, optimizer=optimizer, config=config)[0]


def _ds_steps(engine, steps):
    for i in range(steps):
        ids, pos, labels = R.batch(seed=i)
        loss = engine(ids, pos, None, labels=labels).float().mean()
        engine.backward(loss)
        engine.step()


def _plain_steps(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        ids, pos, labels = R.batch(seed=i)
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _one_line(err):
    text = str(err)
    assert "--act-compress-budget" in text and "\n" not in text
    return text


def test_deepspeed_megatron_auto_budget_refused_at_the_first_step_and_the_named_one_trains():
    engine = _engine(R.build(num_layers=2), {"plan": "auto", "budget": BUDGET, "sensitivity": False})
    ids, pos, labels = R.batch()
    engine.backward(engine(ids, pos, None, labels=labels).float().mean())  # the first forward passes
    with pytest.raises(BudgetTooSmall) as caught:
        engine.step()
    err = caught.value
    # BUDGET holds the static memory (parameters, gradients) but no plan's activations on top
    assert err.budget_bytes == BUDGET and err.static_bytes < BUDGET < err.min_budget_bytes
    assert f"{err.min_budget_bytes} bytes" in _one_line(err)
    assert err.static_bytes < err.min_budget_bytes
    # one byte less is refused the same way (the figure is the edge, not a bound)
    engine = _engine(R.build(num_layers=2), {"plan": "auto", "budget": err.min_budget_bytes - 1,
                                             "sensitivity": False})
    with pytest.raises(BudgetTooSmall):
        _ds_steps(engine, 1)
    # the figure it names works: a run under it passes its first steps
    engine = _engine(R.build(num_layers=2), {"plan": "auto", "budget": err.min_budget_bytes,
                                             "sensitivity": False})
    _ds_steps(engine, 2)
    first = engine.act_controller.adapter.first
    assert first.checked and first.result["min"] == err.min_budget_bytes
    assert first.shape == (R.SEQ, R.BATCH, 64)


def test_deepspeed_megatron_fixed_plan_over_budget_refused_at_the_first_step():
    engine = _engine(R.build(num_layers=2), {"plan": "compress", "budget": 100000})
    with pytest.raises(PlanOverBudget) as caught:
        _ds_steps(engine, 1)
    err = caught.value
    assert err.needed_bytes > 100000 and "plan 'compress'" in _one_line(err)
    engine = _engine(R.build(num_layers=2), {"plan": "compress", "budget": err.needed_bytes})
    _ds_steps(engine, 2)
    assert engine.act_controller.adapter.first.result["need"] == err.needed_bytes
    assert engine.act_controller.iteration == 2


def test_a_first_step_under_the_users_own_ledger_is_measured_through_it():
    from llm_act.ledger import SavedTensorLedger

    def run(budget, steps):
        engine = _engine(R.build(num_layers=2), {"plan": "compress", "budget": budget})
        for i in range(steps):
            ids, pos, labels = R.batch(seed=i)
            with SavedTensorLedger() as ledger:  # ours would hide the tensors from it: read off it
                loss = engine(ids, pos, None, labels=labels).float().mean()
            assert ledger.total_bytes > 0
            engine.backward(loss)
            engine.step()
        return engine

    with pytest.raises(PlanOverBudget) as caught:
        run(100000, 1)
    engine = run(10**9, 1)
    assert engine.act_controller.adapter.first.result["need"] == caught.value.needed_bytes
    with pytest.raises(PlanOverBudget) as own:  # the same step measured by our own ledger
        _ds_steps(_engine(R.build(num_layers=2), {"plan": "compress", "budget": 100000}), 1)
    assert own.value.needed_bytes == caught.value.needed_bytes


def test_a_first_step_under_other_saved_tensor_hooks_is_not_measured_and_says_so(caplog):
    engine = _engine(R.build(num_layers=2), {"plan": "compress", "budget": 100000})
    with caplog.at_level(logging.WARNING, logger="llm_act.runtime.controller"):
        for i in range(2):
            ids, pos, labels = R.batch(seed=i)
            with torch.autograd.graph.save_on_cpu():  # the user's hooks: ours would shadow them
                loss = engine(ids, pos, None, labels=labels).float().mean()
            engine.backward(loss)
            engine.step()
    warned = [r.getMessage() for r in caplog.records if "is not checked" in r.getMessage()]
    assert len(warned) == 1 and "100000 bytes" in warned[0], warned
    assert not engine.act_controller.adapter.first.handles  # nothing left running


def test_apply_in_a_plain_loop_refuses_at_the_first_forward():
    from llm_act.patches.megatron import apply

    model = R.build(num_layers=2)
    apply(model, ActConfig(plan="auto", budget=BUDGET, sensitivity=False))
    with pytest.raises(BudgetTooSmall) as caught:
        _plain_steps(model, 1)
    auto = caught.value
    assert auto.static_bytes < BUDGET < auto.min_budget_bytes and f"{auto.min_budget_bytes} bytes" in _one_line(auto)
    model = R.build(num_layers=2)
    apply(model, ActConfig(plan="auto", budget=auto.min_budget_bytes, sensitivity=False))
    _plain_steps(model, 2)

    model = R.build(num_layers=2)
    apply(model, ActConfig(plan="keep", budget=100000))
    with pytest.raises(PlanOverBudget) as caught:
        _plain_steps(model, 1)
    keep = caught.value
    assert "plan 'keep'" in _one_line(keep)
    model = R.build(num_layers=2)
    controller = apply(model, ActConfig(plan="keep", budget=keep.needed_bytes))
    _plain_steps(model, 2)
    assert controller.adapter.first.result["need"] == keep.needed_bytes
    # a minimum the "keep" plan must be above: the analytic edge keeps less than stock
    assert auto.min_budget_bytes < keep.needed_bytes


def test_apply_with_an_attached_optimizer_checks_at_its_step():
    from llm_act.patches.megatron import apply

    model = R.build(num_layers=2)
    controller = apply(model, ActConfig(plan="compress", budget=100000))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller.attach_optimizer(opt)
    ids, pos, labels = R.batch()
    model(ids, pos, None, labels=labels).float().mean().backward()  # the forward passes
    with pytest.raises(PlanOverBudget):
        opt.step()


def _hf_engine(section):
    from llm_act.patches.deepspeed import hf_decoder

    model = hf_decoder.build("llama", hidden_size=64, num_layers=2, max_positions=64, seed=7)
    return _engine(model, section, micro_batch=2)


def _hf_steps(engine, steps):
    from llm_act.patches.deepspeed import hf_decoder

    for i in range(steps):
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(i))
        engine.backward(hf_decoder.lm_loss(engine, tokens[:, :-1], tokens[:, 1:]))
        engine.step()


def test_deepspeed_generic_fixed_plan_checked_and_auto_refused_at_the_first_tracking(caplog):
    engine = _hf_engine({"plan": "compress", "budget": 100000, "adapt": False})
    with pytest.raises(PlanOverBudget) as caught:
        _hf_steps(engine, 1)
    need = caught.value.needed_bytes
    _hf_steps(_hf_engine({"plan": "compress", "budget": need, "adapt": False}), 1)

    # "auto" measures the blocks at the first tracking point (the first step's boundary) and
    # refuses a budget no plan fits there, naming the smallest; that one trains
    with caplog.at_level(logging.WARNING, logger="llm_act.runtime.controller"):
        with pytest.raises(BudgetTooSmall) as caught:
            _hf_steps(_hf_engine({"plan": "auto", "budget": 100000, "sensitivity": False}), 1)
    assert not [r for r in caplog.records if "smallest activation budget" in r.getMessage()]
    _one_line(caught.value)
    smallest = caught.value.min_budget_bytes
    assert smallest > 100000
    # 1% above it: a later point's measured figures move a little (256 bytes here)
    budget = int(smallest * 1.01)
    engine = _hf_engine({"plan": "auto", "budget": budget, "sensitivity": False})
    _hf_steps(engine, 2)
    assert engine.act_controller.adapter.tracked == [1, 2]
    assert all(h["predicted_bytes"] <= budget for h in engine.act_controller.adapter.history)


def _dp_worker(rank, world, port):
    """Two data-parallel ranks under ZeRO-2, each with its own data (so what the outlier
    codecs store differs): every rank stops at the first step with the same figure, and the
    figure trains on both."""
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    from llm_act.runtime import agreement

    deepspeed.init_distributed(dist_backend="gloo")
    T.init_parallel(rank=rank, world_size=world)

    def engine(section):
        return _engine(R.build(num_layers=2), section, zero={"stage": 2})

    def steps(eng, n):
        for i in range(n):
            ids, pos, labels = R.batch(seed=100 * rank + i)
            eng.backward(eng(ids, pos, None, labels=labels).float().mean())
            eng.step()

    for section, error, figure in (({"plan": "compress", "budget": 100000}, PlanOverBudget, "needed_bytes"),
                                   ({"plan": "auto", "budget": BUDGET, "sensitivity": False}, BudgetTooSmall,
                                    "min_budget_bytes")):
        with pytest.raises(error) as caught:
            steps(engine(section), 1)
        named = getattr(caught.value, figure)
        got = agreement.gather((str(caught.value), named))
        assert got[0] == got[1], got
        steps(engine({**section, "budget": named}), 2)  # the figure trains, on every rank


def test_every_data_parallel_rank_stops_with_the_same_figure():
    T.spawn(_dp_worker, 2, timeout=120)


def pp2_run(cwd, extra, timeout=300, env=None, parallel=("--pipeline-model-parallel-size", "2")):
    """`launch/pretrain_gpt.py` on two ranks (torchrun, gloo; by default two pipeline
    stages, else the `parallel` flags), a 2-layer GPT with --act-compress
    --act-compress-plan auto and `extra` flags; the finished process."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(T.free_port()),
         os.path.join(root, "launch", "pretrain_gpt.py"), "--lr-warmup-iters", "0",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--eval-iters", "0", *parallel, "--act-compress",
         "--act-compress-plan", "auto", *extra],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_pipeline_stages_of_our_loop_stop_together_without_a_probe(tmp_path):
    """PP=2 in `pretrain_gpt.py` (torchrun): the loop gives the controller no probe under
    pipeline parallelism; the first step's hooks measure each stage (through the loop's own
    ledger) and, at the step boundary, every rank of every stage exits with code 2 and the
    same line: the figure is the largest stage's."""
    import re

    proc = pp2_run(tmp_path, ["--train-iters", "3", "--act-compress-budget", "1MB"])
    lines = re.findall(r"pretrain_gpt\.py: error: the activation budget of 1000000 bytes .*", proc.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
    assert "smallest budget any plan fits is" in lines[0] and " iteration        2/" not in proc.stdout
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
