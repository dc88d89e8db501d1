"""The analytic profile of a stock block against the ledger on a real stock megatron-core
`TransformerLayer` (local spec, CPU, one rank): every site, byte for byte, in fp32 and bf16,
with and without dropout. `llm-act plan` sizes budgets from these counts, so a site it
under-counts is a budget that fails in training.

The differences between CPU and a GPU are modelled, not tolerated: `DeviceModel.cpu()` has no
fused softmax kernel (the torch path stores an fp32 softmax beside the 16-bit probabilities)
and torch's CPU dropout keeps its mask in the model dtype (CUDA's: bool). Two differences
of attribution remain, each checked exactly: a norm's fp32 statistics, which the ledger books
at the norm's input and the analytic profile with its output (recomputing that output drops
them); without RoPE (and qk-layernorm), Q, K and V are views of the fused QKV output, which
the ledger counts once at `attn.q`. The [s, s] bool causal mask that megatron builds for each
layer's torch softmax is booked at `attn.softmax` by both. Nothing inside the layer is "other".

With `qk_layernorm` (Qwen3, OLMo 2) the per-head norm inputs are sites of their own, and under
GQA the stock attention saves K and V repeated to every query head, booked at `attn.k` /
`attn.v`: also byte for byte.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act.ledger import SavedTensorLedger
from llm_act.planner.analytic import block_profile
from llm_act.planner.model_shape import DeviceModel, ModelShape
from tests import testing as T

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

S, B, H, A = 32, 2, 64, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _analytic(dtype: str, dropout: float, device: DeviceModel, **shape_kw) -> dict[str, int]:
    shape = ModelShape(1, H, A, S, B, dtype=dtype, dropout=dropout, attention="stock", **shape_kw)
    return {site.name: site.nbytes for site in block_profile(shape, device).sites}


def _stock_layer_ledger(dtype: str, dropout: float, spec=None, **config_kw) -> dict[str, int]:
    """{site: bytes} of one stock layer's forward (local spec, no RoPE); nothing is "other"."""
    config = T.small_config(hidden_size=H, num_attention_heads=A, num_layers=1,
                            dtype=DTYPES[dtype], dropout=dropout, **config_kw)
    layer = T.transformer_layer(config, spec=spec)
    x = torch.randn(S, B, H, dtype=DTYPES[dtype], requires_grad=True)
    with SavedTensorLedger() as ledger:
        out = layer(x, attention_mask=None)
    measured = {site: n for (_, site), n in ledger.by_site().items()}
    assert set(k[0] for k in ledger.by_site()) == {0}, ledger.by_site()  # nothing outside the layer
    del out
    return measured


def _norm_stats_at_the_input(predicted: dict[str, int]) -> None:
    """The ledger books ln1/ln2's statistics at the norm's input, the analytic profile with its
    output (LayerNorm's mean and rstd, fp32 per row)."""
    stats = 2 * 4 * S * B
    for norm_input, norm_output in (("ln1.input", "attn.qkv_input"), ("ln2.input", "mlp.fc1_input")):
        predicted[norm_input] += stats
        predicted[norm_output] -= stats


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_analytic_site_matches_the_ledger_on_a_stock_layer(megatron_one_rank, dtype, dropout):
    measured = _stock_layer_ledger(dtype, dropout)
    predicted = _analytic(dtype, dropout, DeviceModel.cpu())
    predicted["attn.q"] += predicted.pop("attn.k") + predicted.pop("attn.v")  # one QKV buffer
    _norm_stats_at_the_input(predicted)
    print(f"{dtype} dropout {dropout}: ", {k: (predicted[k], measured.get(k)) for k in predicted})
    assert measured == predicted
    # the softmax site is the unfused path's fp32 softmax + the probabilities probs @ V reads
    e = torch.empty((), dtype=DTYPES[dtype]).element_size()
    scores = B * A * S * S
    assert measured["attn.softmax"] == scores * (4 + (e if dropout or e != 4 else 0)) + S * S  # + mask
    if dropout:
        assert measured["attn.dropout_mask"] == scores * e  # a CPU mask in the model dtype


def test_on_a_gpu_stock_attention_keeps_5as2b_in_16_bits():
    """Korthikanti et al.: softmax output (2 bytes), dropout mask (1) and the dropped
    probabilities (2) per score; the CPU figures above differ by exactly the modelled terms."""
    scores = B * A * S * S
    gpu = _analytic("bf16", 0.1, DeviceModel())
    assert gpu["attn.softmax"] + gpu["attn.dropout_mask"] == 5 * scores
    cpu = _analytic("bf16", 0.1, DeviceModel.cpu())
    # the fp32 softmax, not 16-bit, and the bool causal mask of the torch path
    assert cpu["attn.softmax"] - gpu["attn.softmax"] == 2 * scores + S * S
    assert cpu["attn.dropout_mask"] - gpu["attn.dropout_mask"] == scores  # bf16 mask, not bool
    for site in ("attn.hidden_dropout_mask", "mlp.hidden_dropout_mask"):
        assert cpu[site] == 2 * gpu[site] == 2 * S * B * H
    assert {k: v for k, v in cpu.items() if "dropout" not in k and k != "attn.softmax"} == \
        {k: v for k, v in gpu.items() if "dropout" not in k and k != "attn.softmax"}
    # without dropout, the fused kernel's 16-bit probabilities are the one stored tensor
    assert _analytic("bf16", 0.0, DeviceModel())["attn.softmax"] == 2 * scores


@pytest.mark.parametrize("groups", [None, 2, 1])  # MHA, GQA (the query reshape copies), MQA
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qk_layernorm_sites_match_the_ledger(megatron_one_rank, dtype, groups):
    """qk-layernorm: the q/k norm inputs (per head), the norms' statistics and the fused QKV
    output held through them, and under GQA the repeated K/V of the stock attention."""
    measured = _stock_layer_ledger(dtype, 0.0, spec=T.local_layer_spec(qk_layernorm=True),
                                   qk_layernorm=True, num_query_groups=groups)
    predicted = _analytic(dtype, 0.0, DeviceModel.cpu(), qk_layernorm=True, num_query_groups=groups)
    _norm_stats_at_the_input(predicted)
    print(f"{dtype} groups {groups}: ", {k: (predicted[k], measured.get(k)) for k in predicted})
    assert measured == predicted
    d, g = H // A, groups or A
    stats = 2 * 4 * S * B  # LayerNorm's mean and rstd per (token, head) row, fp32
    assert measured["attn.k_norm_input"] == stats * g  # its input is a view of the QKV buffer
    assert measured["attn.q_norm_input"] - stats * A == (S * B * A * d * torch.empty(
        (), dtype=DTYPES[dtype]).element_size() if 1 < g < A else 0)
