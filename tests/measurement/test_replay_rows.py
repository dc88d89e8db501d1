"""The recorded training step replayed on its first rows (`StepReplay.probe(rows=...)`), on a
real megatron-core GPT (CPU): the samples of a transformer batch are independent, so the
first rows' replay gives exactly those rows' share of the whole replay, each weighted as in
the whole batch, at a share of the cost."""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act.measurement.replay import StepReplay, first_rows
from llm_act.measurement.sensitivity import per_row_losses
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _recorded(batch_size: int = 4):
    model = R.build(dropout=0.0, num_layers=2)
    replay = StepReplay(lambda: True)
    replay.install([model])
    ids, pos, labels = R.batch(1, batch_size=batch_size)
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return model, replay


def _grads(model, out) -> list[torch.Tensor]:
    per = per_row_losses(out)
    return list(torch.autograd.grad(per.mean(), [p for p in model.parameters()], allow_unused=True))


def test_first_rows_replay_is_those_rows_share_of_the_whole():
    model, replay = _recorded(batch_size=4)
    assert replay.batch_rows() == 4
    whole = replay.probe()()
    part = replay.probe(rows=2)()
    assert whole.shape == (4,) and part.shape == (2,)
    # per-row loss: the whole batch's mean is its sum; the first rows' weighted alike
    torch.testing.assert_close(part / 2, whole[:2] / 4, rtol=1e-5, atol=1e-7)
    # the gradient of the first rows' replay is those rows' part of the whole gradient (the
    # whole replay's mean is the sum of the rows' real linearised losses: each row is 1/4 of it)
    g_part = _grads(model, replay.probe(rows=2)())
    out = replay.probe()()
    weights = torch.tensor([1.0, 1.0, 0.0, 0.0])
    g_masked = torch.autograd.grad((out * weights).sum() / 4, list(model.parameters()), allow_unused=True)
    for a, b in zip(g_part, g_masked):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_rows_of_the_whole_batch_or_more_replay_everything():
    _, replay = _recorded(batch_size=2)
    torch.testing.assert_close(replay.probe(rows=2)(), replay.probe()())
    torch.testing.assert_close(replay.probe(rows=8)(), replay.probe()())


def test_first_rows_cut_only_tensors_led_by_the_batch():
    ids = torch.arange(12).reshape(4, 3)
    mask = torch.ones(1, 1, 3, 3)  # broadcast over the batch: not cut
    args = first_rows((ids, mask, None), 4, 2)
    assert torch.equal(args[0], ids[:2]) and args[1] is mask and args[2] is None
    kwargs = first_rows({"labels": ids, "flag": True}, 4, 1)
    assert torch.equal(kwargs["labels"], ids[:1]) and kwargs["flag"] is True
