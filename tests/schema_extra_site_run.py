"""Run by tests/test_block_schema.py in a fresh process: declare one extra site in the block
schema alone, then build a real GPT whose layers have it and see every consumer pick it up.

The extra site is the input of megatron-core's `pre_cross_attn_layernorm`: an identity in
the local GPT spec, a real LayerNorm here (the residual stream after self-attention is
normalised once more before the MLP's own norm). Its layer class is the existing `ActNorm`;
nothing but the schema names the site.

    python -m tests.schema_extra_site_run

prints one JSON object (see `main`).
"""
from __future__ import annotations

import json
import warnings

import torch

from llm_act.sites import Site, Tag, declare

EXTRA = "attn.cross_norm_input"
SLOT = "pre_cross_attn_layernorm"

# the schema alone: declared before any consumer is imported, as if BLOCK listed it
declare(Site(EXTRA, SLOT, "norm", "replicated", "activation", lambda x: (x.sl, x.b, x.h),
             "int8", "attention", (Tag("input", SLOT), Tag("owns", SLOT))))

from llm_act import ActConfig  # noqa: E402
from llm_act.measurement.measure import measure_profile  # noqa: E402
from llm_act.patches.megatron import apply  # noqa: E402
from llm_act.planner.analytic import block_profile  # noqa: E402
from llm_act.planner.model_shape import ModelShape  # noqa: E402
from llm_act.train.small_gpt import local_layer_spec  # noqa: E402
from tests import testing as T  # noqa: E402
from tests import gpt_runs as R  # noqa: E402


def spec_with_cross_norm():
    spec = local_layer_spec()
    spec.submodules.pre_cross_attn_layernorm = spec.submodules.input_layernorm
    return spec


def ledger_bytes(led, site: str) -> dict[int, int]:
    return {layer: n for (layer, name), n in led.by_site().items() if name == site}


def main() -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    T.init_parallel(tp=1)
    out: dict = {}
    stock = R.build(dropout=0.0, num_layers=2, spec=spec_with_cross_norm())
    _, stock_grads, stock_led = R.step(stock, ledger=True)
    out["stock_ledger"] = ledger_bytes(stock_led, EXTRA)
    out["stock_total"] = stock_led.total_bytes

    model = R.build(dropout=0.0, num_layers=2, spec=spec_with_cross_norm())
    controller = apply(model, ActConfig(plan="keep"))
    out["controller_sites"] = [list(controller.sites(layer)) for layer in sorted(controller.layers)]
    _, keep_grads, keep_led = R.step(model, ledger=True)
    out["keep_identical"] = all(torch.equal(stock_grads[n], keep_grads[n]) for n in stock_grads)
    out["keep_ledger"] = ledger_bytes(keep_led, EXTRA)
    out["keep_total"] = keep_led.total_bytes

    ids, pos, labels = R.batch(1)
    profile = measure_profile(controller, lambda: model(ids, pos, None, labels=labels))
    out["measured"] = {layer: stats.keep_bytes for (layer, name), stats in profile.sites.items()
                       if name == EXTRA}

    for plan in ("compress", "recompute"):
        controller.set_plan(plan)
        _, grads, led = R.step(model, ledger=True)
        out[f"{plan}_ledger"] = ledger_bytes(led, EXTRA)
        out[f"{plan}_finite"] = all(bool(torch.isfinite(g).all()) for g in grads.values())
        out[f"{plan}_grad_rel_error"] = max(
            float((grads[n] - stock_grads[n]).norm() / stock_grads[n].norm().clamp_min(1e-12))
            for n in stock_grads)

    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=R.SEQ,
                       micro_batch_size=R.BATCH, vocab_size=R.VOCAB, dtype="fp32")
    prof = block_profile(shape)
    site = next((s for s in prof.sites if s.name == EXTRA), None)
    out["analytic"] = None if site is None else site.nbytes
    out["analytic_expected"] = R.SEQ * R.BATCH * 64 * 4
    return out


if __name__ == "__main__":
    print(json.dumps(main(), default=str))
