"""The final norm's input (`llm_act.sites.FINAL_NORM_INPUT`), the one planned site after the
blocks, on a real 2-layer megatron-core GPT on CPU: `apply` swaps the decoder's final norm for
`ActLayerNorm` bound to the site as part of the last layer's plan; "keep" is stock bit for
bit; a compressed choice stores less, at the site, and stays within a gradient bound that a
codec decoding zeros there breaks; plan "recompute" keeps it; fixed JSON plans name it; the
measured profile prices it as a block of its own, whose choice returns to the last layer."""
from __future__ import annotations

import json

import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply, layer_spec
from llm_act.patches.megatron.spec import block_spec
from llm_act.plan import plan_json
from llm_act.sites import FINAL_NORM_INPUT, LN1_INPUT
from tests.patches import broken_codec
from tests import gpt_runs as R

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

LAST = 1  # the last of the two layers: its plan carries the final norm's choice
#: the gradient bound of a compressed final norm against keeping it (same attention, fp32):
#: outlier_int4 there measured 0.024 total, 0.12 at the worst parameter (the final norm's
#: weight); a codec decoding zeros there: 0.11 total, 1.03 at that weight
TOTAL, EACH = 0.1, 0.3


def _run(config: ActConfig, dtype=torch.float32):
    model = R.build(dtype=dtype, dropout=0.0)
    ctl = apply(model, config)
    loss, grads, led = R.step(model, ledger=True)
    return ctl, model, loss, grads, led


def test_apply_binds_the_final_norm_as_a_site_of_the_last_layer():
    ctl, model, _, _, _ = _run(ActConfig(plan="compress"))
    norm = model.decoder.final_layernorm
    assert type(norm).__name__ == "ActLayerNorm" and norm.act_site == FINAL_NORM_INPUT
    assert ctl.sites(LAST)[-1] == FINAL_NORM_INPUT and FINAL_NORM_INPUT not in ctl.sites(0)
    assert ctl.module(LAST, FINAL_NORM_INPUT) is norm
    # "compress": the default codec of the block's norm inputs
    assert ctl.codec(LAST, FINAL_NORM_INPUT).name == ctl.codec(LAST, LN1_INPUT).name == "outlier_int4"
    ctl.set_plan("keep")
    assert ctl.codec(LAST, FINAL_NORM_INPUT) is None and norm.act_codecs[FINAL_NORM_INPUT] is None
    # Megatron's full recompute keeps it: the block's recompute never covers what follows it
    ctl.set_plan("recompute")
    assert ctl.plan[LAST][FINAL_NORM_INPUT] == "keep" and norm.act_codecs[FINAL_NORM_INPUT] is None
    with pytest.raises(ValueError, match="cannot be recomputed"):
        ctl.set_plan({LAST: {FINAL_NORM_INPUT: "recompute"}})


def test_keep_is_stock_bit_for_bit_and_the_ledger_books_the_site():
    stock = R.build(dropout=0.1)
    loss0, grads0, led0 = R.step(stock, ledger=True)
    model = R.build(dropout=0.1)
    apply(model, ActConfig(plan="keep"))
    loss1, grads1, led1 = R.step(model, ledger=True)
    assert torch.equal(loss0, loss1)
    R.assert_same(grads0, grads1)
    # the final norm's input and its statistics, at the site of the last layer, not "loss.logits"
    sbh = R.SEQ * R.BATCH * model.config.hidden_size
    assert led0.by_site()[(LAST, FINAL_NORM_INPUT)] == led1.by_site()[(LAST, FINAL_NORM_INPUT)] \
        == sbh * 4 + R.SEQ * R.BATCH * 8  # fp32 input, fp32 mean and rstd per row
    assert led1.by_site() == led0.by_site()
    # a model built from the block spec carries our norm there already, bound by apply
    spec_model = R.build(dropout=0.1, spec=block_spec(ActConfig(), model.config))
    assert spec_model.decoder.final_layernorm.act_site == FINAL_NORM_INPUT
    ctl = apply(spec_model, ActConfig(plan="keep"))
    assert ctl.module(LAST, FINAL_NORM_INPUT) is spec_model.decoder.final_layernorm
    _, grads2, _ = R.step(spec_model)
    R.assert_same(grads0, grads2)
    # the layer spec alone leaves the final norm to GPTModel; apply converts it
    ctl = apply(R.build(dropout=0.1, spec=layer_spec(ActConfig())), ActConfig(plan="keep"))
    assert FINAL_NORM_INPUT in ctl.sites(LAST)


def _final_only(codec: str = "outlier_int4") -> ActConfig:
    return ActConfig(plan="keep", attention="chunked", codecs={FINAL_NORM_INPUT: codec})


def test_a_compressed_final_norm_stores_less_within_the_bound():
    _, _, _, ref, led_ref = _run(ActConfig(plan="keep", attention="chunked"))
    ctl, _, _, grads, led = _run(_final_only())
    assert ctl.codec(LAST, FINAL_NORM_INPUT).name == "outlier_int4"
    assert ctl.codec(LAST, LN1_INPUT) is None
    assert 0 < led.by_site()[(LAST, FINAL_NORM_INPUT)] < led_ref.by_site()[(LAST, FINAL_NORM_INPUT)] / 3
    other = {k: v for k, v in led.by_site().items() if k[1] != FINAL_NORM_INPUT}
    assert other == {k: v for k, v in led_ref.by_site().items() if k[1] != FINAL_NORM_INPUT}
    assert R.rel_error(grads, ref) > 0  # the site is live
    R.check_gradients(grads, ref, TOTAL, EACH)


def test_the_bound_fails_with_a_broken_codec_at_the_final_norm():
    _, _, _, ref, _ = _run(ActConfig(plan="keep", attention="chunked"))
    with broken_codec.broken(FINAL_NORM_INPUT, LAST) as count:
        _, _, _, grads, _ = _run(_final_only())
        assert count() == 1
    with pytest.raises(AssertionError, match="relative"):
        R.check_gradients(grads, ref, TOTAL, EACH)


def test_a_json_plan_names_the_final_norm(tmp_path):
    plan = {0: {}, LAST: {FINAL_NORM_INPUT: "int8"}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json({i: dict(c) for i, c in plan.items()})))
    ctl, _, _, _, led = _run(ActConfig(plan=str(path)))
    assert ctl.codec(LAST, FINAL_NORM_INPUT).name == "int8"
    assert all(ctl.plan[LAST][s] == "keep" for s in ctl.sites(LAST) if s != FINAL_NORM_INPUT)
    sbh = R.SEQ * R.BATCH * 64
    assert led.by_site()[(LAST, FINAL_NORM_INPUT)] < sbh * 2  # int8 of an fp32 tensor, + scales


def test_the_measured_profile_prices_it_as_a_block_of_its_own():
    """Measured as a site of the last layer; planned as its own block (the two layers stay one
    class, and whole-block recompute of the last layer does not cover it); the solver's
    choice returns to the last layer's plan."""
    from llm_act.measurement.measure import measure_profile
    from llm_act.planner import solve_plan
    from llm_act.planner.milp import InfeasibleBudget

    model = R.build(dropout=0.0)
    ctl = apply(model, ActConfig(plan="compress"))
    ids, pos, labels = R.batch()
    profile = measure_profile(ctl, lambda: model(ids, pos, None, labels=labels), repeats=1)
    st = profile.sites[(LAST, FINAL_NORM_INPUT)]
    assert st.keep_bytes == R.SEQ * R.BATCH * (64 * 4 + 8) and "outlier_int4" in st.options
    assert st.forward_ms is None  # never recomputed
    assert st.options["outlier_int4"].encode_ms > 0  # timed itself (a block of its own)
    assert profile.block_layers() == [[0, LAST], [LAST]]
    blocks = profile.blocks(recompute=True)
    assert [b.count for b in blocks] == [2, 1]
    assert [s.name for s in blocks[1].sites] == [FINAL_NORM_INPUT] and blocks[1].full_ms is None
    # a budget only met by compressing the final norm too: the least one is every site at
    # its smallest, the final norm included
    try:
        solve_plan(blocks, 0)
    except InfeasibleBudget as err:
        least = err.min_budget_bytes
    plan = profile.plan_from(solve_plan(blocks, least))
    assert plan[LAST][FINAL_NORM_INPUT] not in ("keep", "recompute")
    assert FINAL_NORM_INPUT not in plan[0]
    # with the site pinned (`ActConfig.codecs`) it leaves the problem, and the rest still aligns
    pinned = profile.blocks(exclude=(FINAL_NORM_INPUT,))
    assert len(pinned) == 1 and profile.block_layers(exclude=(FINAL_NORM_INPUT,)) == [[0, LAST]]
    assert sorted(profile.plan_from(solve_plan(pinned, 10**12), exclude=(FINAL_NORM_INPUT,))) == [0, LAST]
