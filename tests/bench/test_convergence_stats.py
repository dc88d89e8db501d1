"""The convergence bench's verdict statistics (`llm_act.bench.convergence`, issue 28): the
paired mean, its standard error and the one-sided 95% upper bound (t with n - 1 degrees of
freedom); a plan meets the target only when its bound does, and the verdict is about the one
plan named before running. No training here: results are built by hand or read from the
committed docs/convergence.json."""
from __future__ import annotations

import json
import math
import os

import pytest

from llm_act.bench import convergence as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("dof,want", [(1, 6.313752), (2, 2.919986), (3, 2.353363), (9, 1.833113),
                                      (44, 1.680230)])
def test_t_quantile_matches_the_tables(dof, want):
    assert C.t_quantile(0.95, dof) == pytest.approx(want, abs=1e-6)
    assert C.t_cdf(want, dof) == pytest.approx(0.95, abs=1e-7)
    assert C.t_quantile(0.5, dof) == pytest.approx(0.0, abs=1e-9)


def test_paired_stats_of_a_known_sample():
    s = C.paired_stats([1.0, 2.0, 3.0])  # sd 1, se 1/sqrt(3), t(0.95, 2) = 2.919986
    assert s["n"] == 3 and s["mean"] == pytest.approx(2.0)
    assert s["se"] == pytest.approx(1 / math.sqrt(3))
    assert s["upper"] == pytest.approx(2.0 + 2.919986 / math.sqrt(3), abs=1e-6)
    # the figures: auto 0.15 on the large model, 3 seeds
    s = C.paired_stats([-0.0150, -0.0147, 0.0035])
    assert (s["mean"], s["se"], s["upper"]) == pytest.approx((-0.008733, 0.006117, 0.009129), abs=1e-6)
    one = C.paired_stats([0.001])
    assert one["upper"] == math.inf and not C.meets_target(one)


def _result(per_plan: dict[str, list[float]]) -> dict:
    """A saved result of one model: stock's final loss 2.0 at every seed, each plan's final
    loss 2.0 * (1 + gap) at its seed, memory 0.1 of stock."""
    seeds = list(range(len(next(iter(per_plan.values())))))
    runs = {f"stock seed {s}": {"valid": [3.0, 2.0], "block_bytes": 1000, "measuring": None}
            for s in seeds}
    for plan, gaps in per_plan.items():
        for s, g in zip(seeds, gaps):
            runs[f"{plan} seed {s}"] = {"valid": [3.0, 2.0 * (1 + g)], "block_bytes": 100,
                                        "measuring": 0.1}
    return {"seeds": seeds, "plans": list(per_plan), "models": {"m": {"runs": runs}}}


def test_a_mean_within_the_target_with_a_bound_above_it_is_not_met():
    # mean -0.1% (within +0.3%), but the spread puts the bound at +1.6%
    res = _result({C.VERDICT_PLAN: [-0.012, -0.008, 0.017]})
    p = C.summary(res)["m"]["plans"][C.VERDICT_PLAN]
    assert p["mean"] <= C.TARGET_GAP < p["upper"] and not p["meets"]
    assert C.target_met(res) == {"m": False}
    text = "\n".join(C.sentences(res))
    assert "**not met**" in text and "although its mean is not" in text
    # a tight one meets it: mean +0.05%, bound +0.19%
    res = _result({C.VERDICT_PLAN: [0.0005, 0.0, 0.001]})
    assert C.target_met(res) == {"m": True}


def test_only_the_named_plan_counts():
    """Another "auto" plan meeting the target does not make the verdict (no best-of-several)."""
    res = _result({"auto 0.10": [0.0005, 0.0, 0.001], C.VERDICT_PLAN: [0.01, 0.02, 0.03]})
    assert C.summary(res)["m"]["plans"]["auto 0.10"]["meets"]
    assert C.target_met(res) == {"m": False}
    assert C.target_met(_result({"auto 0.10": [0.0, 0.0, 0.0]})) == {"m": False}  # not run


def test_the_control_stands_beside_every_plan():
    res = _result({C.STOCK_AGAIN: [0.005, -0.009, 0.011], "compress": [0.0, 0.001, 0.002]})
    control = C.summary(res)["m"]["control"]
    assert control["upper"] == pytest.approx(C.paired_stats([0.005, -0.009, 0.011])["upper"])
    row = next(r for r in C.table(res).splitlines() if "| compress |" in r)
    assert f"(bound {control['upper']:+.2%})" in row


def test_the_committed_result_re_renders_with_bounds():
    """docs/convergence.json holds every run's validation curve, so section 2 re-renders
    without training; its verdicts: not met on both models (large: mean -0.87%, bound
    +0.92%)."""
    with open(os.path.join(ROOT, "docs", "convergence.json")) as f:
        res = json.load(f)
    assert C.target_met(res) == {"small": False, "large": False}
    large = C.summary(res)["large"]
    auto = large["plans"][C.VERDICT_PLAN]
    assert (round(auto["mean"], 4), round(auto["se"], 4), round(auto["upper"], 4)) == (-0.0087, 0.0061, 0.0092)
    assert round(large["control"]["upper"], 4) == 0.0204


def test_replace_section_rewrites_one_section(tmp_path):
    from llm_act.bench.report import replace_section

    page = tmp_path / "benchmarks.md"
    page.write_text("# t\n\n## 1. A\n\na\n\n## 2. B\n\nold\n\n## 3. C\n\nc\n")
    assert replace_section(str(page), "## 2. B (new)\n\nnew\n")
    assert page.read_text() == "# t\n\n## 1. A\n\na\n\n## 2. B (new)\n\nnew\n\n## 3. C\n\nc\n"
    assert not replace_section(str(tmp_path / "none.md"), "## 2. x\n")
