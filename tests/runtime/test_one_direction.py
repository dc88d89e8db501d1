"""From `apply()` down to `make_codec`, and from a layer's forward down to `Codec.encode`,
each of our modules is entered once, in one direction (docs/architecture.md, "Hop count").

The check reads the call stack at the moment a codec is made or encodes: our modules on it,
outermost first, with consecutive frames of one module counted once. A module that shows up
twice was left and entered again on the way down (a callback into the controller from a
layer, say).
"""
from __future__ import annotations

import inspect

import pytest

import llm_act.codecs.registry as registry
import llm_act.runtime.controller as controller_module
from llm_act import ActConfig
from llm_act.codecs.base import Codec
from llm_act.patches.megatron import apply
from llm_act.sites import ATTN_QKV_INPUT, CHECKPOINT_SITE, MLP_ACT_INPUT, MLP_FC1_INPUT
from tests import gpt_runs as R

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def our_modules() -> tuple[str, ...]:
    """Our modules on the caller's stack, outermost first, consecutive repeats merged."""
    names = [frame.frame.f_globals.get("__name__", "") for frame in inspect.stack()[2:]]
    out: list[str] = []
    for name in reversed(names):
        if name.startswith("llm_act") and (not out or out[-1] != name):
            out.append(name)
    return tuple(out)


@pytest.fixture
def recorded(monkeypatch):
    """Paths seen at make_codec ("make") and at Codec.encode ("encode")."""
    paths: dict[str, set] = {"make": set(), "encode": set()}
    make, encode = registry.make_codec, Codec.encode

    def make_spy(*args, **kwargs):
        paths["make"].add(our_modules())
        return make(*args, **kwargs)

    def encode_spy(self, *args, **kwargs):
        paths["encode"].add(our_modules())
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(registry, "make_codec", make_spy)
    if getattr(controller_module, "make_codec", None) is make:
        monkeypatch.setattr(controller_module, "make_codec", make_spy)
    monkeypatch.setattr(Codec, "encode", encode_spy)
    return paths


def assert_one_way(paths: set) -> None:
    assert paths, "no call was recorded"
    for path in paths:
        again = sorted({m for m in path if path.count(m) > 1})
        assert not again, f"entered again on the way down: {again} in {' -> '.join(path)}"


@pytest.mark.parametrize("plan", ["compress", "mixed"])
def test_config_and_forward_reach_the_codec_one_way(recorded, plan):
    model = R.build(dropout=0.1, num_layers=2)
    if plan == "compress":
        ctl = apply(model, ActConfig(plan="compress"))
    else:  # codecs beside per-site and whole-block recomputation
        ctl = apply(model, ActConfig(plan="keep"))
        ctl.set_plan({0: {CHECKPOINT_SITE: "int8", ATTN_QKV_INPUT: "recompute", MLP_FC1_INPUT: "recompute",
                          MLP_ACT_INPUT: "fewbit2"},
                      1: {CHECKPOINT_SITE: "int8", MLP_ACT_INPUT: "int4"}})
    R.step(model)
    assert_one_way(recorded["make"])
    assert_one_way(recorded["encode"])
    if plan == "compress":  # the setup path: apply -> controller -> registry, nothing between
        assert any(p[:1] == ("llm_act.patches.megatron.apply",) for p in recorded["make"])
    assert all(p[-1] != "llm_act.runtime.controller" for p in recorded["encode"]), \
        "a layer's forward calls back into the controller"


def test_the_check_sees_a_callback(recorded):
    """The check fails a path that leaves a module and comes back to it."""
    with pytest.raises(AssertionError, match="entered again"):
        assert_one_way({("llm_act.runtime.controller", "llm_act.patches.megatron.recompute",
                         "llm_act.runtime.controller", "llm_act.codecs.registry")})
