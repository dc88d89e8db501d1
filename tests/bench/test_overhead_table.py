"""`llm-act bench overhead`'s table: a row per tracking point with its round in words."""
from __future__ import annotations

from llm_act.bench import overhead


def test_each_point_prints_its_round():
    row = {"steps": 8, "budget": None, "seconds": 3.0, "step_s": 0.1, "measuring_seconds": 0.3,
           "fraction": 0.1, "changes": 1,
           "points": [{"iteration": 1.0, "step tap": 0.01, "profile": 0.1, "sensitivity": 0.05, "solve": 0.02,
                       "total": 0.18, "steps": 1.8, "round": "signed: the exact pass alone; 2 of 4 rows"},
                      {"iteration": 2.0, "total": 0.1, "steps": 1.0}],
           "reports": []}
    lines = overhead.table(row).splitlines()
    assert lines[4].endswith("| round |") and lines[5].count("|") == lines[4].count("|")
    assert lines[6] == "| 1 | 10 ms | 100 ms | 50 ms | 20 ms | 180 ms | 1.8 | signed: the exact pass alone; 2 of 4 rows |"
    assert lines[7] == "| 2 | 0 ms | 0 ms | 0 ms | 0 ms | 100 ms | 1.0 |  |"  # a row from an older run: no round
