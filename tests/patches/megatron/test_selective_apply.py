"""Megatron's "selective" recompute through the public `apply()` on a real megatron-core GPT
(CPU, TP=1).

Selective recompute (`llm_act.plan.selective_layer()`: `attn.softmax` and
`attn.dropout_mask` recomputed, every other site kept) re-runs the core attention in backward
from the kept q, k, v under the RNG state recorded in forward, so it is exact: the loss, every
gradient and the RNG state after the step are bit-identical to plan "keep" (stock
megatron-core) for the same seeds and batch, with attention dropout on and off. The ledger
shows the softmax (and the attention-dropout mask) no longer stored and every other site
stored as under "keep".

Whichever way the plan is asked for -- per-site overrides on "keep", a JSON plan with
`selective_layer()` for every layer, or the plan name "selective" -- it goes through the
Controller binding every layer (`apply`, which converts the core attention), the path that
used to raise in backward ("'recompute' needs the layer's forward to run through the
TransformerLayer").
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply
from llm_act.plan import keep_layer, resolve, selective_layer
from llm_act.sites import ATTENTION_INTERNAL_SITES
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

# megatron-core on one gloo rank, one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("megatron_one_rank")

LAYERS = 2
SELECTIVE_OVERRIDES = {site: "recompute" for site in ATTENTION_INTERNAL_SITES}


def _selective_configs(tmp_path) -> dict[str, ActConfig]:
    path = tmp_path / "selective.json"
    path.write_text(json.dumps(
        {"version": 1, "blocks": [{"layers": [0, LAYERS - 1], "choice": selective_layer()}]}))
    return {
        "overrides": ActConfig(plan="keep", codecs=dict(SELECTIVE_OVERRIDES), attention="stock"),
        "json": ActConfig(plan=str(path), attention="stock"),
        "name": ActConfig(plan="selective", attention="stock"),
    }


def _run(config, dropout):
    """(loss, grads, ledger by site, RNG state after) of one step of a fresh seeded GPT."""
    model = R.build(dropout=dropout, num_layers=LAYERS)
    ctl = apply(model, config)
    loss, grads, led = R.step(model, ledger=True)
    return ctl, (loss, grads, led.by_site(), torch.get_rng_state())


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
def test_selective_through_apply_is_bit_identical_to_keep(dropout, tmp_path):
    _, (loss0, grads0, stored0, rng0) = _run(ActConfig(plan="keep"), dropout)
    for layer in range(LAYERS):
        assert stored0[(layer, "attn.softmax")] > 0  # stock keeps the softmax
        if dropout > 0:
            assert stored0[(layer, "attn.dropout_mask")] > 0
    for how, config in _selective_configs(tmp_path).items():
        ctl, (loss, grads, stored, rng) = _run(config, dropout)
        assert ctl.plan == {i: selective_layer() for i in range(LAYERS)}, how
        assert ctl.attention_mode() == "stock", how
        assert torch.equal(loss, loss0), how
        R.assert_same(grads0, grads)
        assert torch.equal(rng, rng0), how  # the same RNG consumption as stock
        # the recomputed sites store nothing; every other site exactly what "keep" stores
        for layer in range(LAYERS):
            for site in ATTENTION_INTERNAL_SITES:
                assert stored.get((layer, site), 0) == 0, (how, layer, site, stored)
        assert stored == {k: n for k, n in stored0.items() if k[1] not in ATTENTION_INTERNAL_SITES}, how
        assert sum(stored.values()) < sum(stored0.values()), how


def test_selective_then_keep_through_the_controller():
    """Switching selective -> keep -> selective through the Controller: each step equals stock."""
    _, (loss0, grads0, _, _) = _run(ActConfig(plan="keep"), 0.1)
    model = R.build(dropout=0.1, num_layers=LAYERS)
    ctl = apply(model, ActConfig(plan="keep", attention="stock"))
    for plan in ("selective", "keep", "selective"):
        ctl.set_plan(plan)
        with ctl.step():
            assert ctl.plan[0] == (selective_layer() if plan == "selective" else keep_layer()), plan
            loss, grads, _ = R.step(model)
        assert torch.equal(loss, loss0), plan
        R.assert_same(grads0, grads)


def test_plan_name_selective_resolves_to_selective_layers():
    assert resolve(ActConfig(plan="selective"), 3) == {i: selective_layer() for i in range(3)}
    assert resolve(ActConfig(plan="selective"), 4, layers=[2, 3]) == {2: selective_layer(), 3: selective_layer()}
    with_codec = resolve(ActConfig(plan="selective", codecs={"mlp.fc1_input": "int8"}), 2)
    assert with_codec == {i: {**selective_layer(), "mlp.fc1_input": "int8"} for i in range(2)}
