"""Codec-level companions of the broken codecs (`tests.patches.broken_codec`): the codec
unit tests, run with every codec object broken (`broken_codec.everywhere`), fail -- each
sabotage kind fails at least one of them. The tests are called as they are (imported from
their files), so a weakened unit test shows up here.

Which unit test catches what (measured with `LLM_ACT_TEST_SABOTAGE=<kind> pytest -p
tests.patches.broken_codec tests/codecs/...`):
- zeros: every round-trip bound (test_int_quant `test_roundtrip_within_bound`), fewbit's
  table lookup, outlier_int4's exact outlier channels;
- round_down: the unbiasedness tests (the mean of 200 decodes, and the signed mean of the
  normalised errors; outlier_int4's mean of 800 decodes; dual's, given its LFC);
- constant_derivative: fewbit's `test_decode_is_the_table_lookup_of_x` (equality);
- drop_outliers: `test_outlier_channels_are_found_and_recovered_exactly` (slots and exact
  values) and `test_outlier_separation_beats_plain_int4_on_outlier_channels`.
"""
from __future__ import annotations

import pytest
import torch

from tests.codecs import test_dual, test_fewbit, test_int_quant, test_outlier
from tests.patches import broken_codec

CASES = [
    ("zeros", lambda: test_int_quant.test_roundtrip_within_bound("int4", torch.float32)),
    ("zeros", lambda: test_fewbit.test_decode_is_the_table_lookup_of_x("gelu", 3)),
    ("zeros", lambda: test_outlier.test_outlier_channels_are_found_and_recovered_exactly(torch.float32)),
    ("round_down", lambda: test_int_quant.test_stochastic_rounding_is_unbiased("int4")),
    ("round_down", lambda: test_int_quant.test_stochastic_rounding_is_unbiased("int8")),
    ("round_down", test_dual.test_unbiased_given_the_lfc),
    ("constant_derivative", lambda: test_fewbit.test_decode_is_the_table_lookup_of_x("gelu", 3)),
    ("constant_derivative", lambda: test_fewbit.test_decode_is_the_table_lookup_of_x("silu", 1)),
    ("drop_outliers", lambda: test_outlier.test_outlier_channels_are_found_and_recovered_exactly(torch.float32)),
    ("drop_outliers", test_outlier.test_outlier_separation_beats_plain_int4_on_outlier_channels),
]
IDS = ["zeros-int_quant-roundtrip", "zeros-fewbit-lookup", "zeros-outlier-exact",
       "round_down-int4-unbiased", "round_down-int8-unbiased",
       "round_down-dual-unbiased", "constant_derivative-gelu3-lookup",
       "constant_derivative-silu1-lookup", "drop_outliers-outlier-exact",
       "drop_outliers-outlier-separation"]


@pytest.mark.parametrize("kind,unit_test", CASES, ids=IDS)
def test_a_unit_test_fails_with_a_broken_codec(kind, unit_test):
    """(Healthy, each passes in its own file.)"""
    with broken_codec.everywhere(kind), pytest.raises(AssertionError):
        unit_test()


def test_every_kind_is_covered():
    assert {kind for kind, _ in CASES} == set(broken_codec.KINDS)


@pytest.mark.parametrize("kind", broken_codec.KINDS)
def test_everywhere_breaks_only_what_it_applies_to_and_undoes(kind):
    """The sabotage reaches codecs built any way, leaves the others alone, and is undone."""
    from llm_act.codecs import make_codec

    x = torch.randn(64, 256)
    x[:, 5] *= 40
    for name in ("int4", "outlier_int4", "fewbit3", "fp8_e4m3"):
        healthy = make_codec(name, seed=3).roundtrip(x)
        with broken_codec.everywhere(kind):
            codec = make_codec(name, seed=3)
            got = codec.roundtrip(x)
        assert broken_codec.applies(codec, kind) == (not torch.equal(got, healthy)), (name, kind)
        assert torch.equal(make_codec(name, seed=3).roundtrip(x), healthy)
