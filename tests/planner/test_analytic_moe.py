"""The analytic profile of an MoE block: rows per expert from top-k and the capacity factor,
the `moe.*` sites against the ledger on a real megatron-core MoE GPT (CPU, one rank), and
expert parallelism in the parameter count."""
from __future__ import annotations

import math

import pytest

from llm_act.planner.analytic import block_profile
from llm_act.planner.model_shape import DeviceModel, ModelShape
from llm_act.planner.presets import model_shape
from llm_act.planner.static_memory import parameters_per_rank
from llm_act.sites import DENSE_MLP_SITES, MOE_SITES


def _shape(**kw) -> ModelShape:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                dtype="fp32", gated_linear_unit=True, activation="silu", bias=False, attention="stock",
                position_embedding="rope", num_experts=4, moe_topk=2)
    base.update(kw)
    return ModelShape(**base)


def test_rows_per_expert_from_topk_and_capacity_factor():
    shape = model_shape("mixtral-8x7b", seq_length=4096)
    assert shape.moe_rows == 4096 * 2 and shape.tokens_per_expert == 4096 * 2 / 8
    assert shape.with_(ep=8).tokens_per_expert == 4096 * 2  # one expert per rank takes them all
    assert shape.with_(moe_capacity_factor=1.0).moe_rows == 8192  # balanced: nothing dropped
    assert shape.with_(moe_capacity_factor=0.5).moe_rows == 8 * 512  # half dropped
    assert shape.with_(moe_capacity_factor=0.3).moe_rows == 8 * 308  # ceil(4096*2/8*0.3)
    v3 = model_shape("deepseek-v3-like")
    assert v3.moe_rows == 4096 * 8 and v3.with_(ep=64).tokens_per_expert == 4096 * 8 / 4
    half = {s.name: s.nbytes for s in block_profile(shape.with_(moe_capacity_factor=0.5)).sites}
    full = {s.name: s.nbytes for s in block_profile(shape).sites}
    for site in ("moe.fc1_input", "moe.act_input", "moe.fc2_input"):
        assert half[site] * 2 == full[site], site


def test_moe_presets_are_the_published_shapes():
    mixtral = model_shape("mixtral-8x7b")
    assert (mixtral.num_layers, mixtral.hidden_size, mixtral.num_query_groups, mixtral.moe_ffn_hidden_size,
            mixtral.num_experts, mixtral.moe_topk) == (32, 4096, 8, 14336, 8, 2)
    assert math.isclose(parameters_per_rank(mixtral, 0), 46.7e9, rel_tol=0.01)  # Mixtral's 46.7B
    v3 = model_shape("deepseek-v3-like")
    assert (v3.hidden_size, v3.num_experts, v3.moe_topk, v3.moe_ffn_hidden_size) == (7168, 256, 8, 2048)


def test_moe_block_has_the_moe_sites_and_codecs():
    sites = {s.name: s for s in block_profile(_shape()).sites}
    assert set(MOE_SITES) <= set(sites) and not set(DENSE_MLP_SITES) & set(sites)
    assert not any(c.name.startswith("fewbit") for c in sites["moe.act_input"].codecs)
    assert sites["moe.fc1_input"].forward_ms is None and sites["moe.routing"].forward_ms is None
    assert sites["moe.act_input"].inputs == ("moe.fc1_input",)
    assert sites["moe.fc2_input"].inputs == ("moe.act_input", "moe.routing")


@pytest.mark.parametrize("field, value, match", [
    ("ep", 3, "ep=3 does not divide num_experts=4"),
    ("moe_topk", 5, "moe_topk"),
    ("moe_capacity_factor", 0.0, "moe_capacity_factor"),
])
def test_bad_moe_shapes_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        _shape(**{field: value})
    with pytest.raises(ValueError, match="needs an MoE model"):
        ModelShape(2, 64, 4, 32, 2, ep=2)


def test_expert_parallelism_splits_the_experts_parameters():
    h, f = 64, 256
    expert = h * 2 * f + f * h  # SwiGLU fc1 (both halves) and fc2, no biases
    one, two = parameters_per_rank(_shape(), 0), parameters_per_rank(_shape(ep=2), 0)
    assert one - two == 2 * (4 - 2) * expert  # 2 layers, 2 experts fewer per rank


def test_moe_sites_match_the_ledger(megatron_one_rank):
    """The stock MoE GPT of the MoE tests (alltoall, top-2 of 4, SwiGLU, dropless): the expert
    sites byte for byte; the router input as the dense fc1 input (the norm's statistics booked
    at the norm's input by the ledger); the routing within 2x (a prior: the dispatcher's index
    bookkeeping is not modelled exactly)."""
    from tests import gpt_runs as R
    from tests.patches.megatron.moe_runs import build_moe

    _, _, led = R.step(build_moe(), ledger=True)
    measured = {site: n for (layer, site), n in led.by_site().items() if layer == 0}
    predicted = {s.name: s.nbytes for s in block_profile(_shape(), DeviceModel.cpu()).sites}
    stats = 2 * 4 * 32 * 2
    assert measured["moe.router_input"] == predicted["moe.router_input"] - stats
    for site in ("moe.fc1_input", "moe.act_input", "moe.fc2_input"):
        assert measured[site] == predicted[site], (site, measured[site], predicted[site])
    assert 0.5 < measured["moe.routing"] / predicted["moe.routing"] < 2
