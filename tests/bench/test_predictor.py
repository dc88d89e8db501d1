"""`llm_act.bench.predictor`: Spearman's rho, what each candidate reads from a run, and the
fit/report table, on result dicts built here."""
from __future__ import annotations

import json
import math

import pytest

from llm_act.bench import predictor as P


def test_ranks_average_ties_and_spearman_matches_hand_values():
    assert P.ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    assert P.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert P.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # d = rank differences (0, 1, -1, 0): rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert P.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(P.spearman([1, 2], [2, 1]))  # too few points
    assert math.isnan(P.spearman([1, 1, 1], [1, 2, 3]))  # a constant side
    with pytest.raises(ValueError, match="differ in length"):
        P.spearman([1, 2, 3], [1, 2])


def _saved_run(final, train_level, noise=None, fidelity=None, changes=None, valid_mid=None):
    run = {"valid_full": final, "train": [train_level] * 300,
           "valid": [5.0, 4.0, valid_mid if valid_mid is not None else final, 3.0, final]}
    if noise is not None:
        run.update(noise_ratio=noise, fidelity=fidelity, changes=changes)
    return run


def _saved_result(gaps: dict[str, list[float]]) -> dict:
    """Two seeds; each plan ends `gap` above stock's 2.0 and trains `gap` above it too."""
    runs = {}
    for seed in (1, 2):
        runs[f"stock seed {seed}"] = _saved_run(2.0, 3.0, valid_mid=2.5)
        runs[f"stock, 1 ulp seed {seed}"] = _saved_run(2.0, 3.0, valid_mid=2.5)
        for plan, per_seed in gaps.items():
            g = per_seed[seed - 1]
            runs[f"{plan} seed {seed}"] = _saved_run(2.0 * (1 + g), 3.0 * (1 + g / 2), noise=g * 10, fidelity=g,
                                               changes=3 if plan == "auto" else None, valid_mid=2.5 * (1 + g))
    return {"models": {"m": {"runs": runs}}}


def test_points_read_the_gap_and_every_candidate_a_run_has():
    pts = {(p["plan"], p["seed"]): p for p in P.points(_saved_result({"auto": [0.01, 0.03], "fixed": [0.02, 0.0]}))}
    assert set(pts) == {("auto", 1), ("auto", 2), ("fixed", 1), ("fixed", 2)}  # stock and controls are not runs
    p = pts[("auto", 2)]
    assert p["gap"] == pytest.approx(0.03)
    assert p["noise ratio"] == pytest.approx(0.3) and p["gradient error"] == pytest.approx(0.03)
    assert p["early train gap"] == pytest.approx(0.015) and p["mid valid gap"] == pytest.approx(0.03)
    assert p["plan changes"] == 3.0 and pts[("fixed", 1)]["plan changes"] == 0.0


def test_a_candidate_that_orders_the_runs_has_rho_one_and_the_table_ranks_by_the_fit_set(tmp_path, capsys):
    result = _saved_result({"a": [0.01, 0.04], "b": [0.02, 0.05], "c": [0.03, 0.06]})
    rho = P.correlations(P.points(result))
    assert rho["noise ratio"] == (pytest.approx(1.0), 6) and rho["mid valid gap"][0] == pytest.approx(1.0)
    fit, report = tmp_path / "fit.json", tmp_path / "report.json"
    fit.write_text(json.dumps(result))
    report.write_text(json.dumps(result))
    # a file that went on from another holds its runs again: each counted once
    assert len(P.load([str(fit), str(report)])) == 6
    assert P.main(["--fit", str(fit), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and "+1.00 (6) | +1.00 (6) |" in out


def test_an_unreadable_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert P.main(["--fit", str(tmp_path / "missing.json"), "--report", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("predictor: cannot read the results") and err.count("\n") == 1
