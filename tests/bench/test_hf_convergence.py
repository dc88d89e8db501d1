"""`llm-act bench hf-convergence`'s verdict arithmetic: paired relative differences per seed,
the one-sided bound against stock, the two-sided interval of "auto" against "compress";
and one real run of each plan for two steps (the bench's own path, DeepSpeed door)."""
from __future__ import annotations

import math

import pytest

from llm_act.bench import convergence as C
from llm_act.bench import hf_convergence as H


def _runs(final: dict[str, list[float]]) -> list[dict]:
    return [{"plan": plan, "seed": 100 + i, "final": v, "saved_bytes": 10 if plan in (H.STOCK, H.ULP) else 2,
             "changes": 1 if plan == "auto" else 0}
            for plan, values in final.items() for i, v in enumerate(values)]


def test_the_pairing_is_per_seed_and_relative():
    runs = _runs({H.STOCK: [2.0, 4.0, 3.0], "compress": [2.02, 4.0, 2.97], "auto": [2.0, 4.04, 3.0]})
    assert H._paired(runs, "compress", H.STOCK) == pytest.approx([0.01, 0.0, -0.01])
    diffs = H._paired(runs, "auto", "compress")
    assert diffs == pytest.approx([2.0 / 2.02 - 1, 0.01, 3.0 / 2.97 - 1])
    mean, low, high = H.two_sided(diffs)
    s = C.paired_stats(diffs)
    half = C.t_quantile(0.975, 2) * s["se"]
    assert (mean, low, high) == pytest.approx((s["mean"], s["mean"] - half, s["mean"] + half))
    assert low < mean < high and high - mean > s["upper"] - mean  # two-sided is wider than one-sided
    text = H.table({"runs": runs})
    assert "| compress | 3 | 0.200 | +0.00% |" in text
    assert f"{100 * mean:+.2f}%" in text and f"[{100 * low:+.2f}%, {100 * high:+.2f}%]" in text


def test_one_seed_has_no_interval():
    assert H.two_sided([0.01])[1:] == (-math.inf, math.inf)


@pytest.mark.slow
def test_each_plan_trains_through_the_deepspeed_door():
    pytest.importorskip("deepspeed")
    result = H.run(seeds=(7,), steps=2, log=lambda m: None)
    by = {r["plan"]: r for r in result["runs"]}
    assert set(by) == set(H.PLANS)
    assert by["compress"]["saved_bytes"] < 0.5 * by[H.STOCK]["saved_bytes"]
    assert by["auto"]["changes"] >= 1 and all(math.isfinite(r["final"]) for r in by.values())


def test_bench_convergence_takes_the_deepspeed_door(monkeypatch, capsys, tmp_path):
    """`llm-act bench convergence --door deepspeed` is the Hugging Face Llama's bench (issue 45,
    item 4): it runs `hf_convergence` with the seeds and JSON given; the megatron-core settings'
    flags are refused in one line. (`run_saved` is stood in for: one seed trains for minutes.)"""
    from llm_act.cli.main import main

    calls = []
    monkeypatch.setattr(H, "run_saved", lambda *a: calls.append(a[:3]))
    out = str(tmp_path / "hf.json")
    assert main(["bench", "convergence", "--door", "deepspeed", "--seeds", "1244-1245", "--save-json", out]) in (0, None)
    assert calls == [((1244, 1245), None, out)]
    with pytest.raises(SystemExit) as err:
        main(["bench", "convergence", "--door", "deepspeed", "--setting", "bf16"])
    assert "drop --setting" in str(err.value) and "\n" not in str(err.value)
    assert calls == [((1244, 1245), None, out)]
