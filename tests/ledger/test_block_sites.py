"""Inside a transformer block nothing is "other": every tensor a block saves for backward is
booked at a site of that block, for the block designs real models use (Llama: RMSNorm,
SwiGLU, GQA, no biases; Qwen3 / OLMo 2: qk-layernorm too), stock and under `apply` with the
plans "keep" and "compress". What stays `(None, "other")` is saved outside the blocks (token
ids, the loss's bookkeeping): it does not grow with the number of layers.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act.ledger import SavedTensorLedger
from llm_act.sites import FINAL_NORM_INPUT, MODEL_SITES, SITES
from tests import testing as T

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

SILU = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
LLAMA = dict(normalization="RMSNorm", num_query_groups=2, add_bias_linear=False, **SILU)
CONFIGS = {
    "gpt-dropout": dict(dropout=0.1),
    "rmsnorm": dict(normalization="RMSNorm"),
    "swiglu": SILU,
    "gqa": dict(num_query_groups=2),
    "mqa": dict(num_query_groups=1),
    "no-bias": dict(add_bias_linear=False),
    "qk-layernorm": dict(qk_layernorm=True),
    "qk-layernorm-gqa": dict(qk_layernorm=True, num_query_groups=2),
    "llama": LLAMA,
    "qwen3": dict(LLAMA, qk_layernorm=True),
}


def _forward_ledger(num_layers: int, plan, dtype=torch.float32, dropout: float = 0.0, **config_kw):
    """The ledger of one training forward of a small GPT (RoPE, local spec) with `num_layers`."""
    from llm_act.patches.megatron import apply

    torch.manual_seed(0)
    config = T.small_config(num_layers=num_layers, dtype=dtype, dropout=dropout, **config_kw)
    spec = T.local_layer_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    model = T.gpt_model(config, spec=spec)
    if plan is not None:
        apply(model, {"plan": plan, "adapt": False})
    ids, pos, labels = T.gpt_batch(2, 32, generator=torch.Generator().manual_seed(1))
    with SavedTensorLedger() as ledger:
        loss = model(ids, pos, None, labels=labels)
    assert not ledger.errors, ledger.errors
    del loss
    return ledger.by_site()


@pytest.mark.parametrize("plan", [None, "keep", "compress"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_nothing_inside_a_block_is_other(name, plan):
    by = {n: _forward_ledger(n, plan, **CONFIGS[name]) for n in (1, 2)}
    for n, sites in by.items():
        inside = {key for key in sites if key[0] is not None}
        assert {layer for layer, _ in inside} == set(range(n))
        assert all(site in SITES for _, site in inside), sorted(inside)
    # "other" is what the model saves outside its blocks: the same for one block or two
    assert by[1].get((None, "other"), 0) == by[2].get((None, "other"), 0), \
        (by[1].get((None, "other")), by[2].get((None, "other")))
    if plan != "compress":  # (outlier_int4's byte count follows its data)
        # the second block stores what the first does (same shapes, same sites)
        assert {s: n for (layer, s), n in by[2].items() if layer == 1 and s not in MODEL_SITES} == \
            {s: n for (layer, s), n in by[2].items() if layer == 0}
    # the final norm's input: a site of the last layer alone
    assert {key for key in by[2] if key[1] in MODEL_SITES} == {(1, FINAL_NORM_INPUT)}
    if CONFIGS[name].get("qk_layernorm"):
        assert (0, "attn.q_norm_input") in by[1] and (0, "attn.k_norm_input") in by[1]


def _block_bytes(sites) -> int:
    return sum(n for (layer, _), n in sites.items() if layer == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_stores_a_fifth_of_stock_on_a_qk_layernorm_block(dtype):
    """The "compress" plan on a Qwen3-style block (qk-layernorm, RMSNorm, SwiGLU, GQA, no
    biases): at most 0.20 of what the stock block stores, the q/k norm inputs compressed."""
    stock = _forward_ledger(1, None, dtype=dtype, **CONFIGS["qwen3"])
    compressed = _forward_ledger(1, "compress", dtype=dtype, **CONFIGS["qwen3"])
    ratio = _block_bytes(compressed) / _block_bytes(stock)
    print(f"{dtype}: compress / stock per block = {ratio:.4f}")
    assert ratio <= 0.20
    for site in ("attn.q_norm_input", "attn.k_norm_input"):
        assert compressed[(0, site)] < stock[(0, site)]
