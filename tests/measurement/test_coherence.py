"""The coherence kappa of a biased codec (issue 28 item 3): the squared gradient error it
really adds, over what GACT's noise model predicts for independent errors of its size.

Stochastic rounding gives 1 on average (the model holds); an error that leans the same way
on every token adds up in a weight gradient and gives more: rounding that always rounds
down (the sabotage kind "round_down", measured about 2.3: the gradients it meets are nearly
zero-mean over tokens, which keeps a constant offset from adding up fully) must be charged
for it. Real megatron-core GPT on one CPU rank."""
from __future__ import annotations

import statistics
import warnings

import pytest

from llm_act.measurement.measured_profile import charged_error
from llm_act.codecs.registry import make_codec
from llm_act.measurement import linear_tap, sensitivity
from llm_act.measurement.sensitivity import measure_sensitivity
from tests.measurement.test_sensitivity import _gpt
from tests.patches.broken_codec import ROUND_DOWN, break_codec

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

SITES = ["mlp.fc2_input", "ln1.input"]


def _kappas(controller, fwd, model, name: str, seeds=range(4)) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {s: [] for s in SITES}
    for seed in seeds:
        sens = measure_sensitivity(controller, fwd, model, sites=SITES, sampling=False, seed=seed,
                                   biased={s: name for s in SITES})
        for s in SITES:
            out[s].append(sens.coherence[s])
    return out


def test_stochastic_rounding_is_charged_about_one_and_a_biased_rounding_much_more(monkeypatch):
    model, controller, fwd = _gpt()
    fair = _kappas(controller, fwd, model, "int4")
    # the codec measured for coherence rounds always down; the probes that measure c stay healthy
    # (at a linear's input the exact pass's tap measures it: its codec is broken there)
    healthy = sensitivity._Recording.__init__
    monkeypatch.setattr(sensitivity._Recording, "__init__", lambda self, inner, *a:
                        healthy(self, break_codec(inner, ROUND_DOWN), *a))
    monkeypatch.setattr(linear_tap, "make_codec", lambda *a, **k: break_codec(make_codec(*a, **k), ROUND_DOWN))
    leaning = _kappas(controller, fwd, model, "int4")
    for site in SITES:
        print(f"{site}: kappa stochastic {fair[site]}, always rounding down {leaning[site]}")
    for site in SITES:
        assert 0.7 < statistics.mean(fair[site]) < 1.5, fair
        # measured: 2.3x at mlp.fc2_input, 2.0x at ln1.input
        assert statistics.mean(leaning[site]) > 1.6 * statistics.mean(fair[site]), (fair, leaning)


def test_a_nearest_rounding_codec_is_measured_and_only_biased_codecs_are_charged():
    model, controller, fwd = _gpt()
    sens = measure_sensitivity(controller, fwd, model, sites=SITES, sampling=False,
                               biased={"mlp.fc2_input": "int4_channel", "ln1.input": "fp8_e4m3"})
    assert set(sens.coherence) == set(SITES) and all(k > 0 for k in sens.coherence.values())
    kappa = {"mlp.fc2_input": 3.0}
    assert charged_error(0.01, "mlp.fc2_input", "int4_channel", kappa) == pytest.approx(0.03)
    assert charged_error(0.01, "mlp.fc2_input", "int4", kappa) == 0.01  # unbiased: GACT's model
    assert charged_error(0.01, "attn.out", "int4_channel", kappa) == 0.01  # not measured: 1
    assert charged_error(0.01, "mlp.fc2_input", "int4_channel", None) == 0.01


def test_at_a_site_whose_backward_is_not_linear_every_lossy_codec_is_charged():
    """Issue 42: stochastic rounding leaves the gradient unbiased only where the backward is
    linear in the stored tensor. At Q and K (through the softmax), a norm's input and the
    activation's input an unbiased rounding is charged its site's coherence as nearest
    rounding is; at a linear's input it is not; an exact mask codec never is."""
    from llm_act.codecs.registry import unbiased_at
    from llm_act.sites import LINEAR_BACKWARD

    kappa = {"attn.q": 4.0, "attn.k": 4.0, "ln1.input": 2.0, "mlp.act_input": 3.0, "attn.v": 5.0,
             "attn.qkv_input": 6.0}
    for site in ("attn.q", "attn.k", "ln1.input", "mlp.act_input"):
        assert site not in LINEAR_BACKWARD
        for name in ("int1", "int2", "int4", "outlier_int4", "int4_channel"):
            assert not unbiased_at(name, site)
            assert charged_error(0.01, site, name, kappa) == pytest.approx(0.01 * kappa[site])
    for site in ("attn.v", "attn.qkv_input"):  # linear: probs @ V, a linear's input
        assert charged_error(0.01, site, "int2", kappa) == 0.01
        assert charged_error(0.01, site, "int4_channel", kappa) == pytest.approx(0.01 * kappa[site])
    assert unbiased_at("regen", "attn.dropout_mask") and unbiased_at("bitmask", "mlp.hidden_dropout_mask")
