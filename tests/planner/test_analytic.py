"""The analytic profile: bytes per site against hand-computed sizes, what tensor and
sequence parallelism split, codec options as the registry allows them, static memory,
and plans over every preset."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llm_act.codecs import make_codec
from llm_act.codecs.registry import CODEC_NAMES, check_choice
from llm_act.planner import InfeasibleBudget, evaluate_plan, solve_plan
from llm_act.planner.analytic import block_profile, codec_variance, stage_blocks
from llm_act.planner.model_shape import DeviceModel
from llm_act.planner.presets import MODELS, model_shape
from llm_act.planner.static_memory import outer_bytes, parameters_per_rank, static_bytes
from llm_act.sites import SITES

S, B, H, A = 1024, 4, 1024, 16  # a GPT-2-medium-like block
MEDIUM = model_shape("gpt2-medium", seq_length=S, micro_batch_size=B)


def _bytes(blk):
    return {s.name: s.nbytes for s in blk.sites}


def test_gpt2_medium_site_bytes_by_hand():
    assert (MEDIUM.hidden_size, MEDIUM.num_attention_heads, MEDIUM.dropout) == (H, A, 0.1)
    sbh = S * B * H
    stats = 2 * 4 * S * B  # LayerNorm's fp32 mean and rstd per row
    got = _bytes(block_profile(MEDIUM))
    assert got == {
        "ln1.input": 2 * sbh, "attn.qkv_input": 2 * sbh + stats,
        "attn.q": 2 * sbh, "attn.k": 2 * sbh, "attn.v": 2 * sbh,
        "attn.out": 2 * sbh + 4 * B * A * S,  # output + fp32 logsumexp
        "attn.hidden_dropout_mask": sbh,  # bool
        "ln2.input": 2 * sbh, "mlp.fc1_input": 2 * sbh + stats,
        "mlp.act_input": 2 * S * B * 4 * H, "mlp.fc2_input": 2 * S * B * 4 * H,
        "mlp.hidden_dropout_mask": sbh,
    }
    unfused = _bytes(block_profile(MEDIUM.with_(attention="stock")))
    # Korthikanti et al.: 5as^2b per layer, the 16-bit softmax and dropped probabilities + a bool mask
    assert unfused["attn.softmax"] == 4 * B * A * S * S
    assert unfused["attn.dropout_mask"] == B * A * S * S
    assert unfused["attn.out"] == 2 * sbh  # no logsumexp on the unfused path
    quiet = _bytes(block_profile(MEDIUM.with_(dropout=0.0)))
    assert not any(name.endswith("dropout_mask") for name in quiet)
    assert "attn.softmax" not in quiet and len(quiet) == 10
    fp32 = _bytes(block_profile(MEDIUM.with_(dtype="fp32")))
    assert fp32["ln1.input"] == 4 * sbh and fp32["attn.qkv_input"] == 4 * sbh + stats


def test_site_inputs_follow_the_dataflow():
    blk = block_profile(MEDIUM.with_(attention="stock"))
    inputs = {s.name: set(s.inputs) for s in blk.sites}
    assert inputs["attn.qkv_input"] == {"ln1.input"}
    assert inputs["attn.q"] == inputs["attn.k"] == inputs["attn.v"] == {"attn.qkv_input"}
    assert inputs["attn.softmax"] == {"attn.q", "attn.k"}
    assert inputs["attn.out"] == {"attn.softmax", "attn.v", "attn.dropout_mask"}
    assert inputs["ln2.input"] == {"ln1.input", "attn.out", "attn.hidden_dropout_mask"}
    assert inputs["mlp.fc1_input"] == {"ln2.input"}
    assert inputs["mlp.act_input"] == {"mlp.fc1_input"}
    assert inputs["mlp.fc2_input"] == {"mlp.act_input"}
    fused = {s.name: set(s.inputs) for s in block_profile(MEDIUM).sites}
    assert fused["attn.out"] == {"attn.q", "attn.k", "attn.v"}
    assert [s.name for s in blk.sites] == [n for n in SITES if n in inputs]
    ln1 = blk.sites[0]
    assert ln1.name == "ln1.input" and not ln1.recomputable


def test_tensor_parallel_splits_what_megatron_splits():
    one = _bytes(block_profile(MEDIUM))
    tp = _bytes(block_profile(MEDIUM.with_(tp=4)))
    split = {"attn.q", "attn.k", "attn.v", "mlp.act_input", "mlp.fc2_input"}
    for name, nbytes in one.items():
        if name in split:
            assert tp[name] == nbytes // 4, name
        elif name == "attn.out":
            assert tp[name] == 2 * S * B * H // 4 + 4 * B * (A // 4) * S
        else:  # norm inputs and hidden dropout masks are replicated across the TP group
            assert tp[name] == nbytes, name
    sp = _bytes(block_profile(MEDIUM.with_(tp=4, sequence_parallel=True)))
    for name, nbytes in one.items():
        assert sp[name] == tp[name] if name in split or name == "attn.out" else sp[name] == nbytes // 4
    unfused = _bytes(block_profile(MEDIUM.with_(tp=4, attention="stock")))
    assert unfused["attn.softmax"] == 4 * B * (A // 4) * S * S


def test_gqa_and_swiglu():
    llama = model_shape("llama-8b", seq_length=2048, tp=2)
    got = _bytes(block_profile(llama))
    tokens = 2048
    assert got["attn.q"] == 2 * tokens * (32 // 2) * 128 + 4 * tokens * 128 * 2  # + RoPE's cos/sin
    assert got["attn.k"] == 2 * tokens * (8 // 2) * 128  # un-expanded K/V
    # RoPE makes Q and K new tensors; V stays a view of the fused QKV output, so keeping V
    # holds that whole buffer, while its codecs store V's share alone
    assert got["attn.v"] == 2 * tokens * (32 // 2 + 2 * (8 // 2)) * 128
    v = next(s for s in block_profile(llama).sites if s.name == "attn.v")
    int8 = next(o for o in v.codecs if o.name == "int8")
    assert int8.nbytes < got["attn.k"]  # 8.5 bits of V's own elements
    assert got["mlp.act_input"] == 2 * tokens * 2 * 14336 // 2  # both halves of fc1
    assert got["mlp.fc2_input"] == 2 * tokens * 14336 // 2
    assert not any(name.endswith("dropout_mask") for name in got)


def test_codec_options_come_from_the_registry_and_the_codecs():
    blk = block_profile(MEDIUM)
    lse = 4 * B * A * S
    for site in blk.sites:
        allowed = set()
        for name in CODEC_NAMES:
            try:
                allowed.add(check_choice(site.name, name))
            except ValueError:
                pass
        assert {c.name for c in site.codecs} == allowed, site.name
    by = {s.name: {c.name: c for c in s.codecs} for s in blk.sites}
    bf16 = torch.bfloat16
    stats = 2 * 4 * S * B  # LayerNorm's statistics stay beside any codec of its output
    assert by["ln1.input"]["int8"].nbytes == make_codec("int8").nbytes_for((S, B, H), bf16)
    assert by["attn.qkv_input"]["int8"].nbytes == make_codec("int8").nbytes_for((S, B, H), bf16) + stats
    assert by["attn.q"]["int4_channel"].nbytes == make_codec("int4_channel").nbytes_for((S, B, A, H // A), bf16)
    assert by["attn.out"]["fp8_e4m3"].nbytes == make_codec("fp8_e4m3").nbytes_for((S, B, H), bf16) + lse
    outlier = make_codec("outlier_int4")
    # its fixed slots, 1/64 of the channels (16 of 1024), whatever the outlier rate
    assert by["ln2.input"]["outlier_int4"].nbytes == outlier.nbytes_for((S, B, H), bf16, n_outliers=H // 64)
    assert by["mlp.act_input"]["fewbit3"].nbytes == make_codec("fewbit3").nbytes_for((S, B, 4 * H), bf16)
    assert by["mlp.hidden_dropout_mask"]["bitmask"].nbytes == S * B * H // 8
    assert by["mlp.hidden_dropout_mask"]["regen"].nbytes == 16  # a CUDA philox state
    cpu = {s.name: {c.name: c for c in s.codecs} for s in block_profile(MEDIUM, DeviceModel.cpu()).sites}
    assert cpu["mlp.hidden_dropout_mask"]["regen"].nbytes == make_codec("regen").nbytes_for((1,), torch.bool, "cpu")
    # a gated unit needs f(a) itself: no few-bit option under SwiGLU
    llama = block_profile(model_shape("llama-8b", seq_length=256, num_layers=1))
    act = next(s for s in llama.sites if s.name == "mlp.act_input")
    assert not any(c.name.startswith("fewbit") for c in act.codecs) and act.codecs


def test_noise_priors_and_times():
    # S is the codec's own error model on N(0, 1): more bits, less noise; lossless codecs 0
    assert codec_variance("int2") > codec_variance("int4") > codec_variance("int8") > 0
    assert codec_variance("bitmask") == codec_variance("regen") == 0.0
    assert codec_variance("fewbit2", "gelu") != codec_variance("fewbit2", "silu")
    dev = DeviceModel()
    assert dev.matmul_tflops == pytest.approx(790 * 0.6)
    sites = {s.name: s for s in block_profile(MEDIUM, dev).sites}
    # the FFN up-projection: 2 * tokens * h * 4h FLOPs
    assert sites["mlp.act_input"].forward_ms == pytest.approx(
        2 * S * B * H * 4 * H / (dev.matmul_tflops * 1e12) * 1e3 + dev.launch_ms)
    # a norm reads and writes [s, b, h]
    assert sites["mlp.fc1_input"].forward_ms == pytest.approx(
        2 * 2 * S * B * H / (dev.hbm_gbs * 1e9) * 1e3 + dev.launch_ms)
    int8 = next(c for c in sites["mlp.fc1_input"].codecs if c.name == "int8")
    encoded = int8.nbytes - 2 * 4 * S * B  # the norm's statistics beside it are not encoded
    assert int8.encode_ms == pytest.approx((2 * S * B * H + encoded) / (dev.hbm_gbs * 1e6) + dev.launch_ms)
    slow = {s.name: s for s in block_profile(MEDIUM, DeviceModel.cpu()).sites}
    assert slow["mlp.act_input"].forward_ms > 100 * sites["mlp.act_input"].forward_ms


def test_keep_plan_bytes_are_the_sum_of_site_bytes():
    for shape in (MEDIUM, MEDIUM.with_(attention="stock", tp=2), model_shape("llama-8b", seq_length=1024)):
        blk = block_profile(shape, count=6, inflight=3)
        plan = evaluate_plan([blk], [{s.name: "keep" for s in blk.sites}])
        assert plan.activation_bytes == 6 * 3 * sum(s.nbytes for s in blk.sites)
        assert plan.overhead_ms == 0.0


def test_stage_blocks_follow_1f1b():
    shape = model_shape("gpt-13b", tp=8, pp=4)
    for k in range(4):
        blk, *after = stage_blocks(shape, k)
        assert (blk.count, blk.inflight) == (10, 4 - k)
        # the last stage plans the final norm's input too, once
        assert [(b.count, b.inflight, [s.name for s in b.sites]) for b in after] == (
            [(1, 1, ["final_norm.input"])] if k == 3 else [])
    with pytest.raises(ValueError, match="stage"):
        stage_blocks(shape, 4)
    assert "loss.logits" in outer_bytes(shape, 3) and "loss.logits" not in outer_bytes(shape, 0)
    assert outer_bytes(shape, 0)["embedding.dropout_mask"] == 4 * 2048 * 5120  # 4 in flight


def test_parameters_and_static_bytes():
    gpt = model_shape("gpt-7b")
    h, v = 4096, 50304  # 50257 padded to a multiple of 128
    assert gpt.padded_vocab_size == v
    layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    assert parameters_per_rank(gpt, 0) == 32 * layer + v * h + 2048 * h + 2 * h
    assert 6.6e9 < parameters_per_rank(gpt, 0) < 6.8e9
    n = parameters_per_rank(gpt, 0)
    assert static_bytes(gpt) == 18 * n  # bf16 weights, fp32 grads, fp32 master, two Adam moments
    assert static_bytes(gpt, zero_stage=1, dp=8) == 6 * n + 12 * n // 8
    assert static_bytes(gpt, zero_stage=3, dp=8) == 18 * n // 8
    tp8 = parameters_per_rank(gpt.with_(tp=8), 0)
    assert n / 8 < tp8 < n / 8 * 1.02  # norms, row-parallel biases, positions are replicated
    llama = model_shape("llama-8b")
    assert 8.0e9 < parameters_per_rank(llama, 0) < 8.1e9  # untied embeddings, no biases
    piped = gpt.with_(pp=4)
    assert static_bytes(piped) == max(static_bytes(piped, stage=k) for k in range(4))
    assert static_bytes(piped, stage=1) < static_bytes(piped, stage=0)  # no embedding
    with pytest.raises(ValueError, match="zero_stage"):
        static_bytes(gpt, zero_stage=4)


def test_cost_is_monotone_in_the_budget_for_gpt_7b_tp8():
    shape = model_shape("gpt-7b", seq_length=4096, tp=8)
    blocks = stage_blocks(shape, 0)
    static = static_bytes(shape) + sum(outer_bytes(shape, 0).values())
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan(blocks, static, static_bytes=static)
    lo = err.value.min_budget_bytes
    hi = static + 32 * sum(s.nbytes for s in blocks[0].sites) + sum(s.nbytes for s in blocks[1].sites)
    costs = []
    for budget in np.linspace(lo, hi, 8).astype(np.int64):
        plan = solve_plan(blocks, int(budget), static_bytes=static)
        assert plan.activation_bytes + static <= budget
        costs.append(plan.overhead_ms)
    assert all(b <= a + 1e-9 for a, b in zip(costs, costs[1:])), costs
    assert costs[0] > costs[-1] == 0.0


@pytest.mark.parametrize("name", list(MODELS))
def test_every_preset_plans_at_some_budget(name):
    shape = model_shape(name, seq_length=1024, tp=8 if MODELS[name].num_attention_heads >= 32 else 1, pp=2)
    for k in range(2):
        blocks = stage_blocks(shape, k)
        assert {s.name for s in blocks[0].sites} <= set(SITES)
        static = static_bytes(shape, stage=k)
        with pytest.raises(InfeasibleBudget) as err:
            solve_plan(blocks, static, static_bytes=static)
        edge = err.value.min_budget_bytes
        plan = solve_plan(blocks, edge, static_bytes=static)
        assert plan.activation_bytes == edge - static
        assert set(plan.choice[0].values()) - {"keep"}


@pytest.mark.parametrize("changes, match", [
    (dict(tp=3), "tp=3 does not divide num_attention_heads"),
    (dict(num_query_groups=5), "num_query_groups=5"),
    (dict(pp=5), "pp=5 does not divide num_layers"),
    (dict(tp=2, seq_length=1023, sequence_parallel=True), "sequence parallel"),
    (dict(activation="swish"), "activation"),
    (dict(dtype="int8"), "dtype"),
    (dict(dropout=1.0), "dropout"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(attention="flash"), "attention"),
])
def test_bad_shapes_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        MEDIUM.with_(**changes)
    with pytest.raises(ValueError, match="unknown model"):
        model_shape("gpt-9b")


def test_presets_are_the_published_shapes():
    want = {  # layers, hidden, heads, query groups, ffn
        "gpt2-medium": (24, 1024, 16, 16, 4096), "gpt-1.3b": (24, 2048, 16, 16, 8192),
        "gpt-7b": (32, 4096, 32, 32, 16384), "gpt-13b": (40, 5120, 40, 40, 20480),
        "gpt-175b": (96, 12288, 96, 96, 49152), "llama-8b": (32, 4096, 32, 8, 14336),
        "llama-70b": (80, 8192, 64, 8, 28672),
    }
    for name, shape in MODELS.items():
        if shape.is_moe:
            continue  # the MoE presets: tests/planner/test_analytic_moe.py
        assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads,
                shape.num_query_groups, shape.ffn_hidden_size) == want[name]
        llama = name.startswith("llama")
        assert shape.gated_linear_unit == llama and shape.bias != llama
        assert (shape.activation, shape.normalization) == (("silu", "RMSNorm") if llama else ("gelu", "LayerNorm"))
    assert math.isclose(parameters_per_rank(MODELS["gpt-175b"], 0), 175e9, rel_tol=0.01)
