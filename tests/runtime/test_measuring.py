"""What a tracking point of plan "auto" measures (`llm_act.runtime.measuring`), on a real
megatron-core GPT (CPU): a later sensitivity point runs three passes (exact, one probed
type, the sampling half), a probed type's c follows the gradients' scale between its
measurements, a biased codec's coherence is measured once per codec at a probed site, and
an outlier shift at a site the plan keeps does not reset the schedule."""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act.runtime import measuring
from llm_act.runtime.measuring import SENS_SITES_PER_TRACK, coherence_codecs, coherence_due, scaled_medians
from tests.runtime.test_controller_adapt import _setup, _train

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
warnings.filterwarnings("ignore", message=".*activation compression adds gradient noise.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

TAPPED = ["attn.qkv_input", "mlp.fc1_input"]


def test_a_probed_c_is_scaled_by_the_tapped_sites_between_its_measurements():
    """Measured once when the tapped sites summed to 10; they now sum to 1 (every gradient
    shrank): the probed c is a tenth of what was measured, its share unchanged."""
    recent = [{"attn.qkv_input": 6.0, "mlp.fc1_input": 4.0, "ln1.input": 2.0}]
    recent += [{"attn.qkv_input": 0.6, "mlp.fc1_input": 0.4} for _ in range(3)]
    c = scaled_medians(recent, TAPPED)
    assert c["attn.qkv_input"] == pytest.approx(0.6) and c["mlp.fc1_input"] == pytest.approx(0.4)
    assert c["ln1.input"] == pytest.approx(0.2)  # unscaled it would be 2.0
    assert measuring.window_medians(recent)["ln1.input"] == pytest.approx(2.0)
    # without tapped sites nothing is scaled
    assert scaled_medians(recent, []) == measuring.window_medians(recent)


def _count_passes(monkeypatch) -> list:
    """Patch the adapter's sensitivity measurement to count the forwards each one runs."""
    counts: list = []
    real = measuring.measure_sensitivity

    def counted(controller, forward, *args, **kwargs):
        n = [0]

        def fwd():
            n[0] += 1
            return forward()

        out = real(controller, fwd, *args, **kwargs)
        counts.append((controller.iteration, n[0], dict(kwargs.get("biased") or {})))
        return out

    monkeypatch.setattr(measuring, "measure_sensitivity", counted)
    return counts


def test_a_later_sensitivity_point_runs_three_passes(monkeypatch):
    counts = _count_passes(monkeypatch)
    model, controller, opt, gen = _setup(budget=10**9)
    _train(model, controller, opt, gen, 4)  # tracking at 1, 2, 4: sensitivities at 1 and 4
    a = controller.adapter
    tapped, probed = measuring.split_sites(a)
    assert [it for it, _, _ in counts] == [1, 4]
    first, later = counts[0][1], counts[1][1]
    # exact, every probed type, the coherence of each (biased codecs are charged by
    # default), the half; later: exact, one probed type (its kappa known), the half
    assert first == 1 + 2 * len(probed) + 1
    assert later == 1 + SENS_SITES_PER_TRACK + 1 == 3
    assert set(a.sensitivity) == set(tapped + probed)


def test_a_probed_sites_coherence_is_measured_once_per_codec(monkeypatch):
    counts = _count_passes(monkeypatch)
    model, controller, opt, gen = _setup(budget=10**9)
    assert controller.config.biased_codecs == "charge"
    _train(model, controller, opt, gen, 4)
    a = controller.adapter
    tapped, probed = measuring.split_sites(a)
    first, later = counts[0][2], counts[1][2]
    assert set(first) == set(tapped + probed)  # every site's kappa at the first point
    assert set(later) == set(tapped)  # the probed ones have theirs for the same codecs
    assert counts[1][1] == 3
    biased = coherence_codecs(a, tapped + probed)
    site = probed[0]
    a.coherence_codecs[site] = "some_other_codec"  # the plan moved it to another biased codec
    assert set(coherence_due(a, biased, tapped)) == set(tapped) | {site}


def test_an_outlier_shift_at_a_kept_site_does_not_reset_the_schedule():
    """The same injected outlier channels as in test_controller_adapt's reset test, under a
    budget that keeps every site: nothing the plan stores depends on them."""
    model, controller, opt, gen = _setup(budget=10**9, adapt_interval_max=4, sensitivity=False)

    def inject(iteration, model):
        if iteration == 9:
            with torch.no_grad():
                model.embedding.word_embeddings.weight[:, :4] *= 50.0

    _train(model, controller, opt, gen, 14, on_step=inject)
    a = controller.adapter
    stored = {controller.plan[layer][site] for layer, site in a.profile.sites}
    assert stored <= {"keep", "recompute", "regen"}, stored
    assert not [r for _, rs in a.resets for r in rs if "outlier rate" in r]
    assert a.profile.outlier_rates()["ln1.input"] > 0  # the channels are there, measured
