"""`chunked_linear_cross_entropy` against plain torch, megatron-core and itself under TP=2.

Tolerances. fp32: the op does the reference's arithmetic in another order (chunked GEMMs,
the log-sum-exp by hand): loss within 1e-5 absolute, gradients within 1e-5 relative L2
(measured ~1e-7). bf16 against the fp32 reference: the op computes the logits the way stock
megatron does (a bf16 GEMM, then fp32) and casts dloss/dlogits to bf16 for the two
backward GEMMs, so the loss is off by the bf16 rounding of the logits (|logit| < ~4 here:
within 5e-2 absolute, measured ~8e-3) and the gradients by a few bf16 ulps (within 2e-2
relative L2, measured ~3e-3). A backward that drops the one-hot term or ignores the
incoming gradient is off by 0.7 to 1 relative L2: both bounds fail it (`test_bound_catches_*`).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llm_act.output import chunked_loss
from llm_act.output.chunked_loss import (
    ChunkedLinearCrossEntropy,
    chunked_linear_cross_entropy,
    stock_logits_bytes,
    stored_bytes,
)
from tests.rel_error import rel_error

S, B, H, V = 24, 2, 16, 96
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2)}  # (loss abs, grad rel L2)


def _inputs(dtype, s=S, b=B, h=H, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, v, (b, s), generator=g)
    grad = torch.rand(b, s, generator=g) + 0.1  # random, not all ones
    return hidden, weight, labels, grad


def _run(fn, hidden, weight, labels, grad):
    """(loss, grad_hidden, grad_weight) of `fn(hidden, weight, labels)` with `grad` fed back."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward(grad)
    return loss.detach(), h.grad, w.grad


def _reference(hidden, weight, labels):
    """Plain torch in fp32: the full [s, b, v] logits, per-token cross-entropy as [b, s]."""
    s, b, _ = hidden.shape
    logits = hidden.float() @ weight.float().t()
    loss = F.cross_entropy(logits.reshape(s * b, -1), labels.t().reshape(-1), reduction="none")
    return loss.view(s, b).t()


def _assert_close(got, ref, dtype):
    loss_tol, grad_tol = TOL[dtype]
    assert got[0].shape == ref[0].shape == (B, S) and got[0].dtype == torch.float32
    assert float((got[0] - ref[0]).abs().max()) < loss_tol
    assert got[1].dtype == got[2].dtype == dtype
    for g, r in zip(got[1:], ref[1:]):
        assert rel_error(g, r) < grad_tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 8, 7, 1000])  # 48 tokens: divides, does not, one chunk
def test_matches_torch_reference(dtype, chunk):
    hidden, weight, labels, grad = _inputs(dtype)
    ref = _run(_reference, hidden.float(), weight.float(), labels, grad)
    got = _run(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=chunk),
               hidden, weight, labels, grad)
    _assert_close(got, ref, dtype)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_allocates_the_logits():
    s, b, h, v, chunk = 64, 2, 16, 512, 8  # tokens*v = 65536; chunk*v = 4096, v*h = 8192
    hidden, weight, labels, grad = _inputs(torch.float32, s, b, h, v)
    hidden.requires_grad_()
    weight.requires_grad_()
    with _MaxNumel() as mode:
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk).backward(grad)
    assert hidden.grad is not None and weight.grad is not None
    assert mode.largest <= max(chunk * v, v * h) < s * b * v // 4, mode.largest
    with _MaxNumel() as stock:  # the probe does see a [tokens, vocab] tensor where one exists
        _reference(hidden, weight, labels).backward(grad)
    assert stock.largest >= s * b * v


def test_saves_hidden_and_one_float_per_token():
    hidden, weight, labels, _ = _inputs(torch.bfloat16)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    by_reference = {weight.data_ptr(), labels.data_ptr()}  # a parameter, the batch's labels
    own = {(t.data_ptr(), t.nbytes) for t in saved if t.data_ptr() not in by_reference}
    assert sum(n for _, n in own) == stored_bytes(S * B, H, 2) == S * B * (2 * H + 4)
    assert {t.dtype for t in saved} == {torch.bfloat16, torch.int64, torch.float32}


def test_nan_stays_nan_finite_stays_finite():
    hidden, weight, labels, grad = _inputs(torch.float32)
    hidden[3, 1, 0] = float("nan")
    hidden[5, 0] *= 1e3  # large finite logits stay finite
    loss, gh, _ = _run(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=7),
                       hidden, weight, labels, grad)
    nan = torch.zeros(B, S, dtype=torch.bool)
    nan[1, 3] = True
    assert torch.isnan(loss[nan]).all() and torch.isfinite(loss[~nan]).all()
    assert torch.isnan(gh[3, 1]).all() and torch.isfinite(gh[5, 0]).all()


def test_skips_the_weight_gradient_of_a_frozen_weight():
    hidden, weight, labels, grad = _inputs(torch.float32)
    h = hidden.clone().requires_grad_()
    chunked_linear_cross_entropy(h, weight, labels, chunk_tokens=7).backward(grad)
    ref = _run(_reference, hidden, weight, labels, grad)
    assert weight.grad is None and rel_error(h.grad, ref[1]) < 1e-5


@pytest.mark.parametrize("args, kwargs, err, match", [
    (((S, B), (V, H)), {}, ValueError, "hidden: expected"),
    (((S, B, H), (V, H + 1)), {}, ValueError, "weight: expected"),
    (((S, B, H), (V, H)), {"labels": (S, B)}, ValueError, "labels: expected"),
    (((S, B, H), (V, H)), {"labels_dtype": torch.int32}, TypeError, "labels: expected int64"),
    (((S, B, H), (V, H)), {"weight_dtype": torch.bfloat16}, TypeError, "weight: expected hidden's"),
    (((S, B, H), (V, H)), {"chunk_tokens": 0}, ValueError, "chunk_tokens"),
    (((S, B, H), (V, H)), {"chunk_tokens": 2.0}, ValueError, "chunk_tokens"),
])
def test_rejects_bad_inputs(args, kwargs, err, match):
    hidden = torch.randn(*args[0])
    weight = torch.randn(*args[1], dtype=kwargs.get("weight_dtype", torch.float32))
    labels = torch.zeros(kwargs.get("labels", (B, S)), dtype=kwargs.get("labels_dtype", torch.int64))
    with pytest.raises(err, match=match):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=kwargs.get("chunk_tokens", 4))


def test_byte_counts():
    # vocab 128k, 8k tokens: stock keeps 4.2 GB of fp32 softmax; the op 4 bytes a token
    assert stock_logits_bytes(8192, 131072) == 8192 * (4 * 131072 + 9)
    assert stored_bytes(8192, 4096, 2) - 8192 * 4096 * 2 == 8192 * 4
    # sequence parallel over 4 ranks: a quarter of the hidden states, a float for every token
    assert stored_bytes(8192, 4096, 2, sequence_shards=4) == 2048 * 4096 * 2 + 8192 * 4


# ---- the bounds are not loose: broken backwards fail them ----


class _IgnoresGrad(ChunkedLinearCrossEntropy):
    @staticmethod
    def backward(ctx, grad_loss):
        return ChunkedLinearCrossEntropy.backward(ctx, torch.ones_like(grad_loss))


def _no_one_hot(labels, start, vocab_local):
    return labels.clamp(0, vocab_local - 1), torch.zeros_like(labels, dtype=torch.bool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_catches_ignored_grad(dtype):
    hidden, weight, labels, grad = _inputs(dtype)
    ref = _run(_reference, hidden.float(), weight.float(), labels, grad)
    got = _run(lambda h, w, y: _IgnoresGrad.apply(h, w, y, 7, None, False), hidden, weight, labels, grad)
    assert min(rel_error(got[1], ref[1]), rel_error(got[2], ref[2])) > TOL[dtype][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_catches_dropped_one_hot(dtype, monkeypatch):
    hidden, weight, labels, grad = _inputs(dtype)
    ref = _run(_reference, hidden.float(), weight.float(), labels, grad)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, w, labels, chunk_tokens=7)
    monkeypatch.setattr(chunked_loss, "_local_target", _no_one_hot)  # backward only
    loss.backward(grad)
    assert float((loss - ref[0]).abs().max()) < TOL[dtype][0]  # forward was right
    assert min(rel_error(h.grad, ref[1]), rel_error(w.grad, ref[2])) > TOL[dtype][1]


# ---- megatron-core's vocab_parallel_cross_entropy on the full logits ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_megatron_vocab_parallel_cross_entropy(dtype, megatron_one_rank):
    from megatron.core import tensor_parallel

    def stock(h, w, y):  # megatron's GPT: logits from the output GEMM, loss in fp32, [b, s]
        return tensor_parallel.vocab_parallel_cross_entropy((h @ w.t()).float(), y.t().contiguous()).t()

    hidden, weight, labels, grad = _inputs(dtype)
    labels[0, :3] = torch.tensor([-1, V, V + 5])  # outside the vocab: target logit 0 in both
    ref = _run(stock, hidden, weight, labels, grad)
    got = _run(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=7),
               hidden, weight, labels, grad)
    assert float((got[0] - ref[0]).abs().max()) < 1e-5  # the same logits: same loss in fp32
    for g, r in zip(got[1:], ref[1:]):  # bf16 grad_weight: a chunked fp32 sum vs one bf16 GEMM (~3e-3)
        assert g.dtype == r.dtype and rel_error(g, r) < (1e-5 if dtype is torch.float32 else 1e-2)


def test_saves_less_than_megatron(megatron_one_rank):
    from megatron.core import tensor_parallel

    hidden, weight, labels, _ = _inputs(torch.bfloat16)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tensor_parallel.vocab_parallel_cross_entropy((hidden @ weight.t()).float(), labels.t().contiguous())
    own = {(t.data_ptr(), t.nbytes) for t in saved if t.data_ptr() != weight.data_ptr()}
    assert sum(n for _, n in own) == S * B * H * 2 + stock_logits_bytes(S * B, V)


# ---- vocab-parallel TP=2 over gloo ----


def _tp_worker(rank, world_size, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    shard = slice(rank * V // world_size, (rank + 1) * V // world_size)
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, labels, grad = _inputs(dtype)
        ref = _run(_reference, hidden.float(), weight.float(), labels, grad)
        got = _run(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=7, tp_group=group),
                   hidden, weight[shard], labels, grad)
        loss_tol, grad_tol = TOL[dtype]
        assert float((got[0] - ref[0]).abs().max()) < loss_tol, rank
        assert rel_error(got[1], ref[1]) < grad_tol, rank
        assert rel_error(got[2], ref[2][shard]) < grad_tol, rank
        # sequence parallel: this rank holds its shard of the sequence, the loss covers all of it
        rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
        got = _run(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=7, tp_group=group,
                                                                sequence_parallel=True),
                   hidden[rows], weight[shard], labels, grad)
        assert got[0].shape == (B, S) and float((got[0] - ref[0]).abs().max()) < loss_tol, rank
        assert got[1].shape == hidden[rows].shape and rel_error(got[1], ref[1][rows]) < grad_tol, rank
        assert rel_error(got[2], ref[2][shard]) < grad_tol, rank
    hidden, weight, labels, grad = _inputs(torch.float32)
    hidden[3, 1, 0] = float("nan")
    loss = chunked_linear_cross_entropy(hidden, weight[shard], labels, chunk_tokens=7, tp_group=group)
    assert torch.isnan(loss[1, 3]) and torch.isfinite(loss).sum() == B * S - 1, rank
    labels[0, :3] = torch.tensor([-1, V, V + 5])  # outside the vocab: megatron's lse - max
    loss = chunked_linear_cross_entropy(hidden, weight[shard], labels, chunk_tokens=7, tp_group=group)
    logits = (hidden[:3, 0] @ weight.t()).float()
    want = logits.logsumexp(dim=1) - logits.amax(dim=1)
    assert float((loss[0, :3] - want).abs().max()) < 1e-5, rank


@pytest.mark.dist
def test_tp2_matches_tp1():
    """Vocab-parallel, and vocab- plus sequence-parallel, on two gloo ranks."""
    from tests import testing as T

    T.spawn(_tp_worker, 2, timeout=60)
