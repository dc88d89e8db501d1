"""Plan "auto" changes plans for a gain, not for the drift of its measurements
(`llm_act.runtime.solving.in_force_if_as_good`), and its last profile travels with the
controller's checkpoint, so a resumed run carries what the run carried (real megatron-core
GPT, CPU)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from llm_act.measurement.measured_profile import MeasuredProfile
from llm_act.planner import evaluate_plan, solve_plan
from llm_act.planner.milp import TIME_RESOLUTION
from llm_act.runtime import solving
from tests.runtime.test_controller_adapt import _setup, _train

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
warnings.filterwarnings("ignore", message=".*activation compression adds gradient noise.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _solved(a):
    blocks, static = a.problem(a.measured.profile)
    budget = a.budget
    best = solve_plan(blocks, budget, static_bytes=static, variance_budget=a.noise_budget(),
                      time_resolution=TIME_RESOLUTION)
    return blocks, static, budget, best


def test_the_plan_in_force_stays_where_it_is_as_good_and_goes_where_it_is_not():
    model, controller, opt, gen = _setup(budget=None)
    _train(model, controller, opt, gen, 2)
    a = controller.adapter
    blocks, static, budget, best = _solved(a)
    noise = a.noise_budget()
    in_force = evaluate_plan(blocks, a.measured.profile.choice_for(controller.plan, exclude=a.pins()))
    kept = solving.in_force_if_as_good(a, a.measured.profile, blocks, static, budget, noise, best)
    # the plan in force was itself the solver's answer at the last point: as good now
    assert in_force.overhead_ms <= best.overhead_ms * (1 + TIME_RESOLUTION) + 1e-9
    assert kept is not None and kept.overhead_ms == pytest.approx(in_force.overhead_ms)
    # a plan in force that no longer fits the budget is replaced
    assert solving.in_force_if_as_good(a, a.measured.profile, blocks, static, in_force.activation_bytes + static - 1,
                                       noise, best) is None
    # so is one that is slower by more than the time resolution
    faster = dataclasses.replace(best, overhead_ms=in_force.overhead_ms / (1 + 2 * TIME_RESOLUTION) - 1e-3)
    assert solving.in_force_if_as_good(a, a.measured.profile, blocks, static, budget, noise, faster) is None
    # and one over the noise budget (the plan in force stores lossily: it has a variance)
    assert in_force.variance > 0
    assert solving.in_force_if_as_good(a, a.measured.profile, blocks, static, budget, in_force.variance / 2,
                                       best) is None


def test_the_profile_round_trips_through_the_checkpoint():
    model, controller, opt, gen = _setup(budget=None)
    _train(model, controller, opt, gen, 1)
    a = controller.adapter
    back = MeasuredProfile.from_dict(a.measured.profile.to_dict())
    assert back.sites.keys() == a.measured.profile.sites.keys()
    for key, st in a.measured.profile.sites.items():
        assert back.sites[key] == st, key
    assert (back.other_bytes, back.device, back.no_recompute, back.block_ms) == (
        a.measured.profile.other_bytes, a.measured.profile.device, a.measured.profile.no_recompute, a.measured.profile.block_ms)
    state = controller.state_dict()
    model2, controller2, _, _ = _setup(budget=None)
    controller2.load_state_dict(state)
    assert controller2.adapter.measured.profile.blocks() == a.measured.profile.blocks()
