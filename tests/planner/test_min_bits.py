"""Plan "auto"'s floor on the bits per stored value (`ActConfig.min_bits`, issue 42): the
MILP of a real run and the first step's analytic check offer no codec below it (INT1, INT2,
dual2 at the default 4), every codec at 1, and a fixed plan or a pin is not limited."""
from __future__ import annotations

import pytest

from llm_act.codecs.registry import CODEC_NAMES, VALUE_BITS, has_bits
from llm_act.planner.analytic import ModelShape, block_profile

LOW = {"int1", "int2", "dual2"}


def _offered(blocks) -> set[str]:
    return {o.name for b in blocks for s in b.sites for o in s.codecs}


def test_value_bits_names_every_value_codec_and_nothing_else():
    assert set(VALUE_BITS) <= set(CODEC_NAMES)
    assert {n for n in CODEC_NAMES if n not in VALUE_BITS} == {"fewbit1", "fewbit2", "fewbit3", "fewbit4",
                                                                "bitmask", "regen"}
    assert {n for n, b in VALUE_BITS.items() if b < 4} == LOW
    assert all(has_bits(n, 8) for n in ("keep", "recompute", "regen", "fewbit1"))  # store no value


def test_the_analytic_block_drops_the_codecs_below_the_floor():
    block = block_profile(ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                     micro_batch_size=2))
    assert LOW <= _offered([block])
    assert not LOW & _offered([block.with_min_bits(4)])
    assert _offered([block.with_min_bits(1)]) == _offered([block])
    assert {n for n in _offered([block.with_min_bits(8)]) if n in VALUE_BITS} == {"int8", "int8_sym", "fp8_e4m3", "fp8_e5m2"}


@pytest.mark.usefixtures("megatron_one_rank")
@pytest.mark.parametrize("min_bits,low_offered", [(4, False), (1, True)])
def test_auto_offers_no_codec_below_the_floor(min_bits, low_offered):
    from tests.runtime.test_controller_adapt import _setup, _train

    model, controller, opt, gen = _setup(budget=10**9, min_bits=min_bits)
    _train(model, controller, opt, gen, 2)
    a = controller.adapter
    blocks, _ = a.problem(a.measured.profile)
    assert bool(LOW & _offered(blocks)) == low_offered
    chosen = {n for choice in controller.plan.values() for n in choice.values()}
    if not low_offered:
        assert not LOW & chosen
    # the first step's analytic check plans with the same floor
    assert controller.config.min_bits == min_bits


@pytest.mark.usefixtures("megatron_one_rank")
def test_a_fixed_plan_and_a_pin_are_not_limited():
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply
    from tests import gpt_runs as R

    model = R.build(dropout=0.0, num_layers=2, seed=0)
    ctl = apply(model, ActConfig(plan="compress", codecs={"attn.v": "int2"}))
    assert all(choice["attn.v"] == "int2" for choice in ctl.plan.values())
