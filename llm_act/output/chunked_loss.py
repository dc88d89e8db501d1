"""The output layer and megatron's per-token cross-entropy in one op that never holds the logits.

At a large vocabulary the logits are the biggest activation of the model: megatron's
`vocab_parallel_cross_entropy` keeps the fp32 softmax of the whole [tokens, vocab_local]
logits for its backward (4 bytes per token per vocab entry, plus a bool mask and an int64
target per token: 4.2 GB per 8k-token sequence at vocab 128k). This op runs the tokens in
chunks of `chunk_tokens`: per chunk it computes the logits exactly as stock does (the GEMM in
the input dtype, then fp32), their log-sum-exp and the target logit, and drops them. It saves
for backward only the output layer's input (which stock's linear saves too), the weight (a
parameter), the labels (the batch's own tensor) and one fp32 log-sum-exp per token.

Backward re-runs one logits GEMM per chunk to rebuild the softmax: one GEMM more than stock's
two (about a third more output-layer time; forward costs the same). Its transients are one
chunk's logits (fp32 and input dtype) and, for bf16/fp16 weights, an fp32 accumulator of the
weight gradient (each chunk's bf16 partial sum is added in fp32: no bf16 rounding of a running
sum across chunks).

Under vocab-parallel TP (`tp_group`, `weight` this rank's vocab shard) each rank's per-token
log-sum-exp and target logit (0 where the label lies outside its vocab range, as in megatron)
are combined by two all-reduces of a few floats per token after the chunk loop, and
backward all-reduces the input gradient, as megatron's ColumnParallelLinear output layer
does.

Under sequence parallelism (`sequence_parallel=True`, megatron's `--sequence-parallel`) `hidden`
is this rank's shard of the sequence [s/tp, b, h], as stock's output layer receives it. The op
all-gathers the sequence in forward and again in backward, and saves only the shard, as stock's
linear does; the input gradient is reduce-scattered back to the shards (the sum over the vocab
shards and the split over the sequence in one collective).

Labels outside [0, vocab) are not checked (a check would sync the device): as in
megatron (which zeroes their target logit after subtracting the max logit) their loss is
the log-sum-exp minus the max logit, and their gradient the softmax.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_TOKENS = 1024
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["ChunkedLinearCrossEntropy", "DEFAULT_CHUNK_TOKENS", "chunked_linear_cross_entropy",
           "stock_logits_bytes", "stored_bytes"]


def stored_bytes(tokens: int, hidden_size: int, elem_bytes: int, sequence_shards: int = 1) -> int:
    """Bytes this op saves for backward: the hidden states (`elem_bytes` each; stock's output
    linear saves them too; this rank's 1/`sequence_shards` of the tokens under sequence
    parallelism) and an fp32 log-sum-exp per token of the whole sequence. The weight and the
    labels are saved by reference (a parameter and the batch's tensor): no bytes of their own."""
    return tokens // sequence_shards * hidden_size * elem_bytes + 4 * tokens


def stock_logits_bytes(tokens: int, vocab_local: int) -> int:
    """Bytes megatron-core 0.16.1's `vocab_parallel_cross_entropy` saves on top of the output
    linear's input: the fp32 softmax [tokens, vocab_local] (the float logits, turned into the
    softmax in place), the bool target mask and the int64 masked target, per token."""
    return tokens * (4 * vocab_local + 1 + 8)


def _check(hidden, weight, labels, chunk_tokens, shards: int = 1) -> None:
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) \
            or not isinstance(labels, torch.Tensor):
        raise TypeError("hidden, weight, labels: expected tensors")
    if hidden.dim() != 3:
        raise ValueError(f"hidden: expected [s, b, h], got shape {tuple(hidden.shape)}")
    s, b, h = hidden.shape
    s *= shards  # the whole sequence (a shard of it under sequence parallelism)
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight: expected [vocab_local, {h}], got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError("weight: expected at least one vocab row, got 0")
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels: expected [b, s] = {(b, s)}, got shape {tuple(labels.shape)}")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"hidden: expected float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels: expected int64, got {labels.dtype}")
    if weight.device != hidden.device or labels.device != hidden.device:
        raise ValueError(f"hidden, weight, labels: expected one device, got "
                         f"{hidden.device}, {weight.device}, {labels.device}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected an int >= 1, got {chunk_tokens!r}")


def _vocab_start(weight: torch.Tensor, tp_group) -> int:
    """First vocab id of this rank's shard (megatron's equal split)."""
    return 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]


def _chunk_logits(h_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of one chunk, as stock computes them: the GEMM in the input dtype, then fp32
    (a fresh tensor either way: callers change it in place)."""
    return (h_chunk @ weight.t()).float()


def _local_target(labels: torch.Tensor, start: int, vocab_local: int):
    """(index into the local shard, whether the label is in it) per token."""
    local = labels - start
    inside = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), inside


def _gather_sequence(shard: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence [s, b, h] from every rank's shard [s/tp, b, h] (rank order)."""
    full = torch.empty((shard.shape[0] * dist.get_world_size(group), *shard.shape[1:]),
                       dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(full, shard.contiguous(), group=group)
    return full


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss[b, s] = logsumexp(hidden @ weight.T) - logit[label], chunk by chunk over tokens."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, tp_group, sequence_parallel):
        shard = hidden
        if sequence_parallel:
            hidden = _gather_sequence(shard, tp_group)
        s, b, h = hidden.shape
        v = weight.shape[0]
        x = hidden.reshape(s * b, h)
        target = labels.t().reshape(s * b)  # token order of hidden: (s, b)
        start = _vocab_start(weight, tp_group)
        lse = torch.empty(s * b, dtype=torch.float32, device=hidden.device)
        top = torch.empty_like(lse)  # the max logit
        tgt = torch.empty_like(lse)  # the target logit, 0 where the label is not in the shard
        found = torch.empty_like(lse)  # 1 where it is
        for a in range(0, s * b, chunk_tokens):
            e = min(a + chunk_tokens, s * b)
            logits = _chunk_logits(x[a:e], weight)
            idx, inside = _local_target(target[a:e], start, v)
            tgt[a:e] = logits.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill_(~inside, 0.0)
            found[a:e] = inside
            m = logits.amax(dim=1)
            top[a:e] = m
            lse[a:e] = logits.sub_(m.unsqueeze(1)).exp_().sum(dim=1).log_().add_(m)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            tops = torch.stack([lse, top])
            dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=tp_group)
            # a NaN on one rank may be lost by MAX; it still reaches every rank through SUM
            sums = torch.stack([lse.sub_(tops[0]).exp_(), tgt, found])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
            lse = sums[0].log().add_(tops[0])
            top, tgt, found = tops[1], sums[1], sums[2]
        # megatron zeroes the target logit minus the max: a label outside the vocab scores the max
        tgt = torch.where(found > 0, tgt, top)
        ctx.save_for_backward(shard, weight, labels, lse)
        ctx.chunk_tokens, ctx.tp_group, ctx.sequence_parallel = chunk_tokens, tp_group, sequence_parallel
        return (lse - tgt).view(s, b).t().contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_h or want_w):
            return None, None, None, None, None, None
        if ctx.sequence_parallel:
            hidden = _gather_sequence(hidden, ctx.tp_group)
        s, b, h = hidden.shape
        v = weight.shape[0]
        x = hidden.reshape(s * b, h)
        target = labels.t().reshape(s * b)
        g = grad_loss.t().reshape(s * b).float()
        start = _vocab_start(weight, ctx.tp_group)
        grad_x = torch.empty_like(x) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for a in range(0, s * b, ctx.chunk_tokens):
            e = min(a + ctx.chunk_tokens, s * b)
            p = _chunk_logits(x[a:e], weight).sub_(lse[a:e].unsqueeze(1)).exp_()  # softmax
            idx, inside = _local_target(target[a:e], start, v)
            p.scatter_add_(1, idx.unsqueeze(1), -inside.to(p.dtype).unsqueeze(1))
            d = p.mul_(g[a:e].unsqueeze(1)).to(weight.dtype)  # dloss/dlogits, as stock casts it
            if want_h:
                torch.mm(d, weight, out=grad_x[a:e])
            if want_w:
                if d.dtype == grad_w.dtype:
                    grad_w.addmm_(d.t(), x[a:e])
                else:  # the chunk's partial sum in the input dtype, accumulated in fp32
                    grad_w.add_(d.t() @ x[a:e])
        if want_h and ctx.sequence_parallel:  # summed over the vocab shards, split over the sequence
            shard = torch.empty((s // dist.get_world_size(ctx.tp_group), b, h), dtype=grad_x.dtype,
                                device=grad_x.device)
            dist.reduce_scatter_tensor(shard, grad_x.view(s, b, h), group=ctx.tp_group)
            grad_x = shard
        elif want_h and ctx.tp_group is not None and dist.get_world_size(ctx.tp_group) > 1:
            dist.all_reduce(grad_x, group=ctx.tp_group)  # a sum over the vocab shards
        return (grad_x.view(-1, b, h) if want_h else None,
                grad_w.to(weight.dtype) if want_w else None, None, None, None, None)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Per-token loss [b, s] (fp32, no reduction) of megatron's
    `vocab_parallel_cross_entropy((hidden @ weight.T).float(), labels.T).T`, without the logits.

    `hidden` [s, b, h] ([s/tp, b, h], this rank's shard of the sequence, with
    `sequence_parallel`); `weight` [vocab_local, h], this rank's vocab shard under `tp_group`
    (None: the whole vocab); `labels` [b, s] int64, global vocab ids. Gradients flow to
    `hidden` and `weight`, in their dtypes.
    """
    sequence_parallel = bool(sequence_parallel) and tp_group is not None and dist.get_world_size(tp_group) > 1
    _check(hidden, weight, labels, chunk_tokens, dist.get_world_size(tp_group) if sequence_parallel else 1)
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, tp_group, sequence_parallel)
