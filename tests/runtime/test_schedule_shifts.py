"""What resets plan "auto"'s tracking interval (`llm_act.runtime.schedule.shifts`): a sharp
change of what the plan depends on. Under a noise budget relative to the sampling noise,
a uniform shrinking of the gradients (c and the sampling noise together, as early in
training) is no shift; a site whose c moves against the others' is one. Under an
absolute variance budget c itself counts."""
from __future__ import annotations

import pytest

from llm_act.runtime.measuring import plan_relevant_c
from llm_act.runtime.schedule import SHIFT_FACTOR, shifts

SHARE = {"attn.qkv_input": 0.6, "ln2.input": 0.4}


def _stats(c: dict[str, float], samp: float, budget=None) -> dict:
    return {"outlier": {}, "channels": {}, "c": plan_relevant_c(c, samp, budget), "share": SHARE}


def test_a_uniform_shrink_is_no_shift_under_a_relative_budget():
    last: dict = {}
    before = {"attn.qkv_input": 0.27, "ln2.input": 0.02}
    assert shifts(last, _stats(before, 4.0)) == []
    shrunk = {site: v / 3 for site, v in before.items()}  # every gradient 3x smaller
    assert shifts(last, _stats(shrunk, 4.0 / 3)) == []
    # against the other sites, one site's c moving by more than SHIFT_FACTOR is a shift
    moved = dict(shrunk, **{"ln2.input": shrunk["ln2.input"] * (SHIFT_FACTOR + 1.0)})
    reasons = shifts(last, _stats(moved, 4.0 / 3))
    assert len(reasons) == 1 and "ln2.input" in reasons[0]


def test_c_itself_counts_under_an_absolute_budget():
    c = {"attn.qkv_input": 0.27, "ln2.input": 0.02}
    assert plan_relevant_c(c, 4.0, 1e-3) == c
    assert plan_relevant_c(c, 4.0, None) == pytest.approx({site: v / 0.29 for site, v in c.items()})
    assert plan_relevant_c({"ln1.input": 0.0}, 4.0, None) == {"ln1.input": 0.0}
    last: dict = {}
    shifts(last, _stats(c, 4.0, 1e-3))
    shrunk = {site: v / 3 for site, v in c.items()}
    assert len(shifts(last, _stats(shrunk, 4.0 / 3, 1e-3))) == 2
