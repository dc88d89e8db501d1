"""The non-finite side list, pure torch: the specification `nonfinite_triton` follows.

Lossy codecs decode a non-finite input to NaN by themselves (a reserved or flagged code),
and keep the exact values (NaN payloads, the sign of an Inf) of the first `capacity`
non-finite elements in a side list that decode writes back:

- `index` int32 [capacity] (int64 beyond 2**31 elements): flat positions, row-major;
- `value` [capacity] in x's dtype: the exact values;
- `count` int32 [1]: how many non-finite elements x held (it may exceed the capacity).

Slots at or past `count` hold nothing (the kernels leave them unwritten), so restoring
reads `count` on the device and never needs the host. Capacity is fixed by the size alone
(4 slots plus one per 8192 elements): no host sync, and every record of a shape has one
layout. Past the capacity, values stay the codec's NaN and the codec's state counts them.

The codec's per-device state (`new_state`, int64 [4]) is what lets a Triton encode be a
single launch: the kernels take slots from its running `COUNT` with atomics, the program
that finishes last moves it into the record's `count` and resets it, adds the call to
`EPOCH` (the stochastic-rounding stream of the next call) and leaves `OVERFLOW` (values
past the capacity, over all calls) for the codec to read when asked.
"""
from __future__ import annotations

import torch

#: the side list has MIN_SLOTS slots plus one per STRIDE elements (at most one per element):
#: 12 slots (76 bytes) for 65536 bf16 elements, 0.14% of an int4 record at any larger size
MIN_SLOTS = 4
STRIDE = 8192

#: slots of the codec state tensor (int64): calls so far (the random stream), programs of
#: the running launch that finished, slots taken by the running launch, values ever past
#: the capacity
EPOCH, DONE, COUNT, OVERFLOW = 0, 1, 2, 3
STATE_SLOTS = 4


def nonfinite_capacity(numel: int) -> int:
    """Slots of the side list of a tensor of `numel` elements: fixed by the size alone."""
    return min(numel, MIN_SLOTS + numel // STRIDE)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def side_list_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of the side list of a tensor of `numel` elements of `dtype`."""
    if numel == 0:
        return 0
    slot = index_dtype(numel).itemsize + dtype.itemsize
    return nonfinite_capacity(numel) * slot + 4


def new_state(device) -> torch.Tensor:
    """A codec's zeroed state on `device` (see the module doc)."""
    return torch.zeros(STATE_SLOTS, dtype=torch.int64, device=device)


def empty_side_list(numel: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """Unwritten (index, value, count) buffers for a tensor of `numel` elements."""
    cap = nonfinite_capacity(numel)
    return (torch.empty(cap, dtype=index_dtype(numel), device=device),
            torch.empty(cap, dtype=dtype, device=device),
            torch.empty(1 if numel else 0, dtype=torch.int32, device=device))


def side_list_ref(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(index, value, count) of x's non-finite elements, in ascending position (the order
    the kernels fill slots in under the interpreter; on a GPU programs race for slots, and
    only the set of used slots is defined). Adds the values past the capacity to
    `state[OVERFLOW]` in place. No host sync."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return empty_side_list(0, x.dtype, x.device)
    bad = (flat - flat).ne_(0)  # NaN exactly where x is not finite
    index = torch.nonzero_static(bad, size=nonfinite_capacity(n), fill_value=0).reshape(-1)
    count = bad.sum(dtype=torch.int32).reshape(1)
    state[OVERFLOW:].add_((count - index.numel()).clamp_min_(0))
    return index.to(index_dtype(n)), flat[index], count


def nonfinite_args(x: torch.Tensor, state, nf_index, nf_value, nf_count) -> tuple:
    """A launcher's kernel arguments for the side list: (SIDE, state, index, value, count,
    capacity); without a state (a caller that keeps no side list) SIDE is False and the
    pointers are placeholders the kernel never touches."""
    if state is None:
        return False, x, x, x, x, 0
    return True, state, nf_index, nf_value, nf_count, nf_index.numel()


def unmove_index(index: torch.Tensor, shape, src: int, dst: int) -> torch.Tensor:
    """Flat positions in `x.movedim(src, dst).contiguous()` -> flat positions in x (of
    `shape`): codecs that encode a moved copy (a per-axis codec along another axis) keep
    the side list in x's own order. A few ops on the slots only; no host sync."""
    nd = len(shape)
    order = list(range(nd))
    order.insert(dst % nd, order.pop(src % nd))  # moved dim i is x's dim order[i]
    rem = index.to(torch.int64)
    coords = [None] * nd
    for i in reversed(range(nd)):
        size = int(shape[order[i]])
        coords[order[i]], rem = rem % size, rem // size
    flat, stride = torch.zeros_like(rem), 1
    for d in reversed(range(nd)):
        flat, stride = flat + coords[d] * stride, stride * int(shape[d])
    return flat.to(index.dtype)


def record_side_list(x: torch.Tensor, state, nf_index, nf_value, nf_count) -> None:
    """A reference encode's side list: fill the caller's buffers (`nf_*`, from
    `empty_side_list`) when it passed a state; the kernels do this in their one pass."""
    if state is None:
        return
    index, value, count = side_list_ref(x, state)
    nf_index.copy_(index)
    nf_value.copy_(value)
    nf_count.copy_(count)


def restore_nonfinite_ref(out: torch.Tensor, index: torch.Tensor, value: torch.Tensor,
                          count: torch.Tensor) -> None:
    """Write the used slots' exact values into `out` (flat positions), in place; no host
    sync. Unused slots write slot 0's value again (or element 0's own value when nothing
    was used), so their contents never matter."""
    flat = out.view(-1)
    if index.numel() == 0:
        return
    used = torch.arange(index.numel(), device=index.device) < count
    first = count > 0
    index0 = torch.where(first, index[:1], 0)
    value0 = torch.where(first, value[:1].to(out.dtype), flat[:1])
    safe_index = torch.where(used, index, index0).to(torch.int64)
    safe_value = torch.where(used, value.to(out.dtype), value0)
    flat.index_put_((safe_index,), safe_value)
