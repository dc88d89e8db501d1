"""`llm-act bench hf-peak` on a small model: "auto"'s predicted peak against the live-storage
tracker's, on a Hugging Face Llama under the DeepSpeed door (issue 45, item 2).

Held to: every plan's predicted peak within 3% of the measured one -- "keep" (whose peak is
the loss's backward, priced by `Controller.loss_event_bytes` and what the forward saves after
the blocks), "compress", INT4 everywhere, whole-block recompute, and "auto" at two budgets;
and the profile's backward pricing read from the model's shapes (`MeasuredProfile.
backward_priced`).
"""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@pytest.fixture
def small(monkeypatch):
    from llm_act.bench import hf_peak

    monkeypatch.setattr(hf_peak, "MODEL", {**hf_peak.MODEL, "num_layers": 2, "max_positions": 64})
    monkeypatch.setattr(hf_peak, "SEQ", 64)
    return hf_peak


def test_every_plans_peak_is_predicted_within_3_percent(megatron_one_rank, small):
    from tests.test_budget_doors import _ds_env

    _ds_env()
    rows, sites = small.measure_rows("llama", 0)
    by_plan = {r["plan"]: r for r in rows}
    gap = {name: r["predicted"] / r["measured"] - 1 for name, r in by_plan.items()}
    keep = by_plan["keep"]
    assert "log_softmax_backward" in keep["peak_at"]  # the loss's backward is keep's peak
    # keep's transient is the loss's: two float32 gradients of [batch, seq, vocabulary], and
    # the logits and log-probabilities the forward saved after the blocks, with the output
    # layer's input and the final norm's
    logits = 4 * small.MICRO_BATCH * small.SEQ * 256
    assert 4 * logits <= keep["transient"] <= 4 * logits + 3 * 4 * small.MICRO_BATCH * small.SEQ * 128
    assert abs(gap["keep"]) < 0.01, gap
    assert set(gap) == {"keep", "compress", "int4", "whole-block recompute", "auto", "auto, looser budget"}
    assert all(abs(g) < 0.03 for g in gap.values()), gap
    # a wrong gradients-in-flight term (none, or twice it) would miss INT4's peak by more
    assert by_plan["int4"]["measured"] - by_plan["int4"]["predicted"] < 0.5 * 2 * 4 * 64 * 4 * 352
    assert {s["site"] for s in sites} >= {"ln1.input", "attn.qkv_input", "mlp.fc1_input"}


def test_the_backward_is_priced_from_the_models_shapes(megatron_one_rank, small):
    """The generic door prices the backward (`Controller.backward_priced`): what the forward
    saved after the blocks moves from the bytes held through the step to the loss's; each
    block's gradients in flight per stage come from its sites' shapes; whole-block recompute
    keeps the block input alone, not the RMSNorm's normalised copy its site also holds."""
    from tests.test_budget_doors import _ds_env

    _ds_env()
    engine, _, _ = small._measured("llama", 0)
    profile = engine.act_controller.adapter.measured.profile
    tokens, h, f, vocab = small.MICRO_BATCH * small.SEQ, 128, 352, 256
    assert profile.backward_priced
    # the logits and log-probabilities (fp32 [tokens, vocab] each) and the output layer's input
    assert 2 * 4 * tokens * vocab + 4 * tokens * h <= profile.after_blocks_bytes <= 2 * 4 * tokens * vocab + 3 * 4 * tokens * h
    assert profile.loss_bytes == 2 * 4 * tokens * vocab + profile.after_blocks_bytes
    assert profile.other_bytes < 0.01 * profile.after_blocks_bytes
    assert profile.grad_stages(0) == (("mlp", 4 * (2 * tokens * f + tokens * h)), ("attention", 4 * 5 * tokens * h))
    block = profile.blocks(recompute=True)[0]
    assert block.stage_bytes == profile.grad_stages(0) and block.grad_bytes == 4 * (2 * tokens * f + tokens * h)
    ln1 = next(s for s in block.sites if s.name == "ln1.input")
    assert block.checkpoint_bytes == 4 * tokens * h and ln1.nbytes >= 2 * block.checkpoint_bytes
    again = type(profile).from_dict(profile.to_dict())
    assert (again.after_blocks_bytes, again.backward_priced, again.outside_bytes()) == (
        profile.after_blocks_bytes, True, profile.other_bytes + profile.after_blocks_bytes)


def test_site_rows_leave_no_rank_and_no_port_behind():
    """`llm-act bench memory`'s Hugging Face rows set up one rank of their own: afterwards the
    process has no process group and its rank variables as before, so child processes it
    starts later do not inherit a port it still listens on (twice: DeepSpeed's cached groups
    forgotten too)."""
    import os

    import torch

    from llm_act.bench import hf_peak

    if torch.distributed.is_initialized():  # an earlier test's rank: start from none, as a fresh process does
        from llm_act.train.parallel import destroy_parallel

        destroy_parallel()
    env = {key: os.environ.get(key) for key in hf_peak._RANK_ENV}
    for _ in range(2):
        rows = hf_peak.site_rows(2, 32)
        assert {(r["model"], r["site"]) for r in rows} >= {("llama", "attn.qkv_input"), ("qwen3", "attn.q_norm_input")}
        assert not torch.distributed.is_initialized()
        assert {key: os.environ.get(key) for key in hf_peak._RANK_ENV} == env
