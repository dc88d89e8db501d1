"""`llm-act plan`: the table for a 7B model at TP=8, the smallest budget when none fits,
the JSON report, and argparse errors that name the bad flag."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from llm_act.cli.main import main
from llm_act.planner import load_plan_json
from llm_act.sites import SITES

BASE = ["plan", "--model", "gpt-7b", "--seq-length", "4096", "--micro-batch-size", "1", "--pp", "1"]
GPT7B = BASE + ["--tp", "8"]


def _header(out: str) -> dict:
    first = out.splitlines()[0]
    assert first.startswith("# llm-act plan ")
    return {k: json.loads(v) for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', first)}


def test_7b_at_tp8_prints_a_table():
    proc = subprocess.run([sys.executable, "-m", "llm_act.cli", *GPT7B, "--budget", "20GB"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    head = _header(out)
    assert head["model"] == "gpt-7b" and head["tp"] == 8 and head["budget_bytes"] == 20 * 10**9
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^  (\S+)\s+(\S+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
                                                        out, re.M)}
    sites = {name for name in rows if name in SITES}
    assert {"ln1.input", "attn.q", "attn.out", "mlp.act_input"} <= sites and "attn.softmax" not in sites
    assert set(rows[s] for s in sites) - {"keep"}  # 20 GB needs more than keeping everything
    for label in ("predicted activation memory", "static memory", "overhead", "solve time"):
        assert label in out
    total = float(re.search(r"total\s+([\d.]+) GiB of the ([\d.]+) GiB budget", out).group(1))
    assert total <= 20e9 / 2**30


def _plan(capsys, *extra) -> tuple[int, str]:
    code = main([*GPT7B, *extra])
    return code, capsys.readouterr().out


def test_impossible_budget_prints_the_minimum_and_exits_2(capsys):
    code, out = _plan(capsys, "--budget", "10GB")
    assert code == 2
    assert "Traceback" not in out
    m = re.search(r"smallest budget that works for every stage is (\d+) bytes = ([\d.]+) GB = ([\d.]+) GiB "
                  r"\(try --budget ([\d.]+GB)\)", out)
    assert m, out
    need = int(m.group(1))
    assert 10e9 < need < 20e9 and float(m.group(3)) == pytest.approx(need / 2**30, abs=1e-3)
    code, out = _plan(capsys, "--budget", m.group(4))  # the suggestion works ...
    assert code == 0, out
    code, _ = _plan(capsys, "--budget", str(need - 2**21))  # ... and 2 MiB less does not
    assert code == 2


def test_a_budget_above_the_device_memory_is_warned(capsys):
    code = main([*GPT7B, "--budget", "100GB"])
    out, err = capsys.readouterr()
    assert code == 0 and "warning: --budget 100.000 GB is more than the 80 GB of the H100-like" in err
    code = main([*GPT7B, "--budget", "100GB", "--device", "cpu"])  # a 256 GB device model
    assert code == 0 and "warning" not in capsys.readouterr().err
    code = main([*GPT7B, "--budget", "80GB"])  # all of it is not more than it
    assert code == 0 and "warning" not in capsys.readouterr().err


def test_cost_is_monotone_in_the_budget(capsys):
    costs = []
    for gb in (16, 17, 18, 20, 24):
        code, out = _plan(capsys, "--budget", f"{gb}GB")
        assert code == 0
        costs.append(float(re.search(r"overhead\s+([\d.]+) ms", out).group(1)))
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1] == 0.0


def test_pipeline_stages_and_json_report(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code = main(["plan", "--model", "gpt-13b", "--seq-length", "2048", "--tp", "8", "--pp", "4",
                 "--budget", "24GiB", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    for k in range(4):
        assert f"stage {k} of 4: layers {10 * k}-{10 * k + 9} (10 layers), {4 - k} micro-batch" in out
    report = json.loads(path.read_text())
    assert report["feasible"] and [s["inflight"] for s in report["stages"]] == [4, 3, 2, 1]
    for stage in report["stages"]:
        assert stage["total_bytes"] <= 24 * 2**30
    per_layer = load_plan_json(report["plan"], 40)  # a JSON plan for --act-compress-plan
    assert per_layer[0] == report["stages"][0]["choice"]
    # the last layer's plan carries the final norm's input (planned after the blocks)
    assert per_layer[39] == {**report["stages"][3]["choice"], **report["stages"][3]["after_blocks"]}
    assert list(report["stages"][3]["after_blocks"]) == ["final_norm.input"]
    assert all(not stage["after_blocks"] for stage in report["stages"][:3])


@pytest.mark.parametrize("argv, flag", [
    (["--budget", "lots"], "--budget"),
    (["--budget", "0GB"], "--budget"),
    (["--budget", "20GB", "--tp", "zero"], "--tp"),
    (["--budget", "20GB", "--zero-stage", "5"], "--zero-stage"),
    (["--budget", "20GB", "--variance-budget", "-1"], "--variance-budget"),
    (["--budget", "20GB", "--tp", "3"], "argument --tp: tp=3"),  # does not divide the 32 heads
    (["--budget", "20GB", "--seq-length", "4097", "--tp", "2", "--sequence-parallel"], "seq_length=4097"),
    (["--bud", "20GB"], "--bud"),  # no abbreviations
])
def test_bad_flags_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as err:
        main(BASE + argv if "--tp" in argv else GPT7B + argv)
    assert err.value.code == 2
    assert flag in capsys.readouterr().err


def test_unknown_model_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt-9b", "--budget", "20GB"])
    err = capsys.readouterr().err
    assert "--model" in err and "gpt-7b" in err


def test_q_k_v_are_recomputed_only_with_the_whole_block(capsys):
    """At the least budget the plan never names q, k or v "recompute" alone: the layers
    refuse that (they rebuild q, k, v only with the whole block)."""
    code, out = _plan(capsys, "--budget", "10GB")
    need = int(re.search(r"every stage is (\d+) bytes", out).group(1))
    code, out = _plan(capsys, "--budget", str(need))
    assert code == 0, out
    rows = dict(re.findall(r"^  (attn\.[qkv])\s+(\S+)", out, re.M))
    assert set(rows) == {"attn.q", "attn.k", "attn.v"} and "recompute" not in rows.values(), rows
