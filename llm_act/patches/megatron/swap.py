"""`convert_layer`: turn a stock megatron-core TransformerLayer's modules into Act ones.

The registry `apply` uses: each stored site of a block -> the module that stores it,
converted in place (class swap, parameters untouched), so state_dict keys do not change.
Which module that is comes from the block schema (`llm_act.sites.BLOCK`: a site's `slot`
and `holder`), so a new site of an existing holder kind needs no change here.
Attention internals (q/k/v, softmax, attention dropout) stay stock unless
`convert_layer(..., attention=True)` / `convert_attention` converts the core attention.
The sites after the blocks (`Site.scope` "model": the final norm's input) are slots of the
TransformerBlock, converted by `convert_outer`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llm_act._imports import require
from llm_act.patches.megatron.act_module import ActModule
from llm_act.patches.megatron.dropout import ActBiasDropoutAdd
from llm_act.patches.megatron.linear import LINEAR_HOLDERS
from llm_act.patches.megatron.mlp import ActMLP
from llm_act.patches.megatron.norm import ActLayerNorm, ActRMSNorm
from llm_act.patches.megatron.recompute import LayerRecompute

require("megatron.core", "llm_act.patches.megatron.swap")
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp  # noqa: E402
from megatron.core.transformer.mlp import MLP  # noqa: E402
from llm_act.sites import ATTN_OUT, ATTN_Q, BLOCK, Site  # noqa: E402

#: the schema's sites held in a TransformerLayer (the others are slots of the TransformerBlock)
_LAYER_BLOCK = tuple(site for site in BLOCK if site.scope == "layer")
from llm_act.patches.megatron.moe import convert_moe, is_moe
from llm_act.patches.megatron.attention import ATTENTION_SITES, ActCoreAttention

#: the holder kinds converted one slot at a time (the MLP, the MoE layer and the core
#: attention convert as a whole; the bias-dropout-adds are replaced, not converted)
_MODULE_HOLDERS = ("norm", *LINEAR_HOLDERS)
#: Within one module's tensor-parallel region the column-parallel linear runs first (it
#: opens the region), the row-parallel one last (it closes it), what lies between (the
#: qk-norms) in between: the order `convert_layer` returns the sites in (`_forward_order`).
_REGION_RANK = {"column": 0, "norm": 1, "row": 2}


def _norm(module: torch.nn.Module, site: str):
    if isinstance(module, (ActLayerNorm, ActRMSNorm)):
        module._act_init(site=site)
        return module
    if type(module) is torch.nn.LayerNorm:
        return ActLayerNorm.from_stock(module, site=site)
    if type(module) is torch.nn.RMSNorm:
        return ActRMSNorm.from_stock(module, site=site)
    raise TypeError(
        f"{site}: cannot compress a {type(module).__module__}.{type(module).__name__}; "
        "llm_act converts torch.nn.LayerNorm / torch.nn.RMSNorm (megatron's WrappedTorchNorm)")


def _linear(module: torch.nn.Module, site: str, holder: str):
    cls, stock = LINEAR_HOLDERS[holder]
    if isinstance(module, cls):
        module._act_init(site=site)
        return module
    if type(module) is not stock:
        raise TypeError(
            f"{site}: cannot compress a {type(module).__module__}.{type(module).__name__}; "
            f"llm_act converts megatron-core's {stock.__name__} (local spec)")
    return cls.from_stock(module, site=site)


def _is_identity(module) -> bool:
    return module is None or isinstance(module, (IdentityOp, IdentityFuncOp))


def _is_l2_norm(module) -> bool:
    """megatron's parameter-free L2Norm (`qk_l2_norm`): left stock, the ledger books what it
    saves at its site."""
    from megatron.core.transformer.torch_norm import L2Norm

    return isinstance(module, L2Norm)


def _at(layer: torch.nn.Module, slot: str) -> Any:
    """What the layer holds at the dotted `slot` path (None where a step is missing: a
    qk-norm attribute some megatron versions lack). Not `get_submodule`: a stock
    bias-dropout-add is a plain function."""
    holder = layer
    for name in slot.split("."):
        holder = getattr(holder, name, None)
    return holder


def _in_mlp(site: Site) -> bool:
    """A site of the MLP (`_convert_mlp`): only dense or only MoE layers have it."""
    return "dense" in site.needs or "moe" in site.needs


def _forward_order(sites: list[Site]) -> list[Site]:
    """`sites` in the order the layer's forward reaches their slots: by the layer's child
    that holds the slot (in the order the schema first names it), then by the place in that
    child's tensor-parallel region (`_REGION_RANK`), then in schema order. The schema lists
    sites as they were added, not in forward order (the qk-norms come last there)."""
    child_rank: dict[str, int] = {}
    for site in _LAYER_BLOCK:
        child_rank.setdefault(site.slot.split(".")[0], len(child_rank))
    return sorted(sites, key=lambda s: (child_rank[s.slot.split(".")[0]], _REGION_RANK[s.holder],
                                        _LAYER_BLOCK.index(s)))


def _convert_slot(layer: torch.nn.Module, site: Site) -> Optional[ActModule]:
    """The module at `site.slot` converted for `site`; None for a norm slot the layer leaves
    empty (an identity: no pre-MLP norm, no qk-layernorm) or holds megatron's L2Norm in
    (`qk_l2_norm` in place of the qk-layernorm)."""
    module = _at(layer, site.slot)
    if site.holder != "norm":
        return _linear(module, site.name, site.holder)
    if _is_identity(module) or ("qk_layernorm" in site.needs and _is_l2_norm(module)):
        return None
    return _norm(module, site.name)


def _convert_slots(layer: torch.nn.Module, sites: list[Site]) -> dict[str, ActModule]:
    out = {}
    for site in _forward_order(sites):
        module = _convert_slot(layer, site)
        if module is not None:
            out[site.name] = module
    return out


def _convert_bda(layer: torch.nn.Module, site: Site) -> ActBiasDropoutAdd:
    """The bias-dropout-add at `site.slot`, replaced by `ActBiasDropoutAdd` (a converted one
    re-initialised): the stock one is a function factory, not a module to convert."""
    bda = _at(layer, site.slot)
    if isinstance(bda, ActBiasDropoutAdd):
        bda._act_init()
        return bda
    bda = ActBiasDropoutAdd.from_stock(bda, site=site.name)
    parent, _, name = site.slot.rpartition(".")
    setattr(_at(layer, parent) if parent else layer, name, bda)
    return bda


def _convert_mlp(layer: torch.nn.Module) -> dict[str, ActModule]:
    """The MLP's sites: a dense MLP (`mlp.*`, ActMLP and its two linears) or an MoE layer
    (`moe.*`, `moe.convert_moe`)."""
    mlp = layer.mlp
    if is_moe(mlp):
        return convert_moe(layer)
    if not isinstance(mlp, MLP):
        raise TypeError(
            f"mlp: cannot compress a {type(mlp).__module__}.{type(mlp).__name__}; llm_act "
            "converts megatron-core's MLP and MoELayer (local spec)")
    if not isinstance(mlp, ActMLP):
        ActMLP.from_stock(mlp)
    else:
        mlp._act_init()
    dense = [site for site in _LAYER_BLOCK if "dense" in site.needs]
    sites: dict[str, ActModule] = {site.name: mlp for site in dense if site.holder == "mlp"}
    sites.update(_convert_slots(layer, [site for site in dense if site.holder in _MODULE_HOLDERS]))
    return sites


def convert_layer(layer: torch.nn.Module, layer_index: int, attention: bool = False) -> dict[str, ActModule]:
    """Convert `layer` (a TransformerLayer) in place; return site -> the module storing it.

    Idempotent (a converted layer is re-initialised: every site back to "keep").
    `attention=True` also converts the core attention (`convert_attention`).
    Sites whose module is an identity (e.g. no pre-MLP norm, no qk-layernorm) are left out.
    """
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
        raise ValueError(f"layer_index: expected a non-negative int, got {layer_index!r}")
    sites = _convert_slots(layer, [site for site in _LAYER_BLOCK
                                   if site.holder in _MODULE_HOLDERS and not _in_mlp(site)])
    sites.update(_convert_mlp(layer))
    for site in _LAYER_BLOCK:
        if site.holder == "bda":
            sites[site.name] = _convert_bda(layer, site)
    if attention:
        sites.update(convert_attention(layer, layer_index))
    for module in sites.values():
        module.act_layer = layer_index

    old = getattr(layer, "act_recompute", None)
    if old is not None:
        old.bind({}, {})  # drop hooks of an earlier conversion
    layer.act_recompute = LayerRecompute(layer, sites, layer_index)
    return sites


def convert_outer(block: torch.nn.Module) -> tuple[Optional[int], dict[str, ActModule]]:
    """Convert in place the slots of a TransformerBlock (`block`) that store the sites after
    the blocks (`Site.scope` "model": the final norm, whose input is the last layer's
    output); return (the global index of its last layer, which the plan of those sites
    belongs to, {site: module}). (None, {}) where the block holds no such slot (a pipeline
    stage before the last: no final norm) or no layer. A norm llm_act cannot convert (apex,
    Transformer Engine) is left stock: the site is then not planned there, as before."""
    layers = getattr(block, "layers", None)
    if not layers:
        return None, {}
    number = getattr(layers[-1], "layer_number", None)
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        return None, {}
    index, out = number - 1, {}
    for site in BLOCK:
        if site.scope != "model":
            continue
        module = _at(block, site.slot)
        if type(module) not in (torch.nn.LayerNorm, torch.nn.RMSNorm, ActLayerNorm, ActRMSNorm):
            continue
        out[site.name] = _norm(module, site.name)
        out[site.name].act_layer = index
    return index, out


def convert_attention(layer: torch.nn.Module, layer_index: int) -> dict[str, ActModule]:
    """Convert the layer's core attention (megatron-core's DotProductAttention) in place to
    `ActCoreAttention` (mode "stock", every site kept, i.e. still stock) and link it to the
    output projection, which stores `attn.out`. Returns {site: module} for `attn.q/k/v`,
    `attn.softmax` and `attn.dropout_mask` (`attn.out` stays with the projection)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
        raise ValueError(f"layer_index: expected a non-negative int, got {layer_index!r}")
    attn = layer.self_attention
    core = attn.core_attention
    if isinstance(core, ActCoreAttention):
        core._act_init()
    elif type(core) is DotProductAttention:
        ActCoreAttention.from_stock(core)
    else:
        raise TypeError(
            f"{ATTN_Q}: cannot convert a {type(core).__module__}.{type(core).__name__}; llm_act "
            "converts megatron-core's DotProductAttention (local spec)")
    if isinstance(attn.linear_proj, ActModule):
        core.link_out_site(attn.linear_proj)
    core.act_layer = layer_index
    return {site: core for site in ATTENTION_SITES if site != ATTN_OUT}
