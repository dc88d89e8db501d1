"""Cheaper sensitivity measurements, on a real megatron-core GPT (CPU):

- `signed=True`: every pass backpropagates the two halves' mean losses with opposite signs,
  so the exact pass's own gradient (g_a - g_b) gives the sampling noise and no pass is run
  for it; a linear's tapped c and the sampling noise equal the plain passes' exactly, a
  probed c in expectation (errors independent across rows);
- `rows=(m, b)`: a measurement on the batch's first m rows scaled to the whole batch agrees
  with the whole batch's in expectation, and a coherence is extrapolated upwards.
"""
from __future__ import annotations

import statistics
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.measurement.replay import StepReplay
from llm_act.measurement.sensitivity import Sensitivity, measure_sensitivity, scale_rows
from llm_act.patches.megatron import apply
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

TAPPED, PROBED = "mlp.fc1_input", "ln2.input"


def _gpt(batch_size=4, data_seed=1, dropout=0.1):
    model = R.build(dropout=dropout, num_layers=2)
    controller = apply(model, ActConfig(plan="compress"))
    ids, pos, labels = R.batch(data_seed, batch_size=batch_size)
    return model, controller, lambda: model(ids, pos, None, labels=labels)


def test_signed_passes_give_the_same_sampling_noise_and_tapped_c_without_the_half_pass():
    model, controller, fwd = _gpt()
    count = [0]

    def counted():
        count[0] += 1
        return fwd()

    plain = measure_sensitivity(controller, counted, model, sites=[TAPPED], seed=3)
    plain_passes, count[0] = count[0], 0
    signed = measure_sensitivity(controller, counted, model, sites=[TAPPED], seed=3, signed=True)
    assert (plain_passes, count[0]) == (2, 1)  # exact + half against the exact pass alone
    assert signed.sampling_noise == pytest.approx(plain.sampling_noise, rel=1e-4)
    assert signed.c[TAPPED] == pytest.approx(plain.c[TAPPED], rel=1e-4)
    with pytest.raises(ValueError, match="biased"):
        measure_sensitivity(controller, fwd, model, sites=[TAPPED], signed=True, biased={TAPPED: "int4_sym"})


def test_a_signed_probe_measures_the_same_c_in_expectation():
    model, controller, fwd = _gpt()
    plain = [measure_sensitivity(controller, fwd, model, sites=[PROBED], seed=s, sampling=False).c[PROBED]
             for s in range(8)]
    signed = [measure_sensitivity(controller, fwd, model, sites=[PROBED], seed=s, signed=True).c[PROBED]
              for s in range(8)]
    ratio = statistics.mean(signed) / statistics.mean(plain)
    print(f"c({PROBED}) signed / plain over 8 draws: {ratio:.3f}")
    assert 0.8 < ratio < 1.25
    # a signed pass that forgot the gain of 4 would be far off
    assert not 0.8 < 4 * ratio < 1.25


def _recorded(batch_size, data_seed):
    model, controller, fwd = _gpt(batch_size, data_seed, dropout=0.0)
    replay = StepReplay(lambda: True)
    replay.install([model])
    fwd().float().mean().backward()
    model.zero_grad(set_to_none=True)
    return model, controller, replay


def test_the_first_rows_scaled_to_the_batch_agree_with_the_whole_batch():
    """8 batches of 8 rows: the tapped c, a probed c and the sampling noise of the first 4
    rows, scaled x2, against the whole batch's (their means over the batches)."""
    whole, part = [], []
    for data_seed in range(8):
        model, controller, replay = _recorded(8, data_seed)
        kw = dict(sites=[TAPPED, PROBED], seed=data_seed, signed=True)
        whole.append(measure_sensitivity(controller, replay.probe(), model, **kw))
        part.append(measure_sensitivity(controller, replay.probe(rows=4), model, rows=(4, 8), **kw))
    for name, get in (("tapped c", lambda s: s.c[TAPPED]), ("probed c", lambda s: s.c[PROBED]),
                      ("sampling noise", lambda s: s.sampling_noise)):
        ratio = statistics.mean(map(get, part)) / statistics.mean(map(get, whole))
        print(f"{name}: first 4 rows x 2 / 8 rows = {ratio:.3f}")
        assert 0.7 < ratio < 1.4, name
        # unscaled, the first rows' figures are about half
        assert not 0.7 < ratio / 2 < 1.4


def test_scale_rows_extrapolates_a_coherence_upwards_only():
    s = Sensitivity(c={"a": 1.0}, sampling_noise=2.0, coherence={"a": 1.5, "b": 0.9})
    groups = {"a": {"g": 0.5}}
    scale_rows(s, groups, 2, 8)
    assert s.c["a"] == 4.0 and s.sampling_noise == 8.0 and groups["a"]["g"] == 2.0
    assert s.coherence["a"] == pytest.approx(1.0 + 0.5 * 7) and s.coherence["b"] == 0.9
    same = Sensitivity(c={"a": 1.0})
    scale_rows(same, {}, 8, 8)
    assert same.c == {"a": 1.0}
