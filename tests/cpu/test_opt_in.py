"""The CPU stand-ins only on request (issue 29): on a CPU-only host `init_parallel`,
`layer_spec` and `apply` never patch megatron-core; what runs without the stand-ins runs
(and computes what it computes with them); what needs them raises one line naming
`llm_act.cpu.install()`. One fresh process (`opt_in_run`), so no install leaks in."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-ins are for CPU-only hosts")

ROOT = Path(__file__).resolve().parents[2]
FIX = "call llm_act.cpu.install() first"


@pytest.fixture(scope="module")
def run() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.cpu.opt_in_run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _refused(message: str, part: str, where: str) -> None:
    assert message.startswith(f"CpuStandInsMissing: {where}: "), message
    assert part in message and FIX in message and "\n" not in message, message


def test_nothing_is_patched_without_the_opt_in(run):
    assert run["patched before install"] == []  # e.g. tensor_parallel.layers.torch is torch


def test_what_runs_without_stand_ins_runs_and_matches_the_stand_ins(run):
    """A dense GPT (learned positions) on one gloo rank: forward and backward under apply(),
    built from the stock spec or layer_spec(), and MoE with the compressing plan."""
    for case in ("dense compress", "dense layer_spec", "dense keep sdpa", "moe compress",
                 "dense hidden dropout"):
        assert run[case].startswith("ok "), (case, run[case])
    assert run["dense compress"] == run["dense layer_spec"] == run["dense compress installed"]


def test_init_parallel_refuses_before_starting_anything(run):
    _refused(run["init_parallel"], "model_parallel_cuda_manual_seed", "init_parallel")
    assert run["init_parallel started gloo"] is False


def test_parts_that_need_stand_ins_name_the_opt_in(run):
    _refused(run["rope"], "RoPE", "apply")
    assert run["rope converted"] == "DotProductAttention"  # refused before anything changed
    _refused(run["layer_spec alltoall"], "alltoall MoE token dispatcher", "layer_spec")
    _refused(run["keep"], "stock attention", "llm_act core attention (layer 0)")
    _refused(run["attention dropout"], "attention dropout", "llm_act core attention (layer 0)")
    _refused(run["recompute"], "recomputation", "llm_act recompute")
    _refused(run["moe keep"], "MoE router", "llm_act MoE router")


def test_the_opt_in_runs_them(run):
    assert run["install"] and run["installed"] is True
    assert "megatron.core.tensor_parallel.layers" in run["patched after install"]
    for case in ("init_parallel installed", "rope installed", "keep installed", "recompute installed"):
        assert run[case].startswith("ok"), (case, run[case])
