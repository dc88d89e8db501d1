"""`Controller.load_state_dict` on a real megatron-core GPT (CPU, one rank): the config the
controller runs under now wins over the checkpoint's. The saved plan and planner state come
back only under an unchanged config, a codec's random stream only under its own seed, and
every decision is logged (logger "llm_act.runtime.controller")."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply
from llm_act.plan import is_keep
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _trained(steps=2, **cfg):
    """A compressed GPT after `steps` iterations (its codecs have drawn random numbers)."""
    model = R.build(dropout=0.0, num_layers=2, seed=0)
    controller = apply(model, ActConfig(**cfg))
    for k in range(steps):
        with controller.step():
            ids, pos, labels = R.batch(seed=k)
            model(ids, pos, None, labels=labels).float().mean().backward()
    return model, controller


def _fresh(**cfg):
    return apply(R.build(dropout=0.0, num_layers=2, seed=0), ActConfig(**cfg))


def _streams(controller):
    return {key: codec.state_dict()["generators"]["cpu"] for key, codec in controller._codecs.items()
            if "cpu" in codec.state_dict()["generators"]}


def _load(controller, state, caplog):
    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        notes = controller.load_state_dict(state)
    logged = [r.getMessage() for r in caplog.records if r.name == "llm_act.runtime.controller"]
    assert logged == notes
    return notes


def test_the_same_config_restores_plan_and_codec_streams(caplog):
    _, saved = _trained(plan="compress")
    streams = _streams(saved)
    assert streams  # stochastic rounding drew from the codecs' generators
    saved.set_plan("keep")  # a plan of the user's, not the flags': pending until the next step
    state = saved.state_dict()
    assert state["config"] == saved.config.to_dict()
    ctl = _fresh(plan="compress")
    notes = _load(ctl, state, caplog)
    assert ctl.iteration == 2 and ctl.plan == saved.plan and not is_keep(ctl.plan)
    assert ctl.pending_plan == saved.pending_plan and is_keep(ctl.pending_plan)
    got = _streams(ctl)
    assert got.keys() == streams.keys() and all(torch.equal(got[k], streams[k]) for k in streams)
    assert notes == ["act controller: restored iteration 2",
                     f"act codecs: restored the random streams of {len(state['codecs'])} codecs",
                     "act plan: restored the checkpoint's plan in force (act config unchanged, plan "
                     "'compress', 0 adaptive changes so far)"]


def test_another_plan_replaces_the_checkpoints_and_says_so(caplog):
    _, saved = _trained(plan="compress")
    ctl = _fresh(plan="keep")
    notes = _load(ctl, saved.state_dict(), caplog)
    assert ctl.iteration == 2 and is_keep(ctl.plan)
    assert notes[-1] == ("act plan: plan: checkpoint 'compress', now 'keep' -> the plan of the current "
                         "flags; the checkpoint's plan and adaptive-planner state are not restored")


def test_another_budget_under_auto_is_named_and_the_planner_starts_over(caplog):
    _, saved = _trained(steps=0, plan="auto", budget=10**9)
    saved.adapter.next_track = 64  # as if it had tracked for a while
    ctl = _fresh(plan="auto", budget=2 * 10**9)
    notes = _load(ctl, saved.state_dict(), caplog)
    assert "budget: checkpoint 1000000000, now 2000000000 -> the plan of the current flags" in notes[-1]
    assert ctl.adapter.next_track == 1  # re-plans at once under the new budget


def test_another_seed_gives_fresh_codec_streams(caplog):
    _, saved = _trained(plan="compress", seed=7)
    ctl = _fresh(plan="compress", seed=8)
    notes = _load(ctl, saved.state_dict(), caplog)
    n = len(saved.state_dict()["codecs"])
    assert notes[1] == (f"act codecs: restored the random streams of 0 codecs; {n} replaced by fresh "
                        "streams (seeded for another seed or data-parallel rank than this run's seed 8)")
    assert _streams(ctl) == {}  # nothing drawn yet: every generator starts from seed 8
    assert notes[2].startswith("act plan: restored")  # the seed alone does not change the plan


def test_a_checkpoint_without_a_config_keeps_the_flags_plan(caplog):
    _, saved = _trained(plan="compress")
    saved.set_plan("keep")
    with saved.step():  # the user's plan is in force now
        pass
    state = saved.state_dict()
    del state["config"]  # as written before the config was saved
    assert is_keep(saved.plan)
    ctl = _fresh(plan="compress")
    notes = _load(ctl, state, caplog)
    assert ctl.plan == _fresh(plan="compress").plan and not is_keep(ctl.plan)
    assert notes[-1] == ("act plan: the checkpoint holds no act config (saved by an older llm_act), so its "
                         "plan may not match this run's flags -> the plan of the current flags ('compress')")
    assert ctl.iteration == 3
