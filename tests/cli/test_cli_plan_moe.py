"""`llm-act plan` sizes the MoE presets: Mixtral-8x7B over 8 expert-parallel ranks and 4
pipeline stages fits 60 GB with ZeRO-1 and prints the `moe.*` sites; `--ep` splits the experts'
static memory, whose optimizer state shards over the expert data-parallel group (dp / ep); an
`--ep` that does not divide the experts (or a dense model), or a `--dp` that is not a multiple
of it, is an argparse error naming the flag."""
from __future__ import annotations

import json
import re

import pytest

from llm_act.cli.main import main
from llm_act.sites import MOE_SITES

MIXTRAL = ["plan", "--model", "mixtral-8x7b", "--seq-length", "4096", "--dp", "8", "--zero-stage", "1", "--pp", "4"]


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
    first = out.split("stage 1 of")[0]
    rows = dict(re.findall(r"^  (moe\.\S+)\s+(\S+)\s+[\d.]+", first, re.M))
    assert set(rows) == set(MOE_SITES), rows
    assert not re.search(r"^  mlp\.(fc1|act|fc2)_input", out, re.M)
    report = json.loads(out_json.read_text())
    assert report["feasible"] and report["stages"][0]["total_bytes"] <= 60e9
    keep_all = float(re.search(r"keeping everything stores ([\d.]+) GiB", out).group(1)) * 2**30
    assert keep_all + report["stages"][0]["static_bytes"] > 60e9  # keeping everything does not fit ...
    assert set(rows.values()) - {"keep"}  # ... so stage 0's plan compresses or recomputes MoE sites


def test_expert_parallelism_shrinks_static_memory(tmp_path):
    static = {}
    for ep in (2, 8):
        path = tmp_path / f"ep{ep}.json"
        main([*MIXTRAL, "--ep", str(ep), "--budget", "200GB", "--json", str(path)])
        static[ep] = json.loads(path.read_text())["stages"][0]["static_bytes"]
    # per rank a quarter of the experts, but their optimizer state shards over dp/ep = 1
    # rank instead of 4: the experts' static memory halves (6 + 12/4 -> (6 + 12) / 4 bytes)
    assert static[8] < 0.6 * static[2]


def test_experts_shard_over_their_own_data_parallel_group():
    """At dp = ep no rank shares an expert: ZeRO has nothing to shard (one stage of Mixtral
    does not fit an 80 GB device); at dp = 8 x ep, each expert's optimizer state is split 8 ways."""
    from llm_act.planner.presets import model_shape
    from llm_act.planner.static_memory import expert_parameters_per_rank, parameters_per_rank, static_bytes

    shape = model_shape("mixtral-8x7b", ep=8)
    experts, total = expert_parameters_per_rank(shape, 0), parameters_per_rank(shape, 0)
    dense = total - experts
    per_param = 2 + 4  # bf16 weight, fp32 main_grad
    optim = 4 + 8  # fp32 master copy and Adam's moments
    assert static_bytes(shape, 1, dp=8) == dense * per_param + -(-dense * optim // 8) + experts * (per_param + optim)
    assert static_bytes(shape, 1, dp=8) > 100e9
    assert static_bytes(shape, 1, dp=64) == (dense * per_param + -(-dense * optim // 64)
                                             + experts * per_param + -(-experts * optim // 8))
    with pytest.raises(ValueError, match="dp=4 is not a multiple of ep=8"):
        static_bytes(shape, 1, dp=4)


def test_dp_not_a_multiple_of_ep_names_the_flag(capsys):
    with pytest.raises(SystemExit) as err:
        main([*MIXTRAL, "--ep", "8", "--dp", "4", "--budget", "80GB"])
    assert err.value.code == 2
    assert "argument --dp: 4 is not a multiple of --ep 8" in capsys.readouterr().err


@pytest.mark.parametrize("model, ep, match", [
    ("mixtral-8x7b", "3", "argument --ep: ep=3 does not divide num_experts=8"),
    ("gpt-7b", "2", "argument --ep: .*needs an MoE model"),
])
def test_bad_ep_names_the_flag(capsys, model, ep, match):
    with pytest.raises(SystemExit) as err:
        main(["plan", "--model", model, "--ep", ep, "--budget", "80GB"])
    assert err.value.code == 2
    assert re.search(match, capsys.readouterr().err)
