"""Plan "auto"'s noise budget: a stated fraction (`ActConfig.noise_fraction`) of the
gradient's own mini-batch sampling noise, measured during training (GACT sec. 4).

A real megatron-core GPT on one CPU rank; the sampling noise and the sensitivities come
from the training steps' own batches."""
from __future__ import annotations

import logging
import warnings

import pytest

from llm_act import ActConfig
from llm_act.config import NOISE_FRACTION
from llm_act.measurement.sensitivity import sensitive_sites
from llm_act.runtime.measuring import median
from tests.runtime.test_controller_adapt import _setup, _train

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
warnings.filterwarnings("ignore", message=".*activation compression adds gradient noise.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _noise(controller) -> float:
    """Predicted noise of the plan in force, on the adapter's last profile and the c and
    coherence the planner charges (measured, else their stand-ins)."""
    a = controller.adapter
    return a.measured.profile.noise(controller.plan, a.measured.planner_c(), a.measured.planner_coherence())


def test_the_default_budget_is_a_fraction_of_the_measured_sampling_noise():
    assert ActConfig().noise_fraction == NOISE_FRACTION and ActConfig().variance_budget is None
    model, controller, opt, gen = _setup(budget=10**9)
    _train(model, controller, opt, gen, 1)
    a = controller.adapter
    # the first tracking measures the linears' c (the exact pass) and the sampling noise;
    # every other type is charged the largest measured c until its round
    tapped, probed = a.measured.split_sites()
    assert set(a.measured.sensitivity) == set(tapped) and set(a.measured.planner_c()) == set(sensitive_sites(controller))
    assert a.measured.sampling_noise > 0 and a.measured.sampling_recent == [a.measured.sampling_noise]
    assert a.noise_budget() == pytest.approx(NOISE_FRACTION * a.measured.sampling_noise)
    assert controller.history[0]["noise"] <= a.noise_budget() * (1 + 1e-6)
    _train(model, controller, opt, gen, 3)  # trackings at 2 and 4: the median of the last ones
    assert 2 <= len(a.measured.sampling_recent) <= 3
    assert a.noise_budget() == pytest.approx(NOISE_FRACTION * median(a.measured.sampling_recent))
    state = controller.state_dict()["adapt"]
    assert state["sampling_recent"] == a.measured.sampling_recent


def _tight():
    """(budget of the "compress" plan's memory, measured on a first run)."""
    model, controller, opt, gen = _setup(noise_fraction=None)
    _train(model, controller, opt, gen, 1)
    return controller.adapter.budget


def test_a_smaller_fraction_buys_less_noise_under_the_same_memory():
    budget = _tight()
    runs = {}
    for fraction in (None, 0.05):
        model, controller, opt, gen = _setup(budget=budget, noise_fraction=fraction)
        _train(model, controller, opt, gen, 1)
        a = controller.adapter
        assert (a.noise_budget() is None) == (fraction is None)
        assert controller.history[0]["predicted_bytes"] <= budget
        runs[fraction] = controller
    bounded = runs[0.05].adapter
    if bounded.measured.standin_sites():  # stand-in c's may leave only the least noisy plan that fits
        from llm_act.planner import solve_plan

        blocks, static = bounded.problem(bounded.measured.profile)
        least = solve_plan(blocks, budget, static_bytes=static, objective="variance")
        assert _noise(runs[0.05]) <= max(0.05 * bounded.measured.sampling_noise, least.variance) * (1 + 1e-6)
    else:
        assert _noise(runs[0.05]) <= 0.05 * bounded.measured.sampling_noise * (1 + 1e-6)
    # the unbounded run's plan, judged on the same measured profile and sensitivities
    free = bounded.measured.profile.noise(runs[None].plan, bounded.measured.planner_c(), bounded.measured.planner_coherence())
    assert _noise(runs[0.05]) < free


def test_a_noise_budget_no_plan_meets_takes_the_least_noisy_plan_that_fits(caplog):
    budget = _tight()
    model, controller, opt, gen = _setup(budget=budget, variance_budget=1e-30)
    with caplog.at_level(logging.WARNING, logger="llm_act"):
        _train(model, controller, opt, gen, 2)
    said = [r.getMessage() for r in caplog.records if "meets the noise budget" in r.getMessage()]
    assert len(said) == 1 and "least noisy plan that fits" in said[0] and "Fix:" in said[0]
    assert controller.history and controller.history[-1]["predicted_bytes"] <= budget
    # no plan within the memory budget is less noisy (the objective "variance" answer)
    from llm_act.planner import solve_plan

    a = controller.adapter
    blocks, static = a.problem(a.measured.profile)
    least = solve_plan(blocks, budget, static_bytes=static, objective="variance")
    assert _noise(controller) == pytest.approx(least.variance, rel=1e-6)


def test_a_given_variance_budget_wins_and_none_turns_the_fraction_off():
    model, controller, opt, gen = _setup(budget=10**9, variance_budget=0.5)
    _train(model, controller, opt, gen, 1)
    assert controller.adapter.noise_budget() == 0.5
    model, controller, opt, gen = _setup(budget=10**9, noise_fraction=None)
    _train(model, controller, opt, gen, 1)
    assert controller.adapter.noise_budget() is None
    # without a noise budget the first tracking measures the rotation's first site types only
    assert len(controller.adapter.measured.sensitivity) < len(sensitive_sites(controller))


def test_biased_codecs_are_charged_their_measured_coherence_or_excluded():
    """Issue 28 item 3: under a noise budget a nearest-rounding codec's error, the same on
    every token, is charged at its measured coherence ("charge"), or such codecs are left
    out ("exclude", the default since issue 42's second part). With "charge" a site whose coherence is not measured yet charges its
    biased codecs `STANDIN_KAPPA`; the rounds measure the linears' inputs' in one pass,
    then the probed sites'."""
    from llm_act.codecs.registry import KEEP, RECOMPUTE, UNBIASED_CODECS
    from llm_act.runtime.measuring import STANDIN_KAPPA

    budget = _tight()
    model, controller, opt, gen = _setup(budget=budget, biased_codecs="charge")
    _train(model, controller, opt, gen, 1)
    a = controller.adapter
    assert a.config.biased_codecs == "charge"
    assert a.measured.coherence == {} and a.measured.planner_coherence() == {s: STANDIN_KAPPA for s in sensitive_sites(controller)}
    site = "mlp.fc2_input"
    layers = a.measured.profile.block_layers()[0]

    def charged(name):
        blocks, _ = a.problem(a.measured.profile)
        option = {o.name: o for p in blocks[0].sites if p.name == site for o in p.codecs}
        raw = sum(a.measured.profile.sites[(i, site)].options[name].rel_error for i in layers) / len(layers)
        return option[name].variance, raw

    got, raw = charged("int4_channel")
    assert got == pytest.approx(raw * STANDIN_KAPPA)
    _train(model, controller, opt, gen, 1)  # tracking at 2: the linears' coherences
    tapped, _ = a.measured.split_sites()
    assert set(tapped) <= set(a.measured.coherence) and all(k > 0 for k in a.measured.coherence.values())
    got, raw = charged("int4_channel")
    assert got == pytest.approx(raw * a.measured.coherence[site])
    got, raw = charged("int4")
    assert got == pytest.approx(raw)  # unbiased: not charged
    assert controller.state_dict()["adapt"]["coherence"] == a.measured.coherence

    model, controller, opt, gen = _setup(budget=budget)  # the default: "exclude"
    assert controller.config.biased_codecs == "exclude"
    _train(model, controller, opt, gen, 2)
    chosen = {n for choice in controller.plan.values() for n in choice.values()} - {KEEP, RECOMPUTE}
    assert controller.history and chosen <= UNBIASED_CODECS, chosen
    assert controller.adapter.measured.coherence == {}  # nothing to charge: not measured
