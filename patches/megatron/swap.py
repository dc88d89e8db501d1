"""`convert_layer`: turn a stock megatron-core TransformerLayer's modules into Act ones.

The registry `apply` uses: each stored site of a block -> the module that stores it,
converted in place (class swap, parameters untouched), so state_dict keys do not change.
Attention internals (q/k/v, softmax, attention dropout) stay stock unless
`convert_layer(..., attention=True)` / `convert_attention` converts the core attention.
"""
from __future__ import annotations

import torch

from llm_act._imports import require
from llm_act.patches.megatron.act_module import ActModule
from llm_act.patches.megatron.dropout import ActBiasDropoutAdd
from llm_act.patches.megatron.linear import ActColumnParallelLinear, ActRowParallelLinear
from llm_act.patches.megatron.mlp import ActMLP
from llm_act.patches.megatron.norm import ActLayerNorm, ActRMSNorm
from llm_act.patches.megatron.recompute import LayerRecompute

require("megatron.core", "llm_act.patches.megatron.swap")
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp  # noqa: E402
from megatron.core.transformer.mlp import MLP  # noqa: E402


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


def _linear(module: torch.nn.Module, site: str, column: bool):
    cls, stock = (ActColumnParallelLinear, ColumnParallelLinear) if column else (ActRowParallelLinear, RowParallelLinear)
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


def _convert_mlp(layer: torch.nn.Module) -> dict[str, ActModule]:
    """The MLP's sites: a dense MLP (`mlp.*`, ActMLP and its two linears) or an MoE layer
    (`moe.*`, `moe.convert_moe`)."""
    from llm_act.patches.megatron.moe import convert_moe, is_moe

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
    return {
        "mlp.act_input": mlp,
        "mlp.fc1_input": _linear(mlp.linear_fc1, "mlp.fc1_input", column=True),
        "mlp.fc2_input": _linear(mlp.linear_fc2, "mlp.fc2_input", column=False),
    }


def convert_layer(layer: torch.nn.Module, layer_index: int, attention: bool = False) -> dict[str, ActModule]:
    """Convert `layer` (a TransformerLayer) in place; return site -> the module storing it.

    Idempotent (a converted layer is re-initialised: every site back to "keep").
    `attention=True` also converts the core attention (`convert_attention`).
    Sites whose module is an identity (e.g. no pre-MLP norm, no qk-layernorm) are left out.
    """
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
        raise ValueError(f"layer_index: expected a non-negative int, got {layer_index!r}")
    sites: dict[str, ActModule] = {}
    if not _is_identity(layer.input_layernorm):
        sites["ln1.input"] = _norm(layer.input_layernorm, "ln1.input")
    attn = layer.self_attention
    sites["attn.qkv_input"] = _linear(attn.linear_qkv, "attn.qkv_input", column=True)
    for attr, site in (("q_layernorm", "attn.q_norm_input"), ("k_layernorm", "attn.k_norm_input")):
        norm = getattr(attn, attr, None)
        if not _is_identity(norm) and not _is_l2_norm(norm):  # qk_layernorm (Qwen3, OLMo 2)
            sites[site] = _norm(norm, site)
    sites["attn.out"] = _linear(attn.linear_proj, "attn.out", column=False)
    if not _is_identity(layer.pre_mlp_layernorm):
        sites["ln2.input"] = _norm(layer.pre_mlp_layernorm, "ln2.input")
    sites.update(_convert_mlp(layer))
    for attr, site in (("self_attn_bda", "attn.hidden_dropout_mask"), ("mlp_bda", "mlp.hidden_dropout_mask")):
        bda = getattr(layer, attr)
        if isinstance(bda, ActBiasDropoutAdd):
            bda._act_init()
        else:
            bda = ActBiasDropoutAdd.from_stock(bda, site=site)
            setattr(layer, attr, bda)
        sites[site] = bda
    if attention:
        sites.update(convert_attention(layer, layer_index))
    for module in sites.values():
        module.act_layer = layer_index

    old = getattr(layer, "act_recompute", None)
    if old is not None:
        old.bind({}, {})  # drop hooks of an earlier conversion
    layer.act_recompute = LayerRecompute(layer, sites, layer_index)
    return sites


def convert_attention(layer: torch.nn.Module, layer_index: int) -> dict[str, ActModule]:
    """Convert the layer's core attention (megatron-core's DotProductAttention) in place to
    `ActCoreAttention` (mode "stock", every site kept, i.e. still stock) and link it to the
    output projection, which stores `attn.out`. Returns {site: module} for `attn.q/k/v`,
    `attn.softmax` and `attn.dropout_mask` (`attn.out` stays with the projection)."""
    from llm_act.patches.megatron.attention import ATTENTION_SITES, ActCoreAttention
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
            f"attn.q: cannot convert a {type(core).__module__}.{type(core).__name__}; llm_act "
            "converts megatron-core's DotProductAttention (local spec)")
    if isinstance(attn.linear_proj, ActModule):
        core.link_out_site(attn.linear_proj)
    core.act_layer = layer_index
    return {site: core for site in ATTENTION_SITES if site != "attn.out"}
