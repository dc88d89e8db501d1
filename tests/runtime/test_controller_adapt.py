"""The adaptive controller (plan "auto") on a real megatron-core GPT (CPU, one rank):
tracking at exponentially growing intervals, a reset on a sharp shift, plan switches only
between iterations (logged, kept in `history`), the CPU default budget, the optimizer-hook
path, and a resumed run that continues exactly (state_dict / load_state_dict)."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply
from llm_act.plan import resolve
from llm_act.planner import evaluate_plan
from llm_act.runtime.schedule import interval_sequence
from tests import testing as T
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


# megatron-core on one gloo rank, one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _setup(seed=0, **cfg):
    model = R.build(dropout=0.1, num_layers=2, seed=seed)
    controller = apply(model, ActConfig(plan="auto", **cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, controller, opt, torch.Generator().manual_seed(seed + 7)


def _train(model, controller, opt, gen, steps, on_step=None):
    """Run `steps` iterations; per iteration: (iteration, plan in force during it, loss)."""
    out = []
    for _ in range(steps):
        ids, pos, labels = T.gpt_batch(R.BATCH, R.SEQ, R.VOCAB, generator=gen)
        if on_step is not None:
            on_step(controller.iteration + 1, model)

        def probe(ids=ids, pos=pos, labels=labels):
            return model(ids, pos, None, labels=labels)

        with controller.step(probe=probe):
            during = controller.plan
            loss = model(ids, pos, None, labels=labels).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append((controller.iteration, during, float(loss.detach())))
    return out


def _replay(tracked_resets, interval_max, last):
    """The tracking iterations the schedule must produce given the reset iterations."""
    resets = set(tracked_resets)
    out, it, stage = [], 1, 0
    while it <= last:
        out.append(it)
        if it in resets:
            stage = 0
        it += min(2 ** stage, interval_max)
        stage += 1
    return out


def test_schedule_grows_and_resets_on_an_outlier_shift():
    model, controller, opt, gen = _setup(adapt_interval_max=4, sensitivity=False)

    def inject(iteration, model):
        if iteration == 9:  # after the tracking at 8: four channels become outliers
            with torch.no_grad():
                model.embedding.word_embeddings.weight[:, :4] *= 50.0

    _train(model, controller, opt, gen, 14, on_step=inject)
    a = controller.adapter
    assert a.tracked[:4] == interval_sequence(4, 4) == [1, 2, 4, 8]
    reset_its = [it for it, _ in a.resets]
    assert 12 in reset_its and any("outlier rate of ln1.input" in r for it, rs in a.resets if it == 12 for r in rs)
    assert 13 in a.tracked  # back to an interval of 1
    assert a.tracked == _replay(reset_its, 4, 14)
    assert all(b - a_ <= 4 for a_, b in zip(a.tracked, a.tracked[1:]))


def test_plan_switches_between_iterations_and_is_logged(caplog):
    model, controller, opt, gen = _setup(budget=10**9, sensitivity=False)
    compress = resolve(ActConfig(plan="compress"), 2)
    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        steps = _train(model, controller, opt, gen, 3)
    # iteration 1 ran under "compress"; the loose budget's plan (keep everything) from 2 on
    assert steps[0][1] == compress
    keep = {i: {s: c for s, c in compress[i].items()} for i in compress}
    for i in keep:
        for s in controller.sites(i):
            keep[i][s] = "keep"
    assert steps[1][1] == keep and controller.plan == keep
    h = controller.history
    assert len(h) == 1 and h[0]["iteration"] == 1 and h[0]["overhead_ms"] == 0.0
    lines = [r.getMessage() for r in caplog.records if "plan changed" in r.getMessage()]
    assert len(lines) == 1 and "iteration 1" in lines[0] and "predicted memory" in lines[0]
    assert "MiB budget" in lines[0] and "why: " in lines[0]
    head, *table = lines[0].split("\n")  # the change on one line, then the plan per block
    assert "mlp.fc2_input: outlier_int4->keep (layers 0-1)" in head and "plan now, per block:" in head
    assert table and all(row.startswith("layers [") for row in table), table
    # a tighter budget at the next tracking point moves the plan again, between iterations
    profile = controller.adapter.measured.profile
    blocks = profile.blocks()
    static = controller.adapter.static_bytes() + profile.other_bytes
    comp = evaluate_plan(blocks, profile.choice_for(compress)).activation_bytes
    controller.config.budget = static + comp
    steps = _train(model, controller, opt, gen, 2)  # iterations 4 (tracked) and 5
    assert steps[0][1] == keep and len(controller.history) == 2
    assert controller.history[1]["iteration"] == 4 and steps[1][1] == controller.plan != keep
    assert controller.history[1]["predicted_bytes"] <= controller.config.budget


def test_cpu_default_budget_is_the_compress_plan_memory():
    model, controller, opt, gen = _setup(sensitivity=False)
    _train(model, controller, opt, gen, 1)
    a = controller.adapter
    profile = a.measured.profile
    static = a.static_bytes() + profile.other_bytes
    compress = resolve(ActConfig(plan="compress"), 2)
    comp = evaluate_plan(profile.blocks(), profile.choice_for(compress))
    assert a.budget == static + comp.activation_bytes
    # the chosen plan fits it and costs no more time than "compress" (the output loss stays
    # stock by default: `ActConfig.output_loss`)
    assert a.output_decision is None and controller.output_loss in (None, "stock")
    chosen = evaluate_plan(profile.blocks(recompute=True), profile.choice_for(controller.plan))
    assert chosen.activation_bytes <= comp.activation_bytes
    assert chosen.overhead_ms <= comp.overhead_ms + 1e-9


def test_optimizer_hook_drives_tracking():
    model, controller, opt, gen = _setup(sensitivity=False)
    controller.attach_optimizer(opt)
    batch = {}
    controller.set_probe(lambda: model(batch["ids"], batch["pos"], None, labels=batch["labels"]))
    for _ in range(4):
        batch["ids"], batch["pos"], batch["labels"] = T.gpt_batch(R.BATCH, R.SEQ, R.VOCAB, generator=gen)
        model(batch["ids"], batch["pos"], None, labels=batch["labels"]).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert controller.iteration == 4 and controller.adapter.tracked == [1, 2, 4]


def _snapshot(model, controller, opt, gen):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "model": {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
        "opt": opt.state_dict(),
        "controller": controller.state_dict(),
        "gen": gen.get_state(),
        "rng": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def _codec_states(controller):
    """Each codec's generators and device states (call count: the kernels' random stream)."""
    out = {}
    for k, v in controller._codecs.items():
        sd = v.state_dict()
        out[k] = {**sd["generators"], **{f"state {d}": t for d, t in sd["states"].items()}}
    return out


def test_resume_continues_with_the_same_plans_tracking_and_encodes():
    import copy

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    model, controller, opt, gen = _setup(adapt_interval_max=4, seed=3)
    _train(model, controller, opt, gen, 5)  # tracks 1, 2, 4
    saved = copy.deepcopy(_snapshot(model, controller, opt, gen))
    first = _train(model, controller, opt, gen, 6)  # tracks 8 (and 12 is beyond)
    first_codecs = _codec_states(controller)
    first_adapt = controller.adapter.state_dict()

    model2, controller2, opt2, gen2 = _setup(adapt_interval_max=4, seed=3)
    model2.load_state_dict(saved["model"], strict=False)
    opt2.load_state_dict(saved["opt"])
    controller2.load_state_dict(saved["controller"])
    gen2.set_state(saved["gen"])
    torch.set_rng_state(saved["rng"])
    get_cuda_rng_tracker().set_states(saved["tracker"])
    assert controller2.plan == {int(i): c for i, c in saved["controller"]["plan"].items()}
    second = _train(model2, controller2, opt2, gen2, 6)
    assert [s[0] for s in first] == [s[0] for s in second]
    assert [s[1] for s in first] == [s[1] for s in second]  # same plan in force every iteration
    assert [s[2] for s in first] == [s[2] for s in second]  # bit-identical losses
    # a tracking point fell after the save (8 without a reset; op times are wall clock, so a
    # statistics shift may reset the interval and move it): the resumed run re-planned too
    assert controller2.adapter.tracked == first_adapt["tracked"]
    assert any(t > 5 for t in first_adapt["tracked"]), first_adapt["tracked"]
    assert controller2.adapter.state_dict()["next_track"] == first_adapt["next_track"]
    assert controller2.adapter.measured.sensitivity == first_adapt["sensitivity"]
    second_codecs = _codec_states(controller2)
    assert first_codecs.keys() == second_codecs.keys()
    for key in first_codecs:  # every codec's generator and state ended alike: identical encodes
        for dev, st in first_codecs[key].items():
            assert torch.equal(st, second_codecs[key][dev]), key


def test_a_solver_failure_keeps_the_plan_warns_once_and_is_counted(caplog, monkeypatch):
    model, controller, opt, gen = _setup(sensitivity=False)
    _train(model, controller, opt, gen, 1)  # iteration 1: the first plan
    first = controller.plan
    assert controller.adapter.solver_failures == 0 and len(controller.history) == 1

    def broken(*_args, **_kwargs):
        raise RuntimeError("HiGHS: Not Solved")

    monkeypatch.setattr("llm_act.runtime.solving.solve_plan", broken)
    with caplog.at_level(logging.WARNING, logger="llm_act.runtime.controller"):
        steps = _train(model, controller, opt, gen, 7)  # iterations 2-8: tracked at 2, 4, 8
    a = controller.adapter
    assert a.tracked == [1, 2, 4, 8] and a.solver_failures == 3
    assert all(plan == first for _, plan, _ in steps) and controller.plan == first
    assert all(torch.isfinite(torch.tensor(loss)) for _, _, loss in steps)
    warned = [r.getMessage() for r in caplog.records if "planner failed" in r.getMessage()]
    assert len(warned) == 1 and "iteration 2" in warned[0] and "Not Solved" in warned[0]
    assert a.state_dict()["solver_failures"] == 3 and "3 solver failures" in a.summary()
    fresh = _setup(sensitivity=False)[1].adapter
    fresh.load_state_dict(a.state_dict())
    assert fresh.solver_failures == 3


def test_a_user_budget_no_plan_fits_is_refused_at_the_first_iteration():
    from llm_act.runtime.adapt import BudgetTooSmall

    model, controller, opt, gen = _setup(budget="1MB", sensitivity=False)
    with pytest.raises(BudgetTooSmall) as caught:
        _train(model, controller, opt, gen, 1)
    err = caught.value
    assert isinstance(err, ValueError) and err.budget_bytes == 10**6 and err.min_budget_bytes > 10**6
    text = str(err)
    assert "--act-compress-budget" in text and f"{err.min_budget_bytes} bytes" in text and "\n" not in text
    # the smallest budget it names works: the next run trains under it
    model, controller, opt, gen = _setup(budget=err.min_budget_bytes, sensitivity=False)
    _train(model, controller, opt, gen, 2)
    assert controller.history and controller.history[0]["predicted_bytes"] <= err.min_budget_bytes


def test_the_cpu_reference_budget_no_plan_fits_gets_the_tightest_plan_without_a_warning(caplog, monkeypatch):
    """On CPU the derived budget is the "compress" plan's bytes, a reference, not a memory limit:
    with biased codecs excluded (the default) the planner may not reach it, and then plans at
    the tightest plan with one info line and no warning."""
    from llm_act.planner import InfeasibleBudget, solve_plan
    from llm_act.runtime.adapt import Adapter

    # the reference out of reach (as "compress"'s outlier and per-channel codes are, unoffered)
    monkeypatch.setattr(Adapter, "_budget", lambda self, profile, static: static + 1)
    model, controller, opt, gen = _setup(sensitivity=False)
    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        _train(model, controller, opt, gen, 4)  # tracked at 1, 2, 4
    a = controller.adapter
    assert a.tracked == [1, 2, 4] and a.solver_failures == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "budget" in r.getMessage()]
    said = [r for r in caplog.records if "reference budget" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "planning at the tightest" in said[0].getMessage()
    blocks, static = a.problem(a.measured.profile)
    with pytest.raises(InfeasibleBudget):  # the tightest: nothing fits one byte less
        solve_plan(blocks, a.solution.activation_bytes + static - 1, static_bytes=static)


def test_a_derived_budget_no_plan_fits_gets_the_tightest_plan(caplog, monkeypatch):
    from llm_act.runtime.adapt import Adapter

    # a derived budget (the free memory of a crowded GPU) below what any plan needs
    monkeypatch.setattr(Adapter, "_budget", lambda self, profile, static: static + 1)
    monkeypatch.setattr("llm_act.runtime.agreement.device_free_bytes", lambda: (1, 0))  # a GPU's
    model, controller, opt, gen = _setup(sensitivity=False)
    with caplog.at_level(logging.WARNING, logger="llm_act.runtime.controller"):
        _train(model, controller, opt, gen, 4)  # tracked at 1, 2, 4
    a = controller.adapter
    assert a.tracked == [1, 2, 4] and a.solver_failures == 0
    warned = [r.getMessage() for r in caplog.records if "tightest plan" in r.getMessage()]
    assert len(warned) == 1 and "derived budget" in warned[0]
    # the plan in force is the one with the least memory: nothing fits one byte less
    profile = a.measured.profile
    blocks, static = a.problem(profile)
    least = evaluate_plan(blocks, profile.choice_for(controller.plan)).activation_bytes
    assert a.solution.activation_bytes == least
    from llm_act.planner import InfeasibleBudget, solve_plan

    with pytest.raises(InfeasibleBudget):
        solve_plan(blocks, static + least - 1, static_bytes=static)


def test_a_fixed_plan_over_a_user_budget_is_refused_at_the_first_iteration():
    from llm_act.runtime.adapt import PlanOverBudget

    def run(budget, steps):
        model = R.build(dropout=0.1, num_layers=2, seed=0)
        controller = apply(model, ActConfig(plan="compress", budget=budget))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return controller, _train(model, controller, opt, torch.Generator().manual_seed(7), steps)

    with pytest.raises(PlanOverBudget) as caught:
        run("1MB", 1)
    err = caught.value
    assert isinstance(err, ValueError) and err.needed_bytes > 10**6
    assert "plan 'compress'" in str(err) and "--act-compress-budget" in str(err) and "'auto'" in str(err)
    # the figure it names is the static memory + what the plan stores + its backward
    # transient: it fits exactly
    controller, steps = run(err.needed_bytes, 2)
    compress = resolve(ActConfig(plan="compress"), 2)
    assert controller.plan == compress and all(plan == compress for _, plan, _ in steps)
    # one definition of the peak (issue 27): "auto" is not refused at that budget either
    model = R.build(dropout=0.1, num_layers=2, seed=0)
    controller = apply(model, ActConfig(plan="auto", budget=err.needed_bytes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, controller, opt, torch.Generator().manual_seed(7), 2)
    assert controller.adapter.history and controller.adapter.budget == err.needed_bytes


@pytest.mark.gpu
def test_a_budget_above_the_gpu_memory_is_warned(caplog):
    from llm_act.runtime.memory import device_memory_bytes

    total = device_memory_bytes()
    model = R.build(dropout=0.1, num_layers=2, seed=0)  # where the model lives does not matter here
    controller = apply(model, ActConfig(plan="auto", budget=2 * total))
    with caplog.at_level(logging.WARNING, logger="llm_act.runtime.controller"):
        controller.adapter.after_iteration(None)  # the checks of a run's first iteration
        controller.adapter.after_iteration(None)  # ... are made once
    warned = [r.getMessage() for r in caplog.records if "this GPU has" in r.getMessage()]
    assert len(warned) == 1 and f"{2 * total / 1e9:.3f} GB" in warned[0]


def test_auto_at_full_recompute_memory_recomputes_layers_whole(monkeypatch):
    """With no noise allowed and a budget at full recompute's memory, "auto" recomputes every
    layer whole (issue 27: per-site recomputation cannot reach that memory, q/k/v and the
    attention output are rebuilt only with the whole block). The plan runs and adds no noise."""
    from llm_act.plan import recompute_layer
    from llm_act.runtime.adapt import Adapter

    def budget(self, profile, static):
        blocks, static = self.problem(profile)
        full = evaluate_plan(blocks, profile.choice_for({i: recompute_layer() for i in profile.layers}))
        return static + full.activation_bytes

    monkeypatch.setattr(Adapter, "_budget", budget)
    model, controller, opt, gen = _setup(sensitivity=False, variance_budget=0.0)
    steps = _train(model, controller, opt, gen, 3)
    assert controller.plan == {0: recompute_layer(), 1: recompute_layer()}
    assert all(torch.isfinite(torch.tensor(loss)) for _, _, loss in steps)
    assert controller.adapter.solution.variance == 0.0
    # without the whole-block option no lossless plan fits that budget
    from llm_act.planner import InfeasibleBudget, InfeasibleVariance, solve_plan

    blocks, static = controller.adapter.problem(controller.adapter.measured.profile)
    bare = [b.__class__(b.sites, b.count, b.inflight) for b in blocks]
    with pytest.raises((InfeasibleBudget, InfeasibleVariance)):
        solve_plan(bare, controller.adapter.budget, static_bytes=static, variance_budget=0.0)
