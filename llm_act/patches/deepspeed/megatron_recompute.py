"""Megatron-core layers under DeepSpeed's `"activation_checkpointing"`.

Without that section a megatron-core model recomputes in llm_act's own regions
(`llm_act.patches.megatron.recompute.LayerRecompute`). With it, a layer whose choice is the
whole block -- every site but `ln1.input` recomputed, `ln1.input` kept (plan "recompute",
Megatron's "full") -- runs its `TransformerLayer.forward` under
`deepspeed.checkpointing.checkpoint` instead (the wrapper `recompute.checkpointed_forward`
the generic blocks use), so `partition_activations` and `cpu_checkpointing` apply to the
block inputs; the layer's own sites stay at "keep", so nothing is recomputed twice.
Megatron's RNG tracker (attention dropout) is not DeepSpeed's, so the wrapper replays it
with megatron's own helpers (`capture_rng` / `replay_rng`): a recomputed block draws the
dropout masks of its forward, and the run draws exactly what the stock run draws.

Other recompute choices cannot go through `deepspeed.checkpointing` (it re-runs whole blocks
from their kept input): per-site recompute (`"selective"`, single sites) and the whole block
from an encoded `ln1.input` (GACT's CB1). They stay on llm_act's regions while
`partition_activations` and `cpu_checkpointing` are off, and raise a ValueError naming the
option when one is on (the regions would silently ignore it). Masks chosen "recompute" are
regenerated from a generator state (nothing stored), so they are allowed either way.

The routing is per layer and per plan: `DeepSpeedLayerRecompute` takes the place of a
layer's `LayerRecompute` (a class swap, like the rest of the megatron patches), so plans the
Controller switches to later are routed the same way.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.config import ActConfig
from llm_act.patches.deepspeed import recompute as ds_recompute
from llm_act.patches.megatron import apply as megatron_apply
from llm_act.patches.megatron.apply import transformer_layers
from llm_act.patches.megatron.recompute import LayerRecompute, is_full
from llm_act.patches.megatron.rng_replay import capture_rng, replay_rng
from llm_act.plan import resolve
from llm_act.runtime.controller import Controller
from llm_act.sites import CHECKPOINT_SITE, MASK_SITES, SITES

#: where a layer's choice recomputes: nowhere, in DeepSpeed's checkpoint, in llm_act's regions
NONE, DEEPSPEED, REGIONS = "none", "deepspeed", "regions"


def route(choice: Mapping[str, str], checkpointing: Any, where: str = "layer") -> str:
    """NONE, DEEPSPEED or REGIONS for one layer's {site: choice} (see the module docstring);
    ValueError for a choice that only the regions can run while DeepSpeed is set to
    partition or offload checkpoints."""
    choice = {s: choice.get(s, KEEP) for s in SITES}
    recomputed = sorted(s for s, c in choice.items() if c == RECOMPUTE and s not in MASK_SITES)
    if not recomputed or checkpointing is None or not checkpointing.configured:
        return NONE if not recomputed else REGIONS
    if is_full(choice) and choice[CHECKPOINT_SITE] == KEEP:
        return DEEPSPEED
    if checkpointing.stores_checkpoints:
        options = [o for o in ("partition_activations", "cpu_checkpointing") if getattr(checkpointing, o)]
        what = (f"the whole block from {CHECKPOINT_SITE} = {choice[CHECKPOINT_SITE]!r}"
                if is_full(choice) else f"{recomputed} alone")
        raise ValueError(
            f"activation_checkpointing.{options[0]} = true: {where} recomputes {what}, which "
            "deepspeed.checkpointing cannot do (it re-runs whole blocks from their kept input). "
            "llm_act's own recompute regions could, but they would ignore "
            f"{' and '.join('activation_checkpointing.' + o for o in options)}. Use plan "
            f"\"recompute\" (the whole block, {CHECKPOINT_SITE} kept), keep or encode those "
            f"sites instead, or set {' and '.join(options)} to false"
        )
    return REGIONS


def _megatron_rng() -> tuple[Callable, Callable]:
    return capture_rng, replay_rng


class DeepSpeedLayerRecompute(LayerRecompute):
    """A layer's `LayerRecompute` whose whole-block recompute is DeepSpeed's checkpoint.

    Made from a layer's own `LayerRecompute` with `adopt` (a class swap: the modules keep
    pointing at the same owner). Every other choice binds as `LayerRecompute` binds it,
    after `route` has refused what cannot work, before anything changes.
    """

    checkpointing: Any = None
    ds_mpu: Any = None

    @classmethod
    def adopt(cls, owner: LayerRecompute, checkpointing: Any, mpu: Any = None) -> "DeepSpeedLayerRecompute":
        if not isinstance(owner, LayerRecompute):
            raise TypeError(f"owner: expected a LayerRecompute, got {type(owner).__name__}")
        owner.__class__ = cls
        owner.checkpointing, owner.ds_mpu = checkpointing, mpu
        return owner

    def bind(self, choice: Mapping[str, str], codecs: Mapping[str, Any]) -> None:
        if route(choice, self.checkpointing, f"layer {self.index}") == DEEPSPEED:
            ds_recompute.configure(self.checkpointing, self.ds_mpu)  # may refuse: nothing changed yet
        super().bind(choice, codecs)

    def _bind_full(self, choice: Mapping[str, str], codecs: Mapping[str, Any]) -> None:
        if choice[CHECKPOINT_SITE] != KEEP:  # CB1: only our region can encode the block input
            super()._bind_full(choice, codecs)
            return
        for site, module in self.sites.items():
            module.set_act_codec(site, None)  # the block re-runs stock, at full precision
        self._checkpoint_codec = None
        self.mode = "full"
        layer = self.layer
        stock = type(layer).forward.__get__(layer)  # recompute re-enters submodules via __call__
        layer.forward = ds_recompute.checkpointed_forward(stock, self.index, rng=_megatron_rng())
        self._handles.append(("forward", layer))

    @property
    def through_deepspeed(self) -> bool:
        """Whether the layer's forward runs under `deepspeed.checkpointing` now."""
        return ds_recompute.is_checkpointed(self.layer.__dict__.get("forward"))


def _default_mpu(mpu: Any) -> Any:
    """`mpu`, else megatron's parallel state when it is up (DeepSpeed partitions activations
    over its tensor-parallel group)."""
    if mpu is not None:
        return mpu
    from megatron.core import parallel_state

    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def apply(model: Any, config: ActConfig, checkpointing: Any = None, mpu: Any = None) -> Controller:
    """`llm_act.patches.megatron.apply(model, config)`, with whole-block recompute through
    `deepspeed.checkpointing` when `checkpointing` (`ds_config.Checkpointing`) is configured.

    The plan `config` asks for is routed first (`route`, and DeepSpeed's checkpointing is
    configured if a layer needs it), so what cannot work raises before the model changes.
    """
    if not config.enabled or checkpointing is None or not checkpointing.configured:
        return megatron_apply(model, config)
    mpu = _default_mpu(mpu)
    layers = transformer_layers(model)
    if layers:
        indices = sorted({int(layer.layer_number) - 1 for layer in layers})
        num_layers = max([max(indices) + 1] + [int(getattr(l.config, "num_layers", 0) or 0) for l in layers])
        plan = resolve(config, num_layers, indices)
        routes = {route(plan[i], checkpointing, f"layer {i}") for i in indices}
        if DEEPSPEED in routes:
            ds_recompute.check(checkpointing, KEEP, len(layers))
            ds_recompute.configure(checkpointing, mpu)
    controller = megatron_apply(model, config)
    for layer in transformer_layers(model):
        DeepSpeedLayerRecompute.adopt(layer.act_recompute, checkpointing, mpu)
    controller.reinstall()  # bind the plan again, now routed
    return controller


def owners(model: Any) -> list[Optional[LayerRecompute]]:
    """The `LayerRecompute` of every TransformerLayer of `model`, in module order."""
    return [getattr(layer, "act_recompute", None) for layer in transformer_layers(model)]
