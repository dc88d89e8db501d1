"""Turn an `ActConfig` (or a plan given later to the Controller) into a per-layer plan.

A plan is `{layer_index: {site: choice}}` over global 0-based layer indices, every site of
`llm_act.sites.SITES` present, each choice "keep", "recompute" or a codec name. It is the
one form the Controller applies to the modules, whatever the user wrote:

- "keep": every site kept (stock megatron-core);
- "compress": every *implemented* site at its default codec (`DEFAULT_CODECS`);
- "auto": starts as "compress"; the Controller's planner (`llm_act.runtime.adapt`) then replaces
  it at its tracking iterations with the MILP's plan for the measured profile, the
  `ActConfig.codecs` overrides staying pinned;
- "recompute": Megatron-style full block recompute (`recompute_layer()`): `ln1.input`
  kept, every other site of the block recomputed in backward from it;
- "selective": Megatron's selective recompute (`selective_layer()`): the core attention
  (`attn.softmax`, `attn.dropout_mask`) re-run in backward from its kept q, k, v;
- a JSON plan path (or its dict) read by `load_plan_json`;
- then `ActConfig.codecs` (site -> choice) overrides on top, for every layer.

Every site of a GPT block (`llm_act.sites.SITES`) has a compressed layer that stores it.
The sites after the blocks (`MODEL_SITES`: the final norm's input) are carried by the plan
of the model's last layer (the layer whose output they hold; other layers' entries for them
bind nothing): "keep" keeps and "compress" encodes them, the recompute plans keep them (the
block's recompute never covers them) and the planner prices them as a block of their own
(`Plan.layer_plans` puts its choice back into the last layer's).
Choices are validated by `llm_act.codecs.registry.check_choices`; which combinations of
"recompute" a layer can run is checked by `LayerRecompute.bind` when the plan is applied
(before anything changes).

One plan type: `LayerPlans`, {layer: {site: choice}}, with one JSON form (`plan_json`,
read back by `load_plan_json`). Whatever a user writes (`PlanLike`) becomes it through
`plan_from`; the planner's answer for one device (`Plan`, what `solve_plan` returns: choices
per class of identical blocks, with its costs) gives it through `Plan.layer_plans`. One home
for "plan", below both the planner and the runtime.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

from llm_act.codecs.registry import KEEP, MASK_CODECS, RECOMPUTE, check_choice, check_choices
from llm_act.config import ActConfig
from llm_act.sites import (
    ATTENTION_INTERNAL_SITES,
    CHECKPOINT_SITE,
    DEFAULT_CODECS,
    MLP_ACT_INPUT,
    MODEL_SITES,
    SITES,
)

if TYPE_CHECKING:
    from llm_act.planner.profile import BlockProfile

LayerPlan = dict[str, str]
LayerPlans = dict[int, LayerPlan]
PlanLike = Union[str, os.PathLike, Mapping[Any, Any], Sequence[Mapping[str, str]]]


def keep_layer() -> LayerPlan:
    return {site: KEEP for site in SITES}


def recompute_layer(checkpoint: str = KEEP) -> LayerPlan:
    """Megatron's "full" recompute of one block: every site recomputed from `ln1.input`, which
    is kept (`checkpoint="keep"`) or stored with the codec `checkpoint` (GACT's CB1); the sites
    after the blocks (`MODEL_SITES`) kept."""
    check_choice(CHECKPOINT_SITE, checkpoint)
    return {site: checkpoint if site == CHECKPOINT_SITE else KEEP if site in MODEL_SITES else RECOMPUTE
            for site in SITES}


def selective_layer() -> LayerPlan:
    """Megatron's "selective" recompute: the core attention re-run from its kept q, k, v."""
    return {site: RECOMPUTE if site in ATTENTION_INTERNAL_SITES else KEEP for site in SITES}


def is_keep(plan: LayerPlans) -> bool:
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
        choice[MLP_ACT_INPUT] = VALUE_ACT_CODEC
    return choice


def resolve(config: ActConfig, num_layers: int, layers: Optional[Iterable[int]] = None,
            no_fewbit: Iterable[int] = ()) -> LayerPlans:
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
              no_fewbit: Iterable[int] = ()) -> LayerPlans:
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
    if isinstance(source, str) and source == "selective":
        return {i: selective_layer() for i in wanted}
    if isinstance(source, Mapping) and "blocks" in source or isinstance(source, (str, os.PathLike)):
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


def with_overrides(plan: LayerPlans, codecs: Mapping[str, str]) -> LayerPlans:
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


def describe(plan: LayerPlans) -> str:
    """A short human-readable summary: the distinct per-layer choices (what is not kept) and
    their layers."""
    groups: list[tuple[LayerPlan, list[int]]] = []
    for i in sorted(plan):
        stored = {s: c for s, c in plan[i].items() if c != KEEP}
        for choice, members in groups:
            if choice == stored:
                members.append(i)
                break
        else:
            groups.append((stored, [i]))
    lines = []
    for stored, members in groups:
        lines.append(f"layers {members}: " + ", ".join(f"{s}={c}" for s, c in (stored or {"*": KEEP}).items()))
    return "\n".join(lines)


@dataclass
class Plan:
    """The planner's answer for one device. `choice[i][site]` is "keep", "recompute" or a
    codec name, indexed like the `blocks` given to `solve_plan`: the choice of block i's
    layers that are planned per site, or `recompute_layer(...)` when all its layers are
    recomputed whole. `full[i]`: {checkpoint choice: layers} of block i recomputed whole
    from their input, kept ("keep") or encoded (a codec): identical layers may differ."""

    blocks: tuple[BlockProfile, ...]
    choice: list[dict[str, str]]
    activation_bytes: int
    """sum over blocks of count * inflight * stored bytes, plus `peak_bytes`."""
    overhead_ms: float
    """added time per iteration: sum over blocks of count * per-block time."""
    solve_seconds: float = 0.0
    variance: float = 0.0
    """summed noise: sum over blocks of count * sensitivity * S(option)."""
    peak_bytes: int = 0
    """the transient: the largest block's decoded and recomputed tensors."""
    num_variables: int = 0
    objective: str = "time"
    optimal: bool = True
    """False when the solver stopped at `time_limit` with a feasible plan not proven optimal."""
    full: list[dict[str, int]] = field(default_factory=list)
    bound_ms: Optional[float] = None
    """a lower bound on `overhead_ms` the MILP solver proved (full search, time objective;
    None when it reports none): how far from optimal a plan stopped at the time limit can be"""

    def layer_choices(self, i: int) -> list[dict[str, str]]:
        """The choice of each of block i's `count` layers: those recomputed whole first."""
        count = self.blocks[i].count
        full = self.full[i] if i < len(self.full) else {}
        out = [whole_layer(self.blocks[i], ckpt) for ckpt, n in sorted(full.items()) for _ in range(n)]
        return out + [dict(self.choice[i]) for _ in range(count - len(out))]

    def layer_plans(self, first_layer: int = 0) -> LayerPlans:
        """The plan in the one form the runtime applies: block i covers the next
        `blocks[i].count` layers from `first_layer`; a block of the sites after the blocks
        (`is_outer`) adds its choice to the last layer's."""
        out: LayerPlans = {}
        for i, block in enumerate(self.blocks):
            if is_outer(block) and out:
                out[max(out)].update(self.choice[i])
                continue
            for choice in self.layer_choices(i):
                out[first_layer + len(out)] = choice
        return out

    def to_dict(self, first_layer: int = 0) -> dict[str, Any]:
        """The JSON plan (`plan_json`) of `layer_plans(first_layer)`."""
        return plan_json(self.layer_plans(first_layer))

    def to_json(self, first_layer: int = 0, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(first_layer), indent=indent)


def plan_json(plan: LayerPlans) -> dict[str, Any]:
    """The JSON form of a plan, `{"version": 1, "blocks": [{"layers": [first, last],
    "choice": {site: choice}}]}` (layers inclusive, contiguous layers with equal choices
    merged): what `load_plan_json` reads back, `llm-act plan --json` prints and a controller's
    checkpoint state holds."""
    runs: list[dict[str, Any]] = []
    for layer in sorted(plan):
        choice = plan[layer]
        if runs and runs[-1]["choice"] == choice and runs[-1]["layers"][1] == layer - 1:
            runs[-1]["layers"][1] = layer
        else:
            runs.append({"layers": [layer, layer], "choice": dict(choice)})
    return {"version": 1, "blocks": runs}


def whole_layer(block: "BlockProfile", checkpoint: str = KEEP) -> LayerPlan:
    """`recompute_layer(checkpoint)` over the sites of `block` as well (a profile may name
    sites beyond `SITES`)."""
    return {**recompute_layer(checkpoint), **{s.name: RECOMPUTE for s in block.sites
                                              if s.name != CHECKPOINT_SITE and s.name not in MODEL_SITES}}


def is_whole(choice: Mapping[str, str], block: "BlockProfile") -> bool:
    """Whether `choice` recomputes all of `block` from its checkpoint (every other site
    named "recompute", and the block has the checkpoint); the sites after the blocks
    (`MODEL_SITES`) are no part of it."""
    return recomputes_whole(choice, {s.name for s in block.sites})


def recomputes_whole(choice: Mapping[str, str], names: Iterable[str]) -> bool:
    """`is_whole` for a block given by its site names."""
    names = set(names)
    return CHECKPOINT_SITE in names and all(
        c == RECOMPUTE for s, c in choice.items() if s != CHECKPOINT_SITE and s not in MODEL_SITES) and all(
        choice.get(s, KEEP) == RECOMPUTE for s in names if s != CHECKPOINT_SITE)


def is_outer(block: "BlockProfile") -> bool:
    """Whether `block` holds only sites after the blocks (`MODEL_SITES`: the final norm's
    input): the planner prices them as a block of their own, once, after the last layer."""
    return bool(block.sites) and all(s.name in MODEL_SITES for s in block.sites)


def load_plan_json(source: Union[str, os.PathLike, dict], num_layers: int) -> LayerPlans:
    """Read and validate a JSON plan (`plan_json`'s form) from a path or its dict; returns
    {layer: choices}. Every layer in [0, num_layers) must be covered exactly once; sites a
    block does not name are kept."""
    _check_num_layers(num_layers)
    data = _read(source)
    if not isinstance(data, dict):
        raise ValueError(f"plan: expected a JSON object, got {type(data).__name__}")
    extra = set(data) - {"version", "blocks"}
    if extra:
        raise ValueError(f"plan: unknown keys {sorted(extra)}; expected 'version' and 'blocks'")
    if data.get("version") != 1:
        raise ValueError(f"plan version: expected 1, got {data.get('version')!r}")
    runs = data.get("blocks")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"plan blocks: expected a non-empty list, got {runs!r}")
    layers: list[Optional[dict[str, str]]] = [None] * num_layers
    owner: list[Optional[int]] = [None] * num_layers
    for n, run in enumerate(runs):
        where = f"plan blocks[{n}]"
        if not isinstance(run, dict) or set(run) != {"layers", "choice"}:
            raise ValueError(f"{where}: expected an object with keys 'layers' and 'choice', got {run!r}")
        span, choice = run["layers"], run["choice"]
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)
                or not 0 <= span[0] <= span[1] < num_layers):
            raise ValueError(
                f"{where} layers: expected [first, last] with 0 <= first <= last < {num_layers}, got {span!r}"
            )
        check_choices(choice, f"{where} choice")
        for layer in range(span[0], span[1] + 1):
            if owner[layer] is not None:
                raise ValueError(
                    f"{where} layers {span}: layer {layer} is already planned by blocks[{owner[layer]}]"
                )
            owner[layer], layers[layer] = n, dict(choice)
    missing = [i for i, c in enumerate(layers) if c is None]
    if missing:
        raise ValueError(f"plan blocks: layers {spans(missing)} of {num_layers} have no plan")
    return dict(enumerate(layers))  # type: ignore[arg-type]


def _read(source) -> Any:
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"plan: expected a dict or a path to a JSON file, got {source!r}")
    try:
        with open(source, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise ValueError(f"plan: cannot read {os.fspath(source)!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"plan: {os.fspath(source)!r} is not valid JSON: {err}") from None


def spans(numbers: list[int]) -> str:
    """[0, 2, 3, 4] -> '0, 2-4': layers of a plan, ranks of a group."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
