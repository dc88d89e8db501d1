"""`llm-act bench memory|planner|convergence --quick` run in-process, and their numbers agree
with the ledger tests: stock bytes per s*b*h are the ledger test's analysis, the compress
plan's sites hold exactly their codecs' `nbytes`, the process holds what the ledger counts,
and the quick convergence run gives finite, decreasing losses."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("pulp")

from llm_act.bench import convergence as C  # noqa: E402
from llm_act.bench import memory as M  # noqa: E402
from llm_act.bench import planner as P  # noqa: E402
from llm_act.bench import report as R  # noqa: E402
from llm_act.codecs import make_codec  # noqa: E402
from tests.ledger.test_ledger import expected_per_sbh  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")


@pytest.fixture(scope="module")
def bench_all(quick_convergence, tmp_path_factory):
    """`llm-act bench all --quick` once (the quick convergence reused from its JSON, as
    `--convergence-json` does): {"out": its folder, "stdout": what it printed, and the return
    values of the memory and planner sections it ran, recorded on their way out}."""
    import contextlib
    import io
    import json

    from llm_act.cli.main import main

    out = tmp_path_factory.mktemp("all")
    saved = out / "conv.json"
    saved.write_text(json.dumps(quick_convergence[0]))
    got = {"out": out}

    def recorded(name):
        real = getattr(R, name)

        def call(*args, **kwargs):
            got[name] = real(*args, **kwargs)
            return got[name]
        return call

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        for name in ("run_memory", "run_planner"):
            mp.setattr(R, name, recorded(name))
        assert main(["bench", "all", "--quick", "--output-dir", str(out),
                     "--convergence-json", str(saved)]) == 0
    got["stdout"] = printed.getvalue()
    return got


@pytest.fixture(scope="module")
def memory_rows(bench_all):
    rows, text = bench_all["run_memory"]
    assert (bench_all["out"] / "memory_per_layer.png").stat().st_size > 0
    assert "| stock |" in text and "Command: `llm-act bench all --quick --output-dir" in text
    return rows


def test_memory_section_has_the_hf_decoders_per_site(bench_all):
    """`llm-act bench memory` gives the Hugging Face Llama's and Qwen3's bytes per site (issue 45)."""
    _, text = bench_all["run_memory"]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines()
            if line.startswith("| llama |") or line.startswith("| qwen3 |")}
    assert {("llama", "attn.qkv_input"), ("llama", "mlp.act_input"), ("qwen3", "attn.q_norm_input")} <= set(rows)
    cells = rows[("llama", "mlp.act_input")].split("|")
    keep, int8, int4 = (float(cells[i]) for i in (4, 5, 6))
    assert keep > int8 > int4 > 0


def _row(rows, name, dropout):
    return next(r for r in rows if r["scheme"] == name and r["shape"].dropout == dropout)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_stock_bytes_are_the_ledger_tests_figure(memory_rows, dropout):
    r = _row(memory_rows, "stock", dropout)
    sh = r["shape"]
    want = sum(expected_per_sbh(sh.torch_dtype, dropout, sh.seq_length, sh.micro_batch_size, sh.hidden_size,
                                sh.num_attention_heads).values())
    assert r["per_sbh"] == pytest.approx(want, rel=1e-9)
    assert r["ratio"] == 1.0
    assert r["held_per_sbh"] == pytest.approx(r["per_sbh"], rel=0.01)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compress_sites_hold_their_codecs_nbytes(memory_rows, dropout):
    r = _row(memory_rows, "compress (Adacc)", dropout)
    sh = r["shape"]
    sites = r["by_site"]
    s, b, h, dt = sh.seq_length, sh.micro_batch_size, sh.hidden_size, sh.torch_dtype
    qkv = make_codec("int4_channel").nbytes_for((s, b, sh.num_attention_heads, sh.head_dim), dt)
    rope = 4 * s * sh.head_dim * sh.elem_bytes  # booked with Q
    assert sites[(0, "attn.q")] - rope == sites[(0, "attn.k")] == sites[(0, "attn.v")] == qkv
    act = make_codec("fewbit3", activation="gelu").nbytes_for((s, b, 4 * h), dt)
    assert sites[(0, "mlp.act_input")] == act
    assert (0, "attn.softmax") not in sites
    assert r["held_per_sbh"] == pytest.approx(r["per_sbh"], rel=0.01)
    assert r["ratio"] < 0.2
    # ActNN: every linear input at int2 (4 * h wide for fc2), nothing else beside it
    a = _row(memory_rows, "ActNN int2", dropout)["by_site"]
    assert a[(0, "mlp.fc2_input")] == make_codec("int2").nbytes_for((s, b, 4 * h), dt)
    # recompute: full keeps only the block input (2 bytes per element in bf16)
    full = _row(memory_rows, "megatron full", dropout)["by_site"]
    assert sum(n for (layer, _), n in full.items() if layer == 0) == 2 * M.sbh(sh)


def test_schemes_order_and_planner_budgets(memory_rows):
    for d in (0.0, 0.1):
        ratio = {r["scheme"]: r["ratio"] for r in memory_rows if r["shape"].dropout == d}
        assert ratio["megatron full"] < ratio["megatron selective"] < 1.0
        assert ratio["Few-bit GELU 3-bit"] < 1.0
        assert ratio["planner tight"] <= ratio["planner loose"] < 1.0
    table = M.table(memory_rows)
    assert table.count("\n") == 1 + len({r["scheme"] for r in memory_rows})


def test_planner_quick(memory_rows, bench_all):
    res, text = bench_all["run_planner"]
    solve = res["solve"]
    assert [r["layers"] for r in solve] == list(P.DEPTHS[:2])
    assert solve[0]["variables"] == solve[1]["variables"] > 0  # identical layers share variables
    assert all(0 < r["seconds"] < 60 and r["activation_fraction"] <= P.BUDGET_FRACTION + 1e-9 for r in solve)
    (distinct,) = res["distinct"]  # per-layer sensitivities: 24 blocks, a 2 s limit
    assert distinct["layers"] == 24 and distinct["variables"] > 20 * solve[0]["variables"]
    assert distinct["seconds"] < 2.0 + 20 and distinct["overhead_ms"] <= distinct["uniform_ms"] * (1 + 1e-9)
    assert "| layers (distinct) |" in text
    comp = {r["scheme"]: r for r in res["compare"]}
    mem = _row(memory_rows, "compress (Adacc)", 0.1)
    assert comp["compress (Adacc)"]["measured"] == sum(
        n for (layer, _), n in mem["by_site"].items() if layer == 0)
    # the block input of full recompute is exact in both
    assert comp["megatron full"]["predicted"] == comp["megatron full"]["measured"]
    assert "| planner middle |" in text


@pytest.fixture(scope="module")
def quick_convergence(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv")
    (result,), text = R.run_convergence(True, str(out), "llm-act bench convergence --quick", log=lambda m: None)
    assert C.setting_of(result) is C.LOW_FLOOR  # the default: the low-floor setting (fp32)
    return result, text, out


def test_convergence_quick(quick_convergence):
    result, text, tmp_path = quick_convergence
    (entry,) = result["models"].values()
    runs = entry["runs"]
    assert set(runs) == {f"{p} seed {s}" for p in ("stock", C.DEFAULT, "compress", "auto 0.15")
                         for s in (1234, 1235)}
    for name, r in runs.items():
        assert C.finite_decreasing(r), name
        assert len(r["valid"]) == len(r["steps"]) and r["steps"][-1] == 30
        assert r["block_bytes"] > 0 and r["static_bytes"] > 0
    stock = runs["stock seed 1234"]
    # the plans store a fraction of stock in the layers; auto within its budget's share (the
    # budget reserves one layer's q/k/v/out for the backward transient: a plan whose transient
    # is smaller may store that much more)
    assert runs["compress seed 1234"]["block_bytes"] < 0.3 * stock["block_bytes"]
    auto = runs["auto 0.15 seed 1234"]
    assert auto["block_bytes"] <= 0.15 * stock["block_bytes"] + stock["transient_bytes"], auto["plan"]
    assert auto["block_bytes"] < 0.3 * stock["block_bytes"], auto["plan"]
    assert 0 < auto["measuring"] < 1 and auto["changes"] >= 1 and auto["noise_budget"] > 0
    assert 0 < result["entropy"] < math.log(256)
    assert (tmp_path / "convergence.png").stat().st_size > 0
    # paired differences: plan at seed s against stock at seed s, their mean and error
    s = C.summary(result)["quick"]["plans"]["compress"]
    per = {seed: runs[f"compress seed {seed}"]["valid_full"] / runs[f"stock seed {seed}"]["valid_full"] - 1
           for seed in (1234, 1235)}
    assert s["per_seed"] == pytest.approx(per) and s["mean"] == pytest.approx(sum(per.values()) / 2)
    assert s["se"] == pytest.approx(abs(per[1234] - per[1235]) / 2)
    assert "paired with stock over 2 seeds" in text and "Target" in text
    # issue 42: every run is read on the whole validation split; the default plan (one flag) is
    # the verdict plan, and every run with the controller records its plan changes
    assert all(r["valid_tokens"] == len(C.embedded_corpus().valid) - 1 for r in runs.values())
    assert result["verdict_plan"] == C.DEFAULT and result["evaluation"] == "whole validation split"
    default = runs[f"{C.DEFAULT} seed 1234"]
    assert default["plan_changes"] and default["plan_changes"][0] == 1
    assert default["history"][0]["reason"] == "first plan"
    assert default["churn"] == C.churn(default["plan_changes"], 30)
    assert runs["compress seed 1234"]["plan_changes"] == [] and "plan_changes" not in stock
    assert "plan changes per 100 it. after warm-up" in text and "whole validation split" in text


def test_an_interrupted_convergence_goes_on_where_it_stopped(quick_convergence, tmp_path):
    """A saved unfinished result keeps its runs: only what is missing trains again."""
    import copy

    result = copy.deepcopy(quick_convergence[0])
    del result["complete"]
    runs = result["models"]["quick"]["runs"]
    kept = runs.pop("auto 0.15 seed 1235")
    trained = []
    again = C.run(steps=30, quick=True, seeds=(1234, 1235), plans=(C.DEFAULT, "compress", "auto 0.15"),
                  models=(C.QUICK_MODEL,), previous=result, log=trained.append, setting=C.setting_of(result))
    assert len(trained) == 1 and "auto 0.15 seed 1235" in trained[0]
    assert again["models"]["quick"]["runs"]["stock seed 1234"] is runs["stock seed 1234"]
    assert again["models"]["quick"]["runs"]["auto 0.15 seed 1235"]["steps"] == kept["steps"]


def test_gpu_section_without_cuda_says_pending():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the section is measured, not pending")
    _, text = R.run_gpu("llm-act bench gpu", log=lambda m: None)
    assert "pending: no GPU in this run" in text


def test_gpu_bench_code_runs_on_cpu():
    """The GPU suite's CPU-side pieces: plan choice per micro-batch and the table, on a tiny
    GPT on CPU (numbers meaningless; peak memory absent)."""
    from llm_act.bench import gpu as G

    shape = G.gpt_shape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    assert G.ours_choice(shape, 1, 1) is None  # one byte fits nothing
    res = G.run(shape, device="cpu", sizes=(1, 2), repeat=1)
    fits = [r for r in res["rows"] if r["fits"]]
    assert {r["scheme"] for r in fits} == set(G.SCHEMES) - {G.NATIVE_OFFLOAD}  # offload needs CUDA
    assert all(r["tokens_per_s"] > 0 for r in fits)
    assert G.largest(res["rows"], "ours") == 2
    assert "| megatron full |" in G.table(res)


def test_bench_all_quick_writes_every_section(bench_all):
    """`llm-act bench all --quick` writes benchmarks.md with the four sections and the plots."""
    out = bench_all["out"]
    doc = (out / "benchmarks.md").read_text()
    for title in ("## 1. Memory per layer", "## 2. Convergence (30 steps, quick)", "## 3. Planner", "## 4. GPU"):
        assert title in doc, title
    assert "Command: `llm-act bench all --quick --output-dir" in doc
    assert "| layers (distinct) |" in doc and "paired with stock over 2 seeds" in doc
    for png in ("memory_per_layer.png", "convergence.png"):
        assert (out / png).stat().st_size > 0
    assert f"wrote {out / 'benchmarks.md'}" in bench_all["stdout"]


def test_keeping_v_is_predicted_as_the_whole_qkv_buffer():
    """With RoPE, V is the last view of the fused QKV output: a plan that compresses Q and K
    but keeps V holds the whole buffer, and the analytic profile must say so (it once counted
    V alone and under-predicted such a plan by 4 bytes per s*b*h)."""
    from tests import testing

    shape = M.block_shape(s=128, b=2, h=256, a=8, dropout=0.0)
    scheme = M.Scheme("q, k int4", "", {"attn.q": "int4_channel", "attn.k": "int4_channel"},
                      attention="auto", convert_attention=True)
    testing.init_parallel(seed=1234)
    try:
        res = M.measure(shape, scheme)
    finally:
        testing.destroy_parallel()
    measured = sum(n for (layer, _), n in res["by_site"].items() if layer == 0)
    assert res["by_site"][(0, "attn.v")] == 6 * M.sbh(shape)  # Q, K and V of the fused buffer
    assert P.predicted_block_bytes(shape, scheme) == pytest.approx(measured, rel=0.01)


def test_gact_scheme_compresses_every_tensor_and_recomputes_none():
    """GACT is a compression scheme: its plan stores every site at a GACT bit width (masks
    as bitmasks), never recomputing, neither site by site nor the whole block."""
    scheme = M.gact_scheme(M.block_shape(s=128, b=2, h=256, a=8, dropout=0.1))
    assert "recompute" not in scheme.choice.values()
    assert set(scheme.choice.values()) <= set(M.GACT_CODECS) | {"bitmask", "keep"}
    assert any(c in M.GACT_CODECS for c in scheme.choice.values())
