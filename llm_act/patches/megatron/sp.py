"""Sequence parallelism with compressed activations: encode the local shard, gather encoded.

Under sequence parallelism a column-parallel linear takes the local token shard
[s/tp, b, h], all-gathers it to [s, b, h] for the matmul and, in stock megatron-core, saves
the *shard* and all-gathers it again in backward for the weight gradient. `EncodedSPLinear`
saves `codec.encode(shard)` instead and in backward all-gathers the *encoded* shard
(`all_gather_encoded`) and decodes it: the backward all-gather moves the encoded bytes.

Layout rule (design brief): an encoded shard must never need data of another shard. We
gather per-shard records and decode each shard on its own, then concatenate the decoded
shards along the token dimension (dim 0). That is exact for every codec whatever its
grouping (an IntQuant group never straddles a shard, since each shard was encoded alone).
Record shapes depend on the shard's shape only (OutlierInt4's outlier slots and every
codec's non-finite side list have fixed sizes; each shard picks its own outlier channels),
so each rank sends exactly its record's `nbytes`, in one all-gather, and learns nothing
about the others' sizes first: no host sync.
The collective is megatron's `dist_all_gather_func`, looked up at call time.
"""
from __future__ import annotations

from typing import Any

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.patches.megatron.functions import linear_param_grads, megatron_linear_helpers, save_linear_ctx


def _gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    from megatron.core.tensor_parallel import layers

    layers.dist_all_gather_func(out, inp, group=group)


def all_gather_encoded(enc: Encoded, group) -> list[Encoded]:
    """Every rank's record of its shard, in rank order, in one all-gather. Every record's
    shapes follow from the shard's shape alone (fixed side lists and outlier slots), and the
    shards of one sequence-parallel tensor have one shape, so nothing is exchanged first (no
    host sync): the record's tensors travel packed in one byte buffer, widest items first
    so that every tensor starts aligned to its own item size."""
    world = torch.distributed.get_world_size(group)
    names = sorted(enc.data, key=lambda n: -enc.data[n].element_size())
    parts = [enc.data[n].contiguous().reshape(-1).view(torch.uint8) for n in names]
    used = sum(p.numel() for p in parts)
    width = -(-used // 8) * 8  # every rank's record starts 8-byte aligned too
    if width > used:
        parts.append(torch.zeros(width - used, dtype=torch.uint8, device=enc.device))
    out = torch.empty(world * width, dtype=torch.uint8, device=enc.device)
    if width:
        _gather(out, torch.cat(parts), group)
    records = []
    for r in range(world):
        data, pos = {}, r * width
        for name, part in zip(names, parts):  # zip stops before the padding
            t = enc.data[name]
            data[name] = out[pos:pos + part.numel()].view(t.dtype).reshape(t.shape)
            pos += part.numel()
        records.append(Encoded(enc.codec, enc.shape, enc.dtype, enc.device, data, dict(enc.meta)))
    return records


def gather_decoded(codec: Codec, enc: Encoded, group) -> torch.Tensor:
    """The full-sequence tensor [s, b, ...] from every rank's encoded shard.

    Codecs that hold no bytes of their own (the "recompute" ticket, a visible "keep") are
    decoded locally and the raw shard is gathered, as stock does.
    """
    world = torch.distributed.get_world_size(group)
    if not enc.data or codec.name in ("keep", "recompute"):
        shard = codec.decode(enc).contiguous()
        out = torch.empty((shard.shape[0] * world, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        _gather(out, shard, group)
        return out
    return torch.cat([codec.decode(e) for e in all_gather_encoded(enc, group)], dim=0)


class EncodedSPLinear(torch.autograd.Function):
    """megatron-core's column-parallel linear under sequence parallelism (all-gather of the
    input in forward, reduce-scatter of its gradient in backward) saving the encoded shard."""

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, tp_group,
                codec: Codec, owner: Any, site: str):
        from megatron.core.parallel_state import get_global_memory_buffer
        from megatron.core.tensor_parallel import layers

        save_linear_ctx(ctx, input, weight, bias, gradient_accumulation_fusion, tp_group, codec, owner, site)
        ctx.shape, ctx.dtype = input.shape, input.dtype

        size = list(input.size())
        size[0] *= tp_group.size()
        total_input = get_global_memory_buffer().get_tensor(size, input.dtype, "mpu")
        layers.dist_all_gather_func(total_input, input, group=tp_group)
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel import layers

        L, prepare = megatron_linear_helpers()
        (weight,) = ctx.saved_tensors
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad
        total_input = gather_decoded(ctx.codec, ctx.record.enc, ctx.tp_group)
        ctx.record = None
        grad_input = grad_output.matmul(weight)
        grad_output, total_input = prepare(grad_output, total_input)
        sub_grad_input = torch.empty(ctx.shape, dtype=grad_input.dtype, device=grad_input.device)
        handle = layers.dist_reduce_scatter_func(sub_grad_input, grad_input.contiguous(),
                                                 group=ctx.tp_group, async_op=True)
        grad_weight, grad_bias = linear_param_grads(ctx, L, weight, grad_output, total_input)
        handle.wait()
        return sub_grad_input, grad_weight, grad_bias, None, None, None, None, None
