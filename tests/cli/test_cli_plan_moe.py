"""`llm-act plan` sizes the MoE presets: Mixtral-8x7B over 8 expert-parallel ranks fits 60 GB
with ZeRO-1 and prints the `moe.*` sites; `--ep` splits the experts' static memory; an `--ep`
that does not divide the experts (or a dense model) is an argparse error naming the flag."""
from __future__ import annotations

import json
import re

import pytest

from llm_act.cli.main import main
from llm_act.sites import MOE_SITES

MIXTRAL = ["plan", "--model", "mixtral-8x7b", "--seq-length", "4096", "--dp", "8", "--zero-stage", "1"]


def _header(out: str) -> dict:
    first = out.splitlines()[0]
    return {k: json.loads(v) for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', first)}


def test_mixtral_over_8_expert_ranks_fits_and_lists_the_moe_sites(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    code = main([*MIXTRAL, "--ep", "8", "--budget", "60GB", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    head = _header(out)
    assert head["num_experts"] == 8 and head["moe_topk"] == 2 and head["ep"] == 8
    assert head["tokens_per_expert"] == 4096 * 2  # one expert per rank takes every routed row
    rows = dict(re.findall(r"^  (moe\.\S+)\s+(\S+)\s+[\d.]+", out, re.M))
    assert set(rows) == set(MOE_SITES), rows
    assert not re.search(r"^  mlp\.(fc1|act|fc2)_input", out, re.M)
    report = json.loads(out_json.read_text())
    assert report["feasible"] and report["stages"][0]["total_bytes"] <= 60e9
    keep_all = float(re.search(r"keeping everything: ([\d.]+) GiB", out).group(1)) * 2**30
    assert keep_all + report["stages"][0]["static_bytes"] > 60e9  # keeping everything does not fit ...
    assert set(rows.values()) - {"keep"}  # ... so the plan compresses or recomputes MoE sites


def test_expert_parallelism_shrinks_static_memory(tmp_path):
    static = {}
    for ep in (2, 8):
        path = tmp_path / f"ep{ep}.json"
        main([*MIXTRAL, "--ep", str(ep), "--budget", "200GB", "--json", str(path)])
        static[ep] = json.loads(path.read_text())["stages"][0]["static_bytes"]
    assert static[8] < static[2] / 2


@pytest.mark.parametrize("model, ep, match", [
    ("mixtral-8x7b", "3", "argument --ep: ep=3 does not divide num_experts=8"),
    ("gpt-7b", "2", "argument --ep: .*needs an MoE model"),
])
def test_bad_ep_names_the_flag(capsys, model, ep, match):
    with pytest.raises(SystemExit) as err:
        main(["plan", "--model", model, "--ep", ep, "--budget", "80GB"])
    assert err.value.code == 2
    assert re.search(match, capsys.readouterr().err)
