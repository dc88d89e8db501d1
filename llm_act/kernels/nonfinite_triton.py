"""The non-finite side list inside the encode kernels; `nonfinite_ref` is the specification.

An encode kernel calls `keep_nonfinite` on the raw tile it loaded (its own dtype, so NaN
payloads and Inf signs are stored exactly) as its last statement, which runs
`note_nonfinite` and `finish_program`:
finding non-finite values costs no extra pass, no torch op and no host sync. A program
with none skips the atomics. Decode writes the used slots back with `restore_nonfinite`
(one small launch after the codec's decode; it reads `count` on the device).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels.nonfinite_ref import COUNT, DONE, EPOCH, OVERFLOW

_COUNT: tl.constexpr = tl.constexpr(COUNT)
_DONE: tl.constexpr = tl.constexpr(DONE)
_EPOCH: tl.constexpr = tl.constexpr(EPOCH)
_OVERFLOW: tl.constexpr = tl.constexpr(OVERFLOW)


@triton.jit
def note_nonfinite(raw, offs, valid, state_ptr, index_ptr, value_ptr, cap):
    """Put this tile's non-finite elements (`raw` at flat positions `offs`, where `valid`)
    into free slots of the side list; those past `cap` are counted in the state."""
    N: tl.constexpr = raw.numel
    bad = tl.reshape(valid & ~(tl.abs(raw.to(tl.float32)) < float("inf")), (N,)).to(tl.int32)
    nb = tl.sum(bad, axis=0)
    if nb > 0:
        base = tl.atomic_add(state_ptr + _COUNT, nb.to(tl.int64))
        slot = base + tl.cumsum(bad, axis=0) - 1
        keep = (bad > 0) & (slot < cap)
        tl.store(index_ptr + slot, tl.reshape(offs, (N,)).to(index_ptr.dtype.element_ty),
                 mask=keep)
        tl.store(value_ptr + slot, tl.reshape(raw, (N,)), mask=keep)
        over = tl.sum(((bad > 0) & (slot >= cap)).to(tl.int64), axis=0)
        if over > 0:
            tl.atomic_add(state_ptr + _OVERFLOW, over)


@triton.jit
def stream_seed(state_ptr, seed):
    """The Philox key of this call: the codec's seed and its call count (`EPOCH`), which
    only the last program of the previous call advanced."""
    return seed + tl.load(state_ptr + _EPOCH) * 1000003


@triton.jit
def finish_program(state_ptr, count_ptr):
    """The last program of the launch to get here moves the running count into the
    record, resets it and advances the call count (all others have taken their slots and
    read the seed before their `DONE` increment, which orders before this one)."""
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    done = tl.atomic_add(state_ptr + _DONE, 1)
    if done == nprog - 1:
        count = tl.atomic_xchg(state_ptr + _COUNT, 0)
        tl.store(count_ptr, count.to(tl.int32))
        tl.atomic_xchg(state_ptr + _DONE, 0)
        tl.atomic_add(state_ptr + _EPOCH, 1)


@triton.jit
def keep_nonfinite(raw, offs, valid, state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, cap,
                   SIDE: tl.constexpr):
    """An encode kernel's one call, after its stores: record the tile's non-finite values
    and finish the program (`note_nonfinite`, `finish_program`), when a state was passed
    (SIDE); without one the kernel keeps no side list."""
    if SIDE:
        note_nonfinite(raw, offs, valid, state_ptr, nf_index_ptr, nf_value_ptr, cap)
        finish_program(state_ptr, nf_count_ptr)


@triton.jit
def _restore_kernel(out_ptr, index_ptr, value_ptr, count_ptr, cap, BLOCK: tl.constexpr):
    count = tl.minimum(tl.load(count_ptr), cap)
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    used = s < count
    index = tl.load(index_ptr + s, mask=used, other=0)
    value = tl.load(value_ptr + s, mask=used)
    tl.store(out_ptr + index, value, mask=used)


def restore_nonfinite(out: torch.Tensor, index: torch.Tensor, value: torch.Tensor,
                      count: torch.Tensor) -> None:
    """`nonfinite_ref.restore_nonfinite_ref` in one launch (in place)."""
    cap = index.numel()
    if cap == 0:
        return
    flat = out.view(-1)
    if flat.dtype == torch.bfloat16:  # bits, not values: the interpreter's casts round
        flat, value = flat.view(torch.int16), value.view(torch.int16)
    block = min(1024, triton.next_power_of_2(cap))
    _restore_kernel[(triton.cdiv(cap, block),)](flat, index, value, count, cap,
                                                BLOCK=block)
