"""The registry builds every codec the design brief names, with the brief's parameters."""
import pytest
import torch

from llm_act.codecs import CODEC_NAMES, check_choice, make_codec
from llm_act.sites import DEFAULT_CODECS, MASK_SITES, SITES

BRIEF_NAMES = [
    "int1", "int2", "int4", "int8", "int4_sym", "int8_sym", "int4_asym", "int4_channel",
    "outlier_int4", "dual2", "fp8_e4m3", "fp8_e5m2", "fewbit1", "fewbit2", "fewbit3", "fewbit4",
    "bitmask", "regen",
]


def test_every_brief_name_is_registered():
    assert sorted(CODEC_NAMES) == sorted(BRIEF_NAMES)


@pytest.mark.parametrize("name", [n for n in BRIEF_NAMES if n != "regen"])
def test_each_codec_round_trips_a_tensor(name):
    codec = make_codec(name, seed=3)
    assert codec.name == name
    if name == "bitmask":
        x = (torch.rand(3, 5, 64) > 0.3).float()
    else:
        x = torch.randn(3, 5, 64)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert 0 < enc.nbytes < x.numel() * x.element_size()


def test_intquant_parameters_match_the_brief():
    from llm_act.codecs import IntQuant

    for name, (bits, sym, sr, axis) in {
        "int1": (1, False, True, None), "int2": (2, False, True, None), "int4": (4, False, True, None),
        "int8": (8, False, True, None), "int4_sym": (4, True, False, None),
        "int8_sym": (8, True, False, None), "int4_asym": (4, False, False, None),
        "int4_channel": (4, True, False, -1),
    }.items():
        c = make_codec(name)
        assert isinstance(c, IntQuant)
        assert (c.bits, c.symmetric, c.stochastic, c.axis, c.group_size) == (bits, sym, sr, axis, 128)


def test_default_codecs_are_allowed_at_their_sites():
    assert set(DEFAULT_CODECS) == set(SITES)
    for site, name in DEFAULT_CODECS.items():
        assert check_choice(site, name) == name
    for site in MASK_SITES:
        assert DEFAULT_CODECS[site] == "regen"


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="int3.*known codecs"):
        make_codec("int3")


def test_codec_generators_are_seeded_from_the_seed_alone():
    """Not from the device index: tensor-parallel ranks on cuda:0..7 building a codec with
    one seed must draw the same stochastic rounding (see test_replica_seeds_dist)."""
    codec = make_codec("int2", seed=77)
    want = torch.rand(8, generator=torch.Generator().manual_seed(77))
    assert torch.equal(torch.rand(8, generator=codec.generator(torch.device("cpu"))), want)


def test_unbiased_codecs_are_the_stochastic_and_the_exact_ones():
    """`UNBIASED_CODECS` (what plan "auto" may choose under a noise budget with
    biased_codecs="exclude") is derived from the codecs themselves: stochastic rounding, or
    lossless masks."""
    from llm_act.codecs.registry import MASK_CODECS, UNBIASED_CODECS

    assert UNBIASED_CODECS == {n for n in CODEC_NAMES if make_codec(n).stochastic} | MASK_CODECS
    assert {"int4_channel", "fp8_e4m3", "fewbit3", "int4_asym"}.isdisjoint(UNBIASED_CODECS)


def test_one_rule_decides_what_a_layer_accepts():
    """`refusal` / `accepts` (issue 41): few-bit codecs only where the MLP's derivative depends
    on x alone; a gated unit, ReLU (its mask) and a block whose MLP is unknown take value
    codecs; the schema's own refusals come through; the message names the fix."""
    from llm_act.codecs.registry import (CODEC_NAMES, FEWBIT_CODECS, MLP_FEWBIT, MLP_MASK, MLP_VALUE,
                                         accepts, refusal)
    from llm_act.planner.model_shape import ModelShape

    for name in FEWBIT_CODECS:
        assert accepts("mlp.act_input", name, MLP_FEWBIT)
        for kind in (MLP_VALUE, MLP_MASK, None):
            why = refusal("mlp.act_input", name, kind)
            assert why is not None and "value codec such as 'outlier_int4'" in why and "\n" not in why
        assert not accepts("attn.q", name, MLP_FEWBIT)  # the schema: few-bit is mlp.act_input's
    value_codecs = [n for n in CODEC_NAMES if n not in FEWBIT_CODECS and n not in ("bitmask", "regen")]
    for kind in (MLP_FEWBIT, MLP_VALUE, MLP_MASK, None):
        assert all(accepts("mlp.act_input", n, kind) for n in value_codecs)
        assert not accepts("mlp.act_input", "regen", kind) and accepts("attn.dropout_mask", "regen", kind)
    shape = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, micro_batch_size=1)
    assert ModelShape(**shape).mlp_kind == MLP_FEWBIT
    assert ModelShape(**shape, gated_linear_unit=True, activation="silu").mlp_kind == MLP_VALUE
    assert ModelShape(**shape, activation="relu").mlp_kind == MLP_MASK
