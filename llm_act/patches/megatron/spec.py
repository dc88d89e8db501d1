"""`layer_spec(config)`: megatron-core's local GPT layer spec with llm_act's classes in the slots.

A model built from it is what `apply` makes of a model built from the local spec: the
same parameters (same initialisation, same state_dict keys), the compressed classes in
place, every site "keep" until `apply(model, config)` binds the layers to a Controller.
It is also the way to build a *sequence-parallel* model on CPU: megatron's own norm
without apex (`WrappedTorchNorm`) refuses sequence parallelism, ours does not. The
block's final norm is not part of a layer spec; `block_spec(...)` returns the whole block
(layers + our final norm), which `GPTModel(transformer_layer_spec=...)` also accepts.

Megatron-core is imported only when a spec is requested. The `mlp` and MoE `experts` slots are
`ModuleSpec`s up to megatron-core 0.16 and builders (`functools.partial`) from 0.17 on (0.17.1
mixes both); `compat` reads and copies either form.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Optional, Union

from llm_act._imports import require
from llm_act.config import ActConfig
from llm_act.cpu import required as cpu_required
from llm_act.patches.megatron import compat, unsupported
from llm_act.patches.megatron.apply import as_config
from llm_act.patches.megatron.attention import ActCoreAttention
from llm_act.patches.megatron.dropout import ActBiasDropoutAdd
from llm_act.patches.megatron.linear import LINEAR_HOLDERS
from llm_act.patches.megatron.moe import ActSequentialMLP, ActTopKRouter
from llm_act.patches.megatron.norm import act_norm
from llm_act.sites import BLOCK, Site


class ActNorm:
    """Spec slot for a norm: builds `ActLayerNorm` or `ActRMSNorm` after
    `config.normalization` (megatron's norm builder signature). A class, because
    `build_module` would return a plain function uncalled."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        return act_norm(config, hidden_size, eps, **kwargs)


_REJECTED_KWARGS = {
    "multi_latent_attention": "multi-latent attention (MLA) is not supported by llm_act yet",
    "use_kitchen": "NVIDIA Kitchen quantized modules are not supported by llm_act yet",
}


def layer_spec(
    config: Union[ActConfig, dict, None] = None,
    transformer_config: Any = None,
    **local_spec_kwargs: Any,
):
    """The `ModuleSpec` of a GPT TransformerLayer equivalent to `apply` on
    `get_gpt_layer_local_spec(**local_spec_kwargs)` (e.g. `normalization="RMSNorm"`,
    `qk_layernorm=True`). `config`: the ActConfig (checked for unsupported combinations
    with `transformer_config` when given); with `config.enabled` False the stock local spec
    is returned. Build the model, then `controller = apply(model, config)`. Never patches
    megatron-core: on a host without CUDA, settings of `transformer_config` that need the CPU
    stand-ins raise, naming `llm_act.cpu.install()` (`cpu_required.check_config`).
    """
    require("megatron.core", "llm_act.patches.megatron.layer_spec")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    config = as_config(config)
    for key, why in _REJECTED_KWARGS.items():
        if local_spec_kwargs.get(key):
            raise NotImplementedError(f"layer_spec({key}={local_spec_kwargs[key]!r}): {why}")
    if local_spec_kwargs.get("num_experts") and local_spec_kwargs.get("moe_grouped_gemm"):
        unsupported.check_moe(types.SimpleNamespace(moe_grouped_gemm=True))
    unsupported.check_transformer_config(transformer_config, config)
    stock = get_gpt_layer_local_spec(**local_spec_kwargs)
    if not config.enabled:
        return stock
    cpu_required.check_config(transformer_config, "layer_spec")

    layer = stock.submodules
    mlp = layer.mlp
    # a ModuleSpec up to megatron-core 0.16, a builder (functools.partial) from 0.17 on
    mlp_class = compat.spec_class(mlp)
    mlp_name = getattr(mlp_class, "__name__", repr(mlp))
    if mlp_name not in ("MLP", "MoELayer"):
        raise NotImplementedError(
            f"layer_spec: the local spec's MLP is {mlp_name}; llm_act supports the dense "
            "MLP and the MoELayer")
    moe = mlp_name == "MoELayer"
    # the schema's sites (`slot`, `holder`) say which slot gets which class; the core
    # attention converts as a whole (its sites lie inside it)
    slots: dict[str, Any] = {"self_attention.core_attention": ActCoreAttention}
    holder_classes = {"norm": ActNorm, **{holder: ours for holder, (ours, _) in LINEAR_HOLDERS.items()}}
    for site in BLOCK:
        if site.scope != "layer" or ("dense" if moe else "moe") in site.needs:
            continue  # a slot of the block (the final norm: `block_spec`), or the other MLP family's site
        if site.holder == "bda":
            slots[site.slot] = ModuleSpec(
                module=ActBiasDropoutAdd, params={"stock": _stock_at(layer, site.slot), "site": site.name})
        elif site.holder in holder_classes and _ours(layer, site):
            slots[site.slot] = ModuleSpec(module=holder_classes[site.holder], params={"act_site": site.name})
    if moe:
        # no shared experts (refused by unsupported.check_moe); the experts' linears stay
        # megatron's: ActSequentialMLP stores their inputs itself
        slots["mlp.router"] = ActTopKRouter
        slots["mlp.experts"] = compat.with_class(compat.spec_submodules(mlp).experts, ActSequentialMLP)
    # the MLP class itself stays megatron's on every version: TransformerLayer passes the TP
    # group only to a `ModuleSpec` of `MLP` exactly (0.16), or rewraps only that one into
    # `MLP.as_mlp_submodule` (0.17+; a ModuleSpec(ActMLP) would be called with
    # `pg_collection=`, which MLP does not take); `apply` swaps it to ActMLP in place (its
    # site is bound there)
    return dataclasses.replace(stock, submodules=_with_slots(layer, slots))


def _stock_at(submodules: Any, slot: str) -> Any:
    """What a layer spec's submodules hold at the dotted `slot` path (None where a step is
    missing); a step may be a `ModuleSpec` or a builder (`compat.spec_submodules`)."""
    *parents, name = slot.split(".")
    for parent in parents:
        step = getattr(submodules, parent, None)
        submodules = None if step is None else compat.spec_submodules(step)
    return getattr(submodules, name, None)


def _ours(layer: Any, site: Site) -> bool:
    """Whether `layer_spec` puts our class in the site's slot: always for a linear; for a
    norm only where the stock spec has the layer's own norm class (ln1's), not an identity
    (a block without qk-layernorm) or megatron's L2Norm (`qk_l2_norm`)."""
    return site.holder != "norm" or _stock_at(layer, site.slot) is layer.input_layernorm


def _with_slots(submodules: Any, slots: dict[str, Any]) -> Any:
    """A copy of a spec's `submodules` with each dotted slot path in `slots` replaced (the
    specs or builders on the way copied too: the stock spec is left as it was)."""
    here: dict[str, Any] = {}
    below: dict[str, dict[str, Any]] = {}
    for slot, value in slots.items():
        parent, dot, rest = slot.partition(".")
        if dot:
            below.setdefault(parent, {})[rest] = value
        else:
            here[slot] = value
    for parent, inner in below.items():
        spec = getattr(submodules, parent)
        here[parent] = compat.with_submodules(spec, _with_slots(compat.spec_submodules(spec), inner))
    return dataclasses.replace(submodules, **here)


def block_spec(
    config: Union[ActConfig, dict, None] = None,
    transformer_config: Any = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    **local_spec_kwargs: Any,
):
    """A `ModuleSpec` of the whole TransformerBlock: this rank's layers from `layer_spec`
    and the final norm built by `ActNorm` for the site after the blocks it stores (kept,
    i.e. stock, until `apply` binds it; it accepts sequence parallelism). Needs megatron's
    parallel state (it counts this stage's layers)."""
    require("megatron.core", "llm_act.patches.megatron.block_spec")
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if transformer_config is None:
        raise ValueError("transformer_config: block_spec needs the model's TransformerConfig, got None")
    layer = layer_spec(config, transformer_config, **local_spec_kwargs)
    if not as_config(config).enabled:
        from megatron.core.transformer.transformer_block import LayerNormImpl

        norm: Any = LayerNormImpl
    else:
        final = next(site for site in BLOCK if site.scope == "model" and site.holder == "norm")
        norm = ModuleSpec(module=ActNorm, params={"act_site": final.name})
    count = get_num_layers_to_build(transformer_config, vp_stage=vp_stage, pp_rank=pp_rank)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=norm),
    )

