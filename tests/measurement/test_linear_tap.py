"""A linear's input sensitivity read off the exact backward (`llm_act.measurement.linear_tap`)
on a real megatron-core GPT (CPU): it agrees with the probe's random-draw estimate of the
same quantity, it saves the probe passes, and it stands aside where it would not be exact."""
from __future__ import annotations

import statistics
import warnings

import pytest

from llm_act.measurement import linear_tap
from llm_act.measurement.sensitivity import measure_sensitivity, sensitive_sites
from llm_act.sites import ATTN_OUT, ATTN_QKV_INPUT, MLP_FC1_INPUT, MLP_FC2_INPUT

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

# megatron-core on one gloo rank (tests/conftest.py); the GPT without dropout, 4 sequences
# a batch (tests/measurement/conftest.py)
pytestmark = [pytest.mark.usefixtures("megatron_one_rank"), pytest.mark.gpt(batch_size=4)]

LINEAR_INPUTS = [ATTN_QKV_INPUT, ATTN_OUT, MLP_FC1_INPUT, MLP_FC2_INPUT]


def test_every_linear_input_is_tapped_and_nothing_else(gpt):
    model, controller, fwd = gpt
    tapped = [s for s in sensitive_sites(controller) if linear_tap.exact_for(controller, s)]
    assert tapped == LINEAR_INPUTS
    s = measure_sensitivity(controller, fwd, model, sampling=False)
    assert s.tapped == tuple(LINEAR_INPUTS)
    assert all(s.c[site] > 0 for site in LINEAR_INPUTS)


def test_tap_agrees_with_the_probes_mean_over_draws(gpt):
    """The probe estimates E||g_probe - g_exact||^2 / sum S from one draw of stochastic INT4;
    the mean over 12 draws is within a few percent of the expectation the tap computes. A
    tap off by a factor (d_out for d_in, no token power, a missing layer) misses by far
    more than the 8% allowed."""
    model, controller, fwd = gpt
    tap = measure_sensitivity(controller, fwd, model, sites=LINEAR_INPUTS, sampling=False)
    draws = {site: [] for site in LINEAR_INPUTS}
    for seed in range(12):
        probe = measure_sensitivity(controller, fwd, model, sites=LINEAR_INPUTS, sampling=False, seed=seed,
                                    tap=False)
        assert probe.tapped == ()
        for site in LINEAR_INPUTS:
            draws[site].append(probe.c[site])
    for site in LINEAR_INPUTS:
        mean = statistics.mean(draws[site])
        print(f"{site}: tap {tap.c[site]:.4g}, probe mean {mean:.4g} "
              f"(draws {min(draws[site]):.4g}..{max(draws[site]):.4g}), ratio {tap.c[site] / mean:.3f}")
        assert tap.c[site] == pytest.approx(mean, rel=0.08)


def test_tapped_sites_cost_no_probe_pass(gpt):
    """One exact pass, one pass per probed site type, one for the batch's half: the four
    linear inputs add none (they cost two passes each when probed in pairs of draws)."""
    model, controller, fwd = gpt
    calls = []

    def counted():
        calls.append(1)
        return fwd()

    every = sensitive_sites(controller)
    s = measure_sensitivity(controller, counted, model)
    assert s.sampling_noise is not None and s.sampling_noise > 0
    assert len(calls) == 1 + (len(every) - len(LINEAR_INPUTS)) + 1
    calls.clear()
    measure_sensitivity(controller, counted, model, tap=False)
    assert len(calls) == 1 + len(every) + 1


def test_no_tap_under_sequence_parallelism_or_without_a_dense_weight(gpt):
    """Under sequence parallelism a column-parallel linear saves a token shard of the input
    its weight gradient reads: the probe measures that site."""
    model, controller, fwd = gpt
    fc1 = controller.module(0, MLP_FC1_INPUT)
    assert linear_tap.exact_for(controller, MLP_FC1_INPUT)
    fc1.sequence_parallel = True
    try:
        assert not linear_tap.exact_for(controller, MLP_FC1_INPUT)
        s = measure_sensitivity(controller, fwd, model, sites=[MLP_FC1_INPUT, MLP_FC2_INPUT], sampling=False)
        assert s.tapped == (MLP_FC2_INPUT,) and s.c[MLP_FC1_INPUT] > 0
    finally:
        fc1.sequence_parallel = False
    assert not linear_tap.exact_for(controller, "ln1.input")


def test_tapped_coherence_is_the_probes_weight_gradient_error(gpt):
    """A biased codec's squared gradient error at a linear's input, dy^T (Q(x) - x) summed
    over the layers, is what the probe's pass with that codec measures, with no pass of its
    own: kappa * c (that error over sum_l S_l) agrees to rounding."""
    model, controller, fwd = gpt
    biased = {MLP_FC2_INPUT: "int4_channel", ATTN_QKV_INPUT: "fp8_e4m3"}
    tap = measure_sensitivity(controller, fwd, model, sites=list(biased), sampling=False, biased=biased)
    probe = measure_sensitivity(controller, fwd, model, sites=list(biased), sampling=False, biased=biased,
                                tap=False)
    for site in biased:
        print(f"{site}: kappa tap {tap.coherence[site]:.4g}, probe {probe.coherence[site]:.4g}")
        assert tap.coherence[site] > 0
        assert tap.coherence[site] * tap.c[site] == pytest.approx(probe.coherence[site] * probe.c[site], rel=1e-3)
