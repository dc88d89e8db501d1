"""Compressed MoE layers: megatron-core's TopKRouter and SequentialMLP with llm_act's sites.

`convert_moe(layer)` swaps, in place (class swap, parameters and state_dict keys untouched),
the router to `ActTopKRouter` (site `moe.router_input`) and the SequentialMLP experts to
`ActSequentialMLP` (sites `moe.fc1_input`, `moe.act_input`, `moe.fc2_input`, `moe.routing`);
the token dispatcher stays stock (it keeps only indices and the routing map, booked at
`moe.routing` by the ledger). With every MoE site kept (or no grad / eval) both run their
stock code, so plan "keep" is bit-identical to stock megatron-core.

Only what runs on the experts' own tensors is converted; GroupedMLP / TEGroupedMLP (CUDA's
grouped GEMM), shared experts and expert tensor parallelism are refused with the fix named
(`unsupported.check_moe`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llm_act._imports import require
from llm_act.codecs.base import Codec
from llm_act.cpu import required as cpu_required
from llm_act.patches.megatron import unsupported
from llm_act.patches.megatron.act_module import ActModule
from llm_act.patches.megatron.moe_functions import (
    ACT, FC1, FC2, ROUTING, EncodedRouterGating, ExpertFFN, ExpertStore, PaddingOnly)
from llm_act.patches.megatron.recompute_codec import SiteRecompute, VisibleKeep

require("megatron.core", "llm_act.patches.megatron.moe")
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from llm_act.sites import MOE_ROUTER_INPUT
from llm_act.patches.megatron.mlp import activation_of

ROUTER_SITE = MOE_ROUTER_INPUT
EXPERT_SITES = (FC1, ACT, FC2, ROUTING)
#: expert sites a plan may recompute on their own (rebuilt inside the expert's backward);
#: the others only with the whole block
EXPERT_RECOMPUTABLE = (ACT, FC2)


def is_moe(mlp: Any) -> bool:
    """Whether a TransformerLayer's `mlp` is a megatron-core MoE layer."""
    return hasattr(mlp, "router") and hasattr(mlp, "experts") and hasattr(mlp, "token_dispatcher")


class ActTopKRouter(TopKRouter, ActModule):
    """TopKRouter whose gating linear saves its input encoded (site `moe.router_input`).
    TopKRouter comes first: its base `Router(ABC, ...)` lays instances out so that only this
    order allows the in-place class swap (no name of ActModule is defined by TopKRouter)."""

    ACT_SITES = (ROUTER_SITE,)

    def __init__(self, *args: Any, **kwargs: Any):
        TopKRouter.__init__(self, *args, **kwargs)
        self._act_init()

    def gating(self, input: torch.Tensor):
        codec = self.act_codec(ROUTER_SITE, input, self.weight, stores=input)
        if codec is None:
            if self.weight.device.type == "cpu":
                cpu_required.require("megatron-core's MoE router (TopKRouter.gating moves its weight "
                                     "to torch.cuda.current_device())", "llm_act MoE router")
            return TopKRouter.gating(self, input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return EncodedRouterGating.apply(input, self.weight, self.bias, dtype, codec, self, ROUTER_SITE)


class ActSequentialMLP(ActModule, SequentialMLP):
    """SequentialMLP whose experts store each tensor by its site's choice (`ExpertFFN`)."""

    ACT_SITES = EXPERT_SITES

    def __init__(self, *args: Any, **kwargs: Any):
        SequentialMLP.__init__(self, *args, **kwargs)
        self._act_init()

    def set_act_codec(self, site: str, codec: Optional[Codec]) -> None:
        if codec is not None and getattr(codec, "table", None) is not None and hasattr(codec, "activation"):
            raise ValueError(
                f"codec {codec.name!r} at {site!r}: few-bit codecs do not apply to MoE experts "
                "(the routing probability's gradient needs f(x) itself); choose a value codec "
                "such as 'outlier_int4'")
        ActModule.set_act_codec(self, site, codec)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self.act_compressing():
            return SequentialMLP.forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.config.moe_apply_probs_on_input:
            raise NotImplementedError(
                "MoE sites: compression with moe_apply_probs_on_input=True is not supported; "
                "keep the moe.* sites or turn the option off")
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        xs = torch.split(permuted_local_hidden_states, counts)
        ps = torch.split(permuted_probs, counts)
        outs = [self._expert(e, x, p) for e, x, p in zip(self.local_experts, xs, ps)]
        return torch.cat(outs, dim=0), None

    def _expert(self, expert, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return expert(x, p)[0]  # nothing routed here: nothing stored
        if not bool((p != 0).any()):  # padding only: a zero output, nothing stored
            return PaddingOnly.apply(x, p, expert.linear_fc1.weight, expert.linear_fc2.weight)
        n = x.shape[0]
        codecs, recompute = {}, set()
        for site, stores in ((FC1, x), (ACT, ((n, expert.linear_fc1.weight.shape[0]), x.dtype)),
                             (FC2, ((n, expert.linear_fc2.weight.shape[1]), x.dtype)), (ROUTING, p)):
            codec = self.act_codec(site, stores=stores)
            if isinstance(codec, SiteRecompute):
                recompute.add(site)
            codecs[site] = VisibleKeep() if codec is None or codec.name == "keep" else codec
        store = ExpertStore(codecs, frozenset(recompute), activation_of(expert.config)[1],
                            expert.linear_fc1, expert.linear_fc2, self)
        return ExpertFFN.apply(x, p, expert.linear_fc1.weight, expert.linear_fc2.weight, store)


def convert_moe(layer: torch.nn.Module) -> dict[str, ActModule]:
    """Convert `layer.mlp` (a megatron-core MoELayer) in place; return site -> module.
    Idempotent (converted modules go back to every site "keep")."""
    mlp = layer.mlp
    unsupported.check_moe(mlp.config, mlp)
    router, experts = mlp.router, mlp.experts
    if isinstance(router, ActTopKRouter):
        router._act_init()
    elif type(router) is TopKRouter:
        ActTopKRouter.from_stock(router)
    else:
        raise TypeError(f"{ROUTER_SITE}: cannot compress a {type(router).__name__}; llm_act converts "
                        "megatron-core's TopKRouter")
    if isinstance(experts, ActSequentialMLP):
        experts._act_init()
    else:
        ActSequentialMLP.from_stock(experts)
    sites: dict[str, ActModule] = {ROUTER_SITE: router}
    sites.update({site: experts for site in EXPERT_SITES})
    return sites
