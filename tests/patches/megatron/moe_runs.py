"""The MoE GPT the MoE tests share: megatron-core's local spec with 4 SequentialMLP experts,
top-2 routing with the aux loss, SwiGLU experts (as Mixtral and DeepSeek), built seeded by
`gpt_runs.build` so two builds have equal weights."""
from __future__ import annotations

import torch.nn.functional as F

from tests import testing as T
from tests import gpt_runs as R

EXPERTS, TOPK = 4, 2


def moe_overrides(dispatcher: str = "alltoall", **overrides):
    kw = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_router_load_balancing_type="aux_loss",
              moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher, add_bias_linear=False,
              gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    kw.update(overrides)
    return kw


def build_moe(dispatcher: str = "alltoall", spec=None, **overrides):
    spec = spec or T.local_layer_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return R.build(spec=spec, dropout=0.0, **moe_overrides(dispatcher, **overrides))
