"""Measuring passes that start their backward below the output layer
(`llm_act.measurement.head_cut`), on a real megatron-core GPT (CPU): the sensitivities,
the sampling noise and the fidelity sums are the same as with whole passes, the output
layer runs once per measurement, a tied embedding keeps both shares of its gradient, and
a head the forward never reaches leaves every pass whole."""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.measurement import fidelity, probing
from llm_act.measurement.head_cut import HeadCut, head_of
from llm_act.measurement.sensitivity import batch_loss, measure_sensitivity, per_row_losses, sensitive_sites
from llm_act.patches.megatron import apply
from tests import testing as T
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _gpt(tied: bool = False, dropout: float = 0.1):
    R.seed_all(0)
    cfg = T.small_config(dtype=torch.float32, dropout=dropout, num_layers=2)
    model = T.gpt_model(cfg, vocab_size=R.VOCAB, max_sequence_length=R.SEQ,
                        share_embeddings_and_output_weights=tied)
    controller = apply(model, ActConfig(plan="compress"))
    ids, pos, labels = R.batch(1, batch_size=4)
    return model, controller, lambda: model(ids, pos, None, labels=labels)


def _head_calls(model) -> list:
    calls: list = []
    model.output_layer.register_forward_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("tied", [False, True])
def test_sensitivity_is_the_same_with_the_cut(tied):
    """Every c (tapped and probed), the coherence of a biased codec and the sampling noise
    agree with the whole passes' to float32 rounding: the head's share of the gradient
    (the tied embedding's included) is counted once, in every pass."""
    model, controller, fwd = _gpt(tied)
    assert head_of([model]) is model.output_layer
    sites = sensitive_sites(controller)
    biased = {"ln2.input": "int4_channel"}
    whole = measure_sensitivity(controller, fwd, model, sites=sites, seed=3, biased=biased)
    calls = _head_calls(model)
    cut = measure_sensitivity(controller, fwd, model, sites=sites, seed=3, biased=biased,
                              head=model.output_layer)
    assert len(calls) == 1  # the exact pass alone ran the head
    assert whole.sampling_noise > 0
    assert cut.sampling_noise == pytest.approx(whole.sampling_noise, rel=1e-4)
    assert cut.coherence["ln2.input"] == pytest.approx(whole.coherence["ln2.input"], rel=1e-3)
    for site in sites:
        assert whole.c[site] > 0
        assert cut.c[site] == pytest.approx(whole.c[site], rel=1e-3), site


def test_a_cut_with_the_wrong_head_share_is_caught():
    """The check above can fail: dropping the head's share from the later passes (as if the
    tied weight's head gradient were not added back) moves the probed c by far more."""
    model, controller, fwd = _gpt(tied=True)
    params = [p for p in model.parameters() if p.requires_grad]
    passes = HeadCut(model.output_layer, params, batch_loss, per_row_losses)
    with probing.isolated(controller, params) as snap, torch.enable_grad():
        probing.install(controller, {})
        exact = passes.exact(fwd)
        snap.restore()
        same = passes.again(fwd)
        snap.restore()
        dropped = passes.again(fwd, head_grads=[None] * len(params))
    whole = sum(float(g.double().pow(2).sum()) for g in exact)
    assert probing.sq_distance(same, exact) <= 1e-10 * whole
    assert probing.sq_distance(dropped, exact) > 1e-3 * whole


def test_fidelity_sums_are_the_same_with_the_cut():
    model, controller, fwd = _gpt()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = controller.plan
    sites = fidelity.lossy_sites(plan)[:2]
    whole = fidelity.measure_sums(controller, fwd, named, plan, sites, seed=5)
    calls = _head_calls(model)
    cut = fidelity.measure_sums(controller, fwd, named, plan, sites, seed=5, head=model.output_layer)
    assert len(calls) == 1
    assert set(cut) == set(whole)
    scale = sum(v for k, v in whole.items() if k.startswith("norm:"))
    for key, value in whole.items():
        assert cut[key] == pytest.approx(value, rel=1e-3, abs=1e-9 * scale), key
    assert any(k.startswith("samp:") and v > 0 for k, v in cut.items())


def test_a_head_the_forward_never_reaches_leaves_every_pass_whole():
    model, controller, fwd = _gpt()
    stranger = torch.nn.Linear(4, 4)
    sites = sensitive_sites(controller)
    whole = measure_sensitivity(controller, fwd, model, sites=sites, seed=3)
    calls = _head_calls(model)
    s = measure_sensitivity(controller, fwd, model, sites=sites, seed=3, head=stranger)
    assert len(calls) > 1
    assert s.c == pytest.approx(whole.c, rel=1e-6)


def test_a_batch_of_one_has_no_halves_and_the_half_runs_whole():
    """One row: no sampling noise either way, and nothing in the cut asks for halves."""
    model, controller, _ = _gpt()
    ids, pos, labels = R.batch(1, batch_size=1)
    s = measure_sensitivity(controller, lambda: model(ids, pos, None, labels=labels), model,
                            sites=sensitive_sites(controller)[:1], head=model.output_layer)
    assert s.sampling_noise is None


def test_head_of_takes_one_root_with_a_post_process_output_layer():
    model, _, _ = _gpt()
    assert head_of([model]) is model.output_layer
    assert head_of([model, model]) is None  # several roots (virtual pipeline chunks)
    assert head_of([torch.nn.Linear(2, 2)]) is None
