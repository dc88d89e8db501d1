"""The `Controller`'s checkpoint: what `Controller.state_dict` saves, and how
`load_state_dict` restores it where it agrees with the run's settings now.

One job: a resumed run gets its iteration, plan (in force and pending), adaptive-planner state,
output loss and every codec's random stream back, or is told which of them the flags given now
replace, and why. Apart from the controller so that the rules of a resume (which settings win,
which streams are this run's) read in one place. The functions take the `Controller` and read
and set its state; its `state_dict` and `load_state_dict` are thin methods over them.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

from llm_act.config import ActConfig
from llm_act.plan import LayerPlans, plan_from

if TYPE_CHECKING:
    from llm_act.runtime.controller import Controller  # whose state this is

log = logging.getLogger("llm_act.runtime.controller")  # the checkpoint speaks as its controller


def state_dict(controller: "Controller") -> dict[str, Any]:
    """`Controller.state_dict()` of `controller` (see there)."""
    return {
        "version": 1,
        "iteration": controller.iteration,
        "config": controller.config.to_dict(),
        "plan": _plan_to_state(controller._plan),
        "pending": None if controller._pending is None else _plan_to_state(controller._pending),
        "adapt": controller.adapter.state_dict(),
        "output_loss": controller.output_loss,
        "pending_output_loss": controller._pending_output,
        "codecs": {
            f"{layer}/{site}/{name}": codec.state_dict()
            for (layer, site, name), codec in controller._codecs.items()
        },
    }


def load_state_dict(controller: "Controller", state: Mapping[str, Any]) -> list[str]:
    """`Controller.load_state_dict(state)` of `controller` (see there)."""
    if controller._in_step:
        raise RuntimeError("load_state_dict: not allowed inside controller.step()")
    if not isinstance(state, Mapping) or state.get("version") != 1:
        raise ValueError("state: expected a Controller.state_dict() (version 1)")
    controller.iteration = int(state["iteration"])
    notes = [f"act controller: restored iteration {controller.iteration}"]
    if controller.enabled:
        notes.append(_load_codecs(controller, state.get("codecs", {})))
        notes.append(_load_plan(controller, state))
    for note in notes:
        log.info(note)
    return notes


def _load_codecs(controller: "Controller", saved: Mapping[str, Any]) -> str:
    """Restore the saved codec generators whose seed is this run's (see load_state_dict)."""
    restored, foreign = 0, 0
    for key, codec_state in saved.items():
        layer, site, name = key.split("/")
        if site not in controller._modules.get(int(layer), {}):
            continue  # another pipeline stage's layer
        if codec_state.get("seed") != controller._codec_seed(int(layer), site):
            foreign += 1
            continue
        controller._get_codec(int(layer), site, name).load_state_dict(codec_state)
        restored += 1
    note = f"act codecs: restored the random streams of {restored} codecs"
    if foreign:
        note += (f"; {foreign} replaced by fresh streams (seeded for another seed or data-parallel "
                 f"rank than this run's seed {controller.config.seed})")
    return note


def _load_plan(controller: "Controller", state: Mapping[str, Any]) -> str:
    """Restore the saved plans and planner state if the config is unchanged (see
    load_state_dict); the line saying which plan is in force."""
    saved = state.get("config")
    if saved is None:
        return (f"act plan: the checkpoint holds no act config (saved by an older llm_act), so "
                f"its plan may not match this run's flags -> the plan of the current flags "
                f"({controller.config.plan!r})")
    changes = _config_changes(saved, controller.config.to_dict())
    if changes:
        return (f"act plan: {'; '.join(changes)} -> the plan of the current flags; the "
                "checkpoint's plan and adaptive-planner state are not restored")
    if state.get("adapt") is not None:
        controller.adapter.load_state_dict(state["adapt"])
    controller._apply(plan_from(_plan_from_state(state["plan"]), controller.num_layers, controller._modules))
    pending = state.get("pending")
    controller._pending = (
        None if pending is None
        else plan_from(_plan_from_state(pending), controller.num_layers, controller._modules)
    )
    if controller.output is not None and state.get("output_loss") in ("stock", "chunked"):
        controller.output.set(state["output_loss"])
        controller._pending_output = state.get("pending_output_loss")
    return (f"act plan: restored the checkpoint's plan in force (act config unchanged, plan "
            f"{controller.config.plan!r}, {len(controller.adapter.history)} adaptive changes so far)")


def _config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """"field: checkpoint X, now Y" for every ActConfig field but `seed` (the codecs'
    business) that differs between a saved config dict and the current one. A field the
    checkpoint predates counts as its default (a field added later changes no old run)."""
    defaults = ActConfig().to_dict()
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    return [f"{key}: checkpoint {saved.get(key)!r}, now {now.get(key)!r}"
            for key in sorted(set(saved) | set(now))
            if key != "seed" and saved.get(key) != now.get(key)]


def _plan_to_state(plan: LayerPlans) -> dict[str, dict[str, str]]:
    return {str(i): dict(c) for i, c in plan.items()}


def _plan_from_state(plan: Mapping[str, Mapping[str, str]]) -> dict[int, dict[str, str]]:
    return {int(i): dict(c) for i, c in plan.items()}
