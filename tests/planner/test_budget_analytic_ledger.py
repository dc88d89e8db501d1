"""The analytic profile of a stock block against the ledger on a real stock megatron-core
`TransformerLayer` (local spec, CPU, one rank): every site, byte for byte, in fp32 and bf16,
with and without dropout. `llm-act plan` sizes budgets from these counts, so a site it
under-counts is a budget that fails in training.

The differences between CPU and a GPU are modelled, not tolerated: `DeviceModel.cpu()` has no
fused softmax kernel (the torch path stores an fp32 softmax beside the 16-bit probabilities)
and torch's CPU dropout keeps its mask in the model dtype (CUDA's: bool). Two differences
of attribution remain, each checked exactly: a norm's fp32 statistics, which the ledger books
at the norm's input and the analytic profile with its output (recomputing that output drops
them); without RoPE, Q, K and V are views of the fused QKV output, which the ledger counts
once at `attn.q`; and the [s, s] bool causal mask the softmax saves is megatron's, built
outside the layer's sites (one storage for every layer).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act import testing as T
from llm_act.ledger import SavedTensorLedger
from llm_act.planner.analytic import DeviceModel, ModelShape, block_profile

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

S, B, H, A = 32, 2, 64, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _analytic(dtype: str, dropout: float, device: DeviceModel) -> dict[str, int]:
    shape = ModelShape(1, H, A, S, B, dtype=dtype, dropout=dropout, attention="stock")
    return {site.name: site.nbytes for site in block_profile(shape, device).sites}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_analytic_site_matches_the_ledger_on_a_stock_layer(megatron_one_rank, dtype, dropout):
    config = T.small_config(hidden_size=H, num_attention_heads=A, num_layers=1,
                            dtype=DTYPES[dtype], dropout=dropout)
    layer = T.transformer_layer(config)
    x = torch.randn(S, B, H, dtype=DTYPES[dtype], requires_grad=True)
    with SavedTensorLedger() as ledger:
        out = layer(x, attention_mask=None)
    measured = {site: n for (_, site), n in ledger.by_site().items()}
    del out
    assert measured.pop("other") == S * S  # the bool causal mask: megatron's, outside the sites
    predicted = _analytic(dtype, dropout, DeviceModel.cpu())
    predicted["attn.q"] += predicted.pop("attn.k") + predicted.pop("attn.v")  # one QKV buffer
    stats = 2 * 4 * S * B  # LayerNorm's mean and rstd, fp32 per row
    for norm_input, norm_output in (("ln1.input", "attn.qkv_input"), ("ln2.input", "mlp.fc1_input")):
        predicted[norm_input] += stats
        predicted[norm_output] -= stats
    print(f"{dtype} dropout {dropout}: ", {k: (predicted[k], measured.get(k)) for k in predicted})
    assert measured == predicted
    # the softmax site is the unfused path's fp32 softmax + the probabilities probs @ V reads
    e = torch.empty((), dtype=DTYPES[dtype]).element_size()
    scores = B * A * S * S
    assert measured["attn.softmax"] == scores * (4 + (e if dropout or e != 4 else 0))
    if dropout:
        assert measured["attn.dropout_mask"] == scores * e  # a CPU mask in the model dtype


def test_on_a_gpu_stock_attention_keeps_5as2b_in_16_bits():
    """Korthikanti et al.: softmax output (2 bytes), dropout mask (1) and the dropped
    probabilities (2) per score; the CPU figures above differ by exactly the modelled terms."""
    scores = B * A * S * S
    gpu = _analytic("bf16", 0.1, DeviceModel())
    assert gpu["attn.softmax"] + gpu["attn.dropout_mask"] == 5 * scores
    cpu = _analytic("bf16", 0.1, DeviceModel.cpu())
    assert cpu["attn.softmax"] - gpu["attn.softmax"] == 2 * scores  # the fp32 softmax, not 16-bit
    assert cpu["attn.dropout_mask"] - gpu["attn.dropout_mask"] == scores  # bf16 mask, not bool
    for site in ("attn.hidden_dropout_mask", "mlp.hidden_dropout_mask"):
        assert cpu[site] == 2 * gpu[site] == 2 * S * B * H
    assert {k: v for k, v in cpu.items() if "dropout" not in k and k != "attn.softmax"} == \
        {k: v for k, v in gpu.items() if "dropout" not in k and k != "attn.softmax"}
    # without dropout, the fused kernel's 16-bit probabilities are the one stored tensor
    assert _analytic("bf16", 0.0, DeviceModel())["attn.softmax"] == 2 * scores
