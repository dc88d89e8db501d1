"""LayerNorm and RMSNorm that save their input encoded plus exact per-row statistics.

They are `torch.nn.LayerNorm` / `torch.nn.RMSNorm` subclasses (what megatron-core's
`WrappedTorchNorm` builds without apex, so state_dict keys match) with megatron's norm
builder signature `(config, hidden_size, eps=1e-5, ...)`. Unlike `WrappedTorchNorm` they
accept sequence parallelism: a norm has no communication, and its weight and bias are
marked `sequence_parallel` so megatron all-reduces their gradients over TP. The input is
encoded but mean/rstd stay exact: the statistics are per row (tiny) and errors in them
would scale the whole row's gradient (ActNN sec. 5.1 keeps them too).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llm_act.patches.megatron.act_module import ActModule
from llm_act.patches.megatron.functions import EncodedLayerNorm, EncodedRMSNorm
from llm_act.sites import QK_NORM_SITES, sites_where

#: the block's norms and, with `qk_layernorm`, SelfAttention's per-head q/k norms (the
#: schema's sites held by a norm)
NORM_SITES = sites_where(holder="norm")


def _check_config(config) -> None:
    if getattr(config, "layernorm_zero_centered_gamma", False):
        raise ValueError("config.layernorm_zero_centered_gamma=True is not supported by llm_act norms")
    if getattr(config, "memory_efficient_layer_norm", False):
        raise ValueError("config.memory_efficient_layer_norm=True is not supported by llm_act norms")


class _ActNorm(ActModule):
    ACT_BINDABLE = NORM_SITES

    def _act_init(self, site: Optional[str] = None, sequence_parallel: Optional[bool] = None) -> None:
        if site is not None and site not in NORM_SITES:
            raise ValueError(f"site: a norm stores one of {NORM_SITES}, got {site!r}")
        self.ACT_SITES = (site,) if site is not None else ()
        self.act_site = site
        if sequence_parallel is not None:
            for p in self.parameters(recurse=False):
                setattr(p, "sequence_parallel", bool(sequence_parallel))
        ActModule._act_init(self)

    def act_report(self, site: str, record, nbytes: int, replaces: Optional[torch.Tensor] = None) -> None:
        # a q/k norm's input is a view of the fused QKV output, which V may still hold raw:
        # the encoded record does not stand in for that storage
        ActModule.act_report(self, site, record, nbytes, None if site in QK_NORM_SITES else replaces)

    def _site_codec(self, *tensors):
        if self.act_site is None:
            return None
        return self.act_codec(self.act_site, *tensors, stores=tensors[0] if tensors else None)


class ActLayerNorm(_ActNorm, torch.nn.LayerNorm):
    """torch.nn.LayerNorm saving encode(x) and the exact per-row mean and rstd."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm", act_site: Optional[str] = None):
        _check_config(config)
        torch.nn.LayerNorm.__init__(self, normalized_shape=hidden_size, eps=eps)
        self._act_init(site=act_site, sequence_parallel=config.sequence_parallel)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        codec = self._site_codec(input, self.weight, self.bias)
        if codec is None:
            return torch.nn.LayerNorm.forward(self, input)
        return EncodedLayerNorm.apply(input, self.weight, self.bias, tuple(self.normalized_shape),
                                      self.eps, codec, self, self.act_site)


class ActRMSNorm(_ActNorm, torch.nn.RMSNorm):
    """torch.nn.RMSNorm saving encode(x) and the exact per-row rstd (float32)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm", act_site: Optional[str] = None):
        _check_config(config)
        torch.nn.RMSNorm.__init__(self, normalized_shape=hidden_size, eps=eps)
        self._act_init(site=act_site, sequence_parallel=config.sequence_parallel)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        codec = self._site_codec(input, self.weight)
        if codec is None:
            return torch.nn.RMSNorm.forward(self, input)
        eps = self.eps if self.eps is not None else torch.finfo(input.dtype).eps
        return EncodedRMSNorm.apply(input, self.weight, tuple(self.normalized_shape), eps,
                                    codec, self, self.act_site)


def act_norm(config, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
    """Megatron norm builder: ActLayerNorm or ActRMSNorm after `config.normalization`."""
    if config.normalization == "LayerNorm":
        return ActLayerNorm(config, hidden_size, eps, **kwargs)
    if config.normalization == "RMSNorm":
        return ActRMSNorm(config, hidden_size, eps, **kwargs)
    raise ValueError(
        f"config.normalization: llm_act norms support LayerNorm and RMSNorm, got {config.normalization!r}")
