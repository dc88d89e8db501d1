"""`llm-act bench hf-peak` on a small model: "auto"'s predicted peak against the live-storage
tracker's, on a Hugging Face Llama under the DeepSpeed door (issue 45, item 2).

Held to: the loss's backward priced (`Controller.loss_event_bytes`: two float32 tensors of
the logits' size), so plan "keep", whose peak is that backward, is predicted within 1%, and
its measured peak is that backward. (The other plans' gaps, which depend on the model's
depth and length, are the bench's figures: docs/benchmarks.md section 5.)
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


def test_keeps_peak_is_the_loss_backward_and_is_predicted(megatron_one_rank, small):
    from tests.test_budget_doors import _ds_env

    _ds_env()
    rows, sites = small.measure_rows("llama", 0)
    by_plan = {r["plan"]: r for r in rows}
    gap = {name: r["predicted"] / r["measured"] - 1 for name, r in by_plan.items()}
    keep = by_plan["keep"]
    assert "log_softmax_backward" in keep["peak_at"]  # the loss's backward is keep's peak
    # the loss event: the transient of keep, two float32 copies of [batch, seq, vocabulary]
    assert keep["transient"] == 2 * 4 * small.MICRO_BATCH * small.SEQ * 256
    assert abs(gap["keep"]) < 0.01, gap
    assert {s["site"] for s in sites} >= {"ln1.input", "attn.qkv_input", "mlp.fc1_input"}


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
