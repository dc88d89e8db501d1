"""The `Controller`'s checkpoint: what `Controller.state_dict` saves, and how
`load_state_dict` restores it where it agrees with the run's settings now.

One job: a resumed run gets its iteration, plan (in force and pending), adaptive-planner state,
output loss and every codec's random stream back, or is told which of them the flags given now
replace, and why. Apart from the controller so that the rules of a resume (which settings win,
which streams are this run's) read in one place. The functions reach the controller only
through its public checkpoint surface (`Checkpointed`: `snapshot()`, `restore_codec`,
`restore_plans`); its `state_dict` and `load_state_dict` are thin methods over them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional, Protocol

from llm_act.config import ActConfig
from llm_act.plan import LayerPlans

log = logging.getLogger("llm_act.runtime.controller")  # the checkpoint speaks as its controller


@dataclasses.dataclass(frozen=True)
class ControllerSnapshot:
    """What a checkpoint keeps of a `Controller`, read through its public `snapshot()`."""

    iteration: int
    config: ActConfig
    plan: LayerPlans
    pending_plan: Optional[LayerPlans]
    adapt: Optional[dict[str, Any]]
    output_loss: Optional[str]
    pending_output_loss: Optional[str]
    #: {(layer, site, codec name): the codec's state_dict()}
    codecs: dict[tuple[int, str, str], dict[str, Any]]


class Checkpointed(Protocol):
    """The checkpoint surface of a `Controller` (`llm_act.runtime.controller`): all that
    `state_dict` and `load_state_dict` here use of it."""

    iteration: int
    config: ActConfig
    adapter: Any

    @property
    def enabled(self) -> bool: ...

    @property
    def in_step(self) -> bool: ...

    def snapshot(self) -> ControllerSnapshot: ...

    def restore_codec(self, layer: int, site: str, name: str, state: Mapping[str, Any]) -> Optional[bool]: ...

    def restore_plans(self, plan: Mapping[int, Mapping[str, str]], pending: Optional[Mapping[int, Mapping[str, str]]],
                      output_loss: Optional[str], pending_output_loss: Optional[str]) -> None: ...


def state_dict(controller: Checkpointed) -> dict[str, Any]:
    """`Controller.state_dict()` of `controller` (see there)."""
    snap = controller.snapshot()
    return {
        "version": 1,
        "iteration": snap.iteration,
        "config": snap.config.to_dict(),
        "plan": _plan_to_state(snap.plan),
        "pending": None if snap.pending_plan is None else _plan_to_state(snap.pending_plan),
        "adapt": snap.adapt,
        "output_loss": snap.output_loss,
        "pending_output_loss": snap.pending_output_loss,
        "codecs": {f"{layer}/{site}/{name}": state for (layer, site, name), state in snap.codecs.items()},
    }


def load_state_dict(controller: Checkpointed, state: Mapping[str, Any]) -> list[str]:
    """`Controller.load_state_dict(state)` of `controller` (see there)."""
    if controller.in_step:
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


def _load_codecs(controller: Checkpointed, saved: Mapping[str, Any]) -> str:
    """Restore the saved codec generators whose seed is this run's (see load_state_dict)."""
    restored, foreign = 0, 0
    for key, codec_state in saved.items():
        layer, site, name = key.split("/")
        done = controller.restore_codec(int(layer), site, name, codec_state)
        if done is None:
            continue  # another pipeline stage's layer
        if done:
            restored += 1
        else:
            foreign += 1
    note = f"act codecs: restored the random streams of {restored} codecs"
    if foreign:
        note += (f"; {foreign} replaced by fresh streams (seeded for another seed or data-parallel "
                 f"rank than this run's seed {controller.config.seed})")
    return note


def _load_plan(controller: Checkpointed, state: Mapping[str, Any]) -> str:
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
    pending = state.get("pending")
    controller.restore_plans(_plan_from_state(state["plan"]), None if pending is None else _plan_from_state(pending),
                             state.get("output_loss"), state.get("pending_output_loss"))
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
