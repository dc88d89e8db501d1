"""Turn an `ActConfig` (or a plan given later to the Controller) into a per-layer plan.

A plan is `{layer_index: {site: choice}}` over global 0-based layer indices, every site of
`llm_act.sites.SITES` present, each choice "keep", "recompute" or a codec name. It is the
one form the Controller applies to the modules, whatever the user wrote:

- "keep": every site kept (stock megatron-core);
- "compress": every *implemented* site at its default codec (`DEFAULT_CODECS`);
- "auto": starts as "compress"; the Controller's planner (`llm_act.adapt`) then replaces
  it at its tracking iterations with the MILP's plan for the measured profile, the
  `ActConfig.codecs` overrides staying pinned;
- "recompute": Megatron-style full block recompute (`recompute.full_plan()`): `ln1.input`
  kept, every other site recomputed in backward from it;
- a JSON plan path (or its dict) read by `llm_act.planner.load_plan_json`;
- then `ActConfig.codecs` (site -> choice) overrides on top, for every layer.

Every site of a GPT block (`llm_act.sites.SITES`) has a compressed layer that stores it.
Choices are validated by `llm_act.codecs.registry.check_choices`; which combinations of
"recompute" a layer can run is checked by `LayerRecompute.bind` when the plan is applied
(before anything changes).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from llm_act.codecs.registry import KEEP, MASK_CODECS, RECOMPUTE, check_choices
from llm_act.config import ActConfig
from llm_act.sites import DEFAULT_CODECS, SITES

#: the block's checkpoint: kept or encoded, never recomputed
CHECKPOINT_SITE = "ln1.input"

LayerPlan = dict[str, str]
Plan = dict[int, LayerPlan]
PlanLike = Union[str, os.PathLike, Mapping[Any, Any], Sequence[Mapping[str, str]]]


def keep_layer() -> LayerPlan:
    return {site: KEEP for site in SITES}


def recompute_layer() -> LayerPlan:
    """Megatron's full recompute of one block: the block input kept, the rest recomputed
    (the same choice as `llm_act.patches.megatron.recompute.full_plan()`)."""
    return {site: KEEP if site == CHECKPOINT_SITE else RECOMPUTE for site in SITES}


def is_keep(plan: Plan) -> bool:
    """Whether `plan` stores every value as stock megatron-core does: every site kept, or a
    dropout mask stored losslessly (`bitmask`, `regen`: same values, same RNG use). The
    attention stays stock under such a plan when `ActConfig.attention` is "auto"."""
    return all(name == KEEP or name in MASK_CODECS for choice in plan.values() for name in choice.values())


#: The "compress" choice at `mlp.act_input` where few-bit codecs do not apply (gated units
#: such as SwiGLU, squared ReLU: their backward needs x itself, not only f'(x)).
VALUE_ACT_CODEC = "outlier_int4"


def compress_layer(fewbit: bool = True) -> LayerPlan:
    """The "compress" choice of one layer: the default codec at every site (`fewbit=False`:
    a value codec at `mlp.act_input` instead of the few-bit default)."""
    choice = {site: DEFAULT_CODECS[site] for site in SITES}
    if not fewbit:
        choice["mlp.act_input"] = VALUE_ACT_CODEC
    return choice


def resolve(config: ActConfig, num_layers: int, layers: Optional[Iterable[int]] = None,
            no_fewbit: Iterable[int] = ()) -> Plan:
    """The plan `config` asks for, for `layers` (default: all of range(num_layers)).

    `num_layers` is the model's total layer count (a JSON plan must cover all of them, also
    on a pipeline stage that holds only some); `layers` are the global indices to return;
    `no_fewbit`: layers whose activation takes no few-bit codec (see `compress_layer`).
    """
    if not isinstance(config, ActConfig):
        raise TypeError(f"config: expected an llm_act.ActConfig, got {type(config).__name__}")
    plan = plan_from(config.plan, num_layers, layers, no_fewbit)
    if config.codecs:
        plan = with_overrides(plan, config.codecs)
    return plan


def plan_from(source: PlanLike, num_layers: int, layers: Optional[Iterable[int]] = None,
              no_fewbit: Iterable[int] = ()) -> Plan:
    """A plan from a mode name, a JSON plan (path or dict `{"version": 1, ...}`), a list of
    per-layer choice dicts, or a `{layer: {site: choice}}` mapping (missing sites kept).
    `no_fewbit` matters for "compress"/"auto" only; explicit choices are taken as given."""
    num_layers = _check_num_layers(num_layers)
    wanted = _layers(layers, num_layers)
    if isinstance(source, str) and source == "keep":
        return {i: keep_layer() for i in wanted}
    if isinstance(source, str) and source in ("compress", "auto"):  # "auto" until re-planned
        no_fewbit = set(no_fewbit)
        return {i: compress_layer(fewbit=i not in no_fewbit) for i in wanted}
    if isinstance(source, str) and source == RECOMPUTE:
        return {i: recompute_layer() for i in wanted}
    if isinstance(source, Mapping) and "blocks" in source or isinstance(source, (str, os.PathLike)):
        from llm_act.planner.milp import load_plan_json

        per_layer = load_plan_json(source, num_layers)
        return {i: _full(per_layer[i], f"plan layer {i}") for i in wanted}
    if isinstance(source, Mapping):
        given = {}
        for key, choice in source.items():
            if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < num_layers:
                raise ValueError(f"plan: layer {key!r} is not an index in [0, {num_layers})")
            if not isinstance(choice, Mapping):
                raise ValueError(f"plan layer {key}: expected a mapping site -> choice, got {choice!r}")
            given[key] = choice
        return {i: _full(given.get(i, {}), f"plan layer {i}") for i in wanted}
    if isinstance(source, Sequence):
        if len(source) != num_layers:
            raise ValueError(f"plan: expected one choice dict per layer ({num_layers}), got {len(source)}")
        return {i: _full(source[i], f"plan layer {i}") for i in wanted}
    raise TypeError(
        "plan: expected 'keep', 'compress', 'auto', a JSON plan path or dict, a list of "
        f"per-layer choices or a {{layer: {{site: choice}}}} mapping, got {type(source).__name__}"
    )


def with_overrides(plan: Plan, codecs: Mapping[str, str]) -> Plan:
    """`plan` with `codecs` (site -> choice) applied at every layer."""
    overrides = _full(codecs, "codecs", fill=False)
    return {i: {**choice, **overrides} for i, choice in plan.items()}


def _full(choice: Mapping[str, str], where: str, fill: bool = True) -> LayerPlan:
    """Validate a {site: choice} mapping; with `fill`, missing sites become "keep"."""
    check_choices(choice, where)
    out = keep_layer() if fill else {}
    out.update(choice)
    return out


def _check_num_layers(num_layers: int) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers: expected an int >= 1, got {num_layers!r}")
    return num_layers


def _layers(layers: Optional[Iterable[int]], num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    out = sorted(set(layers))
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers: {bad} are not layer indices in [0, {num_layers})")
    return out


def describe(plan: Plan) -> str:
    """A short human-readable summary: the distinct per-layer choices and their layers."""
    groups: list[tuple[LayerPlan, list[int]]] = []
    for i in sorted(plan):
        for choice, members in groups:
            if choice == plan[i]:
                members.append(i)
                break
        else:
            groups.append((plan[i], [i]))
    lines = []
    for choice, members in groups:
        stored = {s: c for s, c in choice.items() if c != KEEP} or {"*": KEEP}
        lines.append(f"layers {members}: " + ", ".join(f"{s}={c}" for s, c in stored.items()))
    return "\n".join(lines)
