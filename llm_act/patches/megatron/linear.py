"""Column- and row-parallel linears that save their input encoded (one site each).

Subclasses of megatron-core's `ColumnParallelLinear` / `RowParallelLinear` with the same
constructor and parameters (state_dict keys unchanged). Only `_forward_impl`, the
matmul-with-communication call, is replaced: with the site kept (or no grad / eval) it is
the stock call, otherwise `EncodedLinear` (`sp.EncodedSPLinear` under sequence parallelism:
the local shard is encoded before the all-gather and gathered encoded in backward). One class serves several sites, so the site is
given by `from_stock(module, site=...)` or the `act_site` constructor keyword.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

from llm_act._imports import require
from llm_act.patches.megatron import compat
from llm_act.patches.megatron.act_module import ActModule
from llm_act.patches.megatron.functions import EncodedLinear
from llm_act.patches.megatron.sp import EncodedSPLinear
from llm_act.sites import BLOCK, check_site

require("megatron.core", "llm_act.patches.megatron.linear")
from megatron.core.tensor_parallel import layers as _layers  # noqa: E402
from megatron.core.tensor_parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
)

#: the sites a parallel linear stores (its input): the schema's column and row holders
LINEAR_SITES = tuple(site.name for site in BLOCK if site.holder in ("column", "row"))
_IMPL_SIG = inspect.signature(_layers.linear_with_grad_accumulation_and_async_allreduce)
_IMPL_NAMES = tuple(_IMPL_SIG.parameters)


def _impl_arguments(args: tuple, kwargs: dict) -> dict:
    """megatron's `linear_with_grad_accumulation_and_async_allreduce` arguments by name, as
    `_IMPL_SIG.bind(...).arguments` gives them (defaults left out), in plain dict operations
    that torch.compile traces (`inspect.Signature.bind` is a graph break)."""
    if len(args) > len(_IMPL_NAMES):
        raise TypeError(f"_forward_impl takes at most {len(_IMPL_NAMES)} arguments, got {len(args)}")
    out = dict(zip(_IMPL_NAMES, args))
    for name, value in kwargs.items():
        if name not in _IMPL_NAMES or name in out:
            _IMPL_SIG.bind(*args, **kwargs)  # raises the TypeError bind would
        out[name] = value
    return out


class _ActLinear(ActModule):
    """Shared part of the two linears: the site and the compressed `_forward_impl`."""

    ACT_BINDABLE = LINEAR_SITES

    def _act_init(self, site: Optional[str] = None) -> None:
        if site is not None:
            check_site(site)
            if site not in LINEAR_SITES:
                raise ValueError(f"site: a linear stores one of {LINEAR_SITES}, got {site!r}")
        self.ACT_SITES = (site,) if site is not None else ()
        self.act_site = site
        ActModule._act_init(self)

    def _forward_impl(self, input, weight, *args, **kwargs):
        site = self.act_site
        codec = self.act_codec(site, input, weight, stores=input) if site is not None else None
        if codec is None or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        a = _impl_arguments((input, weight) + args, kwargs)
        if compat.linear_gtp_size(a) > 1:  # refused at set-up too (unsupported.check_transformer_config)
            raise NotImplementedError(
                f"site {site!r}: gtp_remat_size={compat.linear_gtp_size(a)} (GTP weight sharding) is "
                "not supported with compression")
        if a.get("grad_output_buffer") is not None:
            raise NotImplementedError(
                f"site {site!r}: deferred embedding wgrad compute is not supported with compression")
        tp_group = a.get("tp_group")
        if tp_group is None and (a.get("allreduce_dgrad") or a.get("sequence_parallel")):
            # the default TP group, only where it is used (a row-parallel linear passes None
            # and communicates outside; megatron's lookup is a torch.compile graph break)
            tp_group = _layers.get_tensor_model_parallel_group_if_none(None)
        if a.get("sequence_parallel"):
            # the local shard is encoded before the all-gather; backward gathers it encoded
            return EncodedSPLinear.apply(
                input, weight, a.get("bias"), a["gradient_accumulation_fusion"], tp_group,
                codec, self, site)
        return EncodedLinear.apply(
            input, weight, a.get("bias"), a["gradient_accumulation_fusion"],
            a["allreduce_dgrad"], tp_group, codec, self, site)


class ActColumnParallelLinear(_ActLinear, ColumnParallelLinear):
    """ColumnParallelLinear whose saved input is encoded by its site's codec."""

    def __init__(self, *args: Any, act_site: Optional[str] = None, **kwargs: Any):
        ColumnParallelLinear.__init__(self, *args, **kwargs)
        self._act_init(site=act_site)


class ActRowParallelLinear(_ActLinear, RowParallelLinear):
    """RowParallelLinear (input already split over TP) whose saved input is encoded."""

    def __init__(self, *args: Any, act_site: Optional[str] = None, **kwargs: Any):
        RowParallelLinear.__init__(self, *args, **kwargs)
        self._act_init(site=act_site)


#: `Site.holder` kind -> (our class, the stock class it converts): the one table the layer
#: swap (`swap.convert_layer`) and the layer spec (`spec.layer_spec`) both read
LINEAR_HOLDERS = {
    "column": (ActColumnParallelLinear, ColumnParallelLinear),
    "row": (ActRowParallelLinear, RowParallelLinear),
}
