"""What differs between the megatron-core versions llm_act supports (0.16 through 0.19).

Every difference the megatron integration meets lives here, decided by what the installed
megatron-core *has* (a spec slot's type, a helper that exists, what a stock function does),
never by its version string, so that releases between the tested ends work alike:

- **Spec slots.** Up to 0.16 a layer's `mlp` slot and the MoE `experts` slot are
  `ModuleSpec`s. Later they are builders: `functools.partial(MLP.as_mlp_submodule,
  submodules=...)`, `functools.partial(MoELayer, submodules=...)`,
  `functools.partial(SequentialMLP, submodules=...)` (0.17.1 has the builder in the experts
  slot and still a `ModuleSpec` in the mlp slot; 0.18 and 0.19 builders in both). `spec_class`, `spec_submodules`,
  `with_submodules` and `with_class` read and copy either form (megatron's own
  `spec_utils.get_submodules` where it exists).
- **The grouped-GEMM experts.** 0.16's local spec builds the legacy `GroupedMLP` for
  `moe_grouped_gemm=True`, which needs the `grouped_gemm` package
  (`moe.grouped_gemm_util`); 0.19 has neither: its local spec always builds
  `SequentialMLP`. `legacy_grouped_gemm()` says which.
- **Bias-dropout-add's dtype rule.** When the residual's dtype differs from x's
  (`fp32_residual_connection=True` with bf16/fp16 params), 0.16 casts the residual to x's
  dtype, 0.19 casts x and the bias to the residual's. `bda_follows_residual()` asks the
  installed stock function (once, on two scalars), and `bda_operands` applies that rule.
- **Options of newer releases our layers do not implement** (`NEW_OPTIONS`: GTP weight
  sharding, MLP chunks, the MoE paged stash, qk_l2_norm, MuP, fp8_output_proj): read with
  `getattr` and a default meaning "off", so an older config simply lacks them;
  `unsupported.check_transformer_config` refuses each one that is on.
- **Linears** are built with `name=` (0.19; passed through to megatron's constructors) and
  their `_forward_impl` is called with `gtp_remat_size=` (`linear_gtp_size`).
- **`megatron.legacy`**: in a Megatron-LM checkout, not in the 0.19 wheel
  (`optional_module`).
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import Any, Optional

import torch

# --- spec slots --------------------------------------------------------------------------


def _module_spec_type() -> type:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec


def is_builder(spec: Any) -> bool:
    """Whether a spec slot holds a builder (`functools.partial`), megatron-core >= 0.17's form
    of the `mlp` and `experts` slots."""
    return isinstance(spec, functools.partial)


def spec_class(spec: Any) -> Optional[type]:
    """The class a spec slot builds: a `ModuleSpec`'s module, a builder's class (or the class
    of the classmethod it calls, e.g. `MLP.as_mlp_submodule`), a class itself; None for
    anything else (a plain function)."""
    if isinstance(spec, _module_spec_type()):
        from megatron.core.transformer.spec_utils import get_module

        spec = get_module(spec)
    elif is_builder(spec):
        spec = spec.func
        if isinstance(spec, types.MethodType) and isinstance(spec.__self__, type):
            spec = spec.__self__
    return spec if isinstance(spec, type) else None


def spec_submodules(spec: Any) -> Any:
    """A spec slot's `submodules` (None where it has none). megatron's own
    `spec_utils.get_submodules` where it exists (0.17+), reading both forms."""
    from megatron.core.transformer import spec_utils

    get = getattr(spec_utils, "get_submodules", None)
    if get is not None:
        try:
            return get(spec)
        except (ValueError, KeyError):
            return None
    if is_builder(spec):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def with_submodules(spec: Any, submodules: Any) -> Any:
    """A copy of a spec slot (`ModuleSpec` or builder) with `submodules` replaced."""
    if is_builder(spec):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    import dataclasses

    return dataclasses.replace(spec, submodules=submodules)


def with_class(spec: Any, cls: type) -> Any:
    """A copy of a spec slot that builds `cls` (a subclass of `spec_class(spec)`) with the same
    arguments: a `ModuleSpec`'s module replaced, or a builder calling `cls` (or `cls`'s
    classmethod of the same name) in place of the stock class."""
    stock = spec_class(spec)
    if stock is None or not issubclass(cls, stock):
        raise TypeError(f"with_class: {cls.__name__} does not subclass the slot's class {stock!r}")
    if is_builder(spec):
        func = spec.func
        if isinstance(func, types.MethodType) and func.__self__ is stock:
            func = getattr(cls, func.__name__)
        else:
            func = cls
        return functools.partial(func, *spec.args, **spec.keywords)
    import dataclasses

    return dataclasses.replace(spec, module=cls)


# --- MoE experts -------------------------------------------------------------------------


def legacy_grouped_gemm() -> Optional[Any]:
    """megatron-core's `moe.grouped_gemm_util` where the legacy `GroupedMLP` still exists
    (0.16: the local spec builds it for `moe_grouped_gemm=True`), None where both are gone
    (0.19: the local spec builds `SequentialMLP` whatever `moe_grouped_gemm` says)."""
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        return None
    return grouped_gemm_util


# --- bias-dropout-add --------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def bda_follows_residual() -> bool:
    """Whether the installed stock bias-dropout-add computes in the *residual's* dtype when it
    differs from x's (0.19: x and the bias are cast up to it) rather than in x's (0.16: the
    residual is cast down). Asked of megatron's own function, once, on two scalars."""
    from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func

    x = torch.zeros(1, dtype=torch.bfloat16)
    residual = torch.zeros(1, dtype=torch.float32)
    return _bias_dropout_add_func((x, None), residual, 0.0, False).dtype == residual.dtype


def bda_operands(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor):
    """(x, bias, residual) cast as the installed stock bias-dropout-add casts them before its
    dropout (`bda_follows_residual`); unchanged where the dtypes agree."""
    if x.dtype == residual.dtype:
        return x, bias, residual
    if bda_follows_residual():
        return x.to(residual.dtype), (None if bias is None else bias.to(residual.dtype)), residual
    return x, bias, residual.to(x.dtype)


# --- options of newer releases -----------------------------------------------------------

#: TransformerConfig options of megatron-core 0.17-0.19 the compressed layers do not
#: implement, with the value that means "off" (older configs lack them: `getattr` default)
NEW_OPTIONS: dict[str, Any] = {
    "gtp_weight_remat_size": 1,  # GTP: weights sharded and re-gathered inside the linears
    "expert_gtp_weight_remat_size": 1,
    "mlp_chunks_for_training": 1,  # the layer splits its MLP call over sequence chunks
    "moe_paged_stash": False,  # the MoE experts' activations stashed in paged buffers
    "qk_l2_norm": False,  # L2Norm on q and k: no site of the schema holds its input
    "use_mup": False,  # MuP: logits (and attention) scaled by width multipliers
    "fp8_output_proj": False,  # an FP8 LM-head projection (our chunked loss computes the logits)
}


#: Megatron-LM's command-line flag of each `NEW_OPTIONS` entry that is a TransformerConfig
#: field made a flag (0.19's `arguments.py`)
NEW_OPTION_FLAGS: dict[str, str] = {
    "mlp_chunks_for_training": "--mlp-chunks-for-training",
    "moe_paged_stash": "--moe-paged-stash",
    "qk_l2_norm": "--qk-l2-norm",
    "use_mup": "--use-mup",
    "fp8_output_proj": "--fp8-output-proj",
}
#: GTP is set in Megatron-LM by the total number of weight shards over the TP and GTP axes
#: (`resolve_tensor_parallel_weight_shards`: remat size = shards / TP size)
GTP_SHARD_FLAGS: dict[str, str] = {
    "gtp_weight_remat_size": "--tensor-parallel-num-weight-shards",
    "expert_gtp_weight_remat_size": "--expert-tensor-parallel-num-weight-shards",
}


def has_option(name: str) -> bool:
    """Whether the installed megatron-core's TransformerConfig has the field `name`."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return any(f.name == name for f in dataclasses.fields(TransformerConfig))


def option(tconfig: Any, name: str) -> Any:
    """`tconfig.name`, or its "off" value (`NEW_OPTIONS`) where this megatron-core lacks it."""
    return getattr(tconfig, name, NEW_OPTIONS.get(name))


def linear_gtp_size(impl_arguments: dict) -> int:
    """The GTP shard count a linear's `_forward_impl` was handed (0.19's `gtp_remat_size=`;
    1 where the installed megatron-core has no GTP)."""
    return int(impl_arguments.get("gtp_remat_size", 1) or 1)


# --- Megatron-LM pieces ------------------------------------------------------------------


def optional_module(name: str) -> Optional[types.ModuleType]:
    """`import name`, or None where it (or a parent package) is absent: `megatron.legacy`
    ships with a Megatron-LM checkout but not in the megatron-core 0.19 wheel. Errors raised
    *inside* an existing module propagate."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            return None
        raise
