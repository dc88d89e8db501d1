"""Outlier-separated INT4 (Adacc sec. 3.2), pure-torch reference: the spec of the kernels.

A tensor is read as a matrix `x2` of shape [rows, C] (C = last dim = channels). Channels
whose absolute column sum has a z-score above a threshold are outliers: their values are
kept exactly ([rows, n] in x's dtype, non-finite ones stored as NaN) with their channel
indices. Everything else is IntQuant's asymmetric INT4 (`int_quant_ref`, called here) over groups
of `group_size` consecutive elements of the flattened row-major matrix (no transpose, the
paper's point). Outlier positions are replaced by their group's finite-inlier min before
quantizing, so they do not stretch the group's range and get code 0; decode overwrites
them with the stored values. (Adacc sets them to 0, which would stretch the range of a
group lying away from 0.)

INT4 layout (IntQuant's, `int_quant_ref`): zero = group min, scale = (max/2 - min/2) / 15
(the step of x / 2, so no range overflows), code = clamp(floor((x/2 - zero/2) / scale + u),
0, 15) with u ~ U[0, 1) (stochastic) or u = 0.5 (nearest), two codes per byte, element 2k
in the low nibble. A group holding a
non-finite inlier is flagged by the sign bit of its stored scale; its finite values use
codes 0..14 (scale = range / 28) and code 15 decodes to NaN. All arithmetic is float32.
"""
from __future__ import annotations

import torch

from llm_act.kernels.int_quant_ref import (
    int_quant_decode_ref,
    int_quant_encode_ref,
    seeded_noise,
)

BITS = 4
LEVELS = (1 << BITS) - 1  # 15 steps in an unflagged group, 14 in a flagged one


def outlier_colsum_ref(x2: torch.Tensor) -> torch.Tensor:
    """Per-channel sum of |x| over rows, float32 [C]; non-finite entries count as 0."""
    a = x2.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).sum(dim=0)


def select_outliers(colsum: torch.Tensor, z_threshold: float, max_outliers: int) -> torch.Tensor:
    """The outlier slots: int64 [max_outliers] (0 when C < 2), ascending: the channels with
    z-score > `z_threshold`, those with the largest z first when more qualify than there are
    slots, then the unused slots, which hold C. Shared by both paths.

    z = (S_c - mean(S)) / std(S) with the population std (Adacc eq. 1). A fixed number of
    slots keeps every shape fixed: no host sync, on the GPU too.
    """
    C = colsum.numel()
    if max_outliers <= 0 or C < 2:
        return torch.empty(0, dtype=torch.int64, device=colsum.device)
    z = outlier_z(colsum)
    top = torch.topk(z, min(int(max_outliers), C))
    chosen = torch.where(top.values > z_threshold, top.indices, torch.full_like(top.indices, C))
    return chosen.sort().values


def outlier_z(colsum: torch.Tensor) -> torch.Tensor:
    """Per-channel z-score of the column sums, float32 [C] (0 where undefined)."""
    s = colsum.float()
    z = (s - s.mean()) / s.std(correction=0)
    return torch.where(torch.isfinite(z), z, torch.zeros_like(z))  # sd == 0 or inf sums


def outlier_positions(idx: torch.Tensor, C: int) -> torch.Tensor:
    """int32 [C]: the slot of each outlier channel in `idx`, -1 for inlier channels (unused
    slots, index C, name no channel)."""
    pos = torch.full((C + 1,), -1, dtype=torch.int32, device=idx.device)
    pos[idx.long()] = torch.arange(idx.numel(), dtype=torch.int32, device=idx.device)
    return pos[:C]


def as_groups(t: torch.Tensor, group_size: int, fill) -> torch.Tensor:
    """Flattened `t` padded with `fill` to whole groups, viewed as [G, group_size]."""
    flat = t.reshape(-1)
    pad = (-flat.numel()) % group_size
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), fill)])
    return flat.view(-1, group_size)


def group_stats(x2: torch.Tensor, idx: torch.Tensor, group_size: int):
    """Per-group statistics of the inliers of `x2` (outlier channels `idx` excluded).

    Returns float32 groups [G, group_size], the masks `use` (finite inlier) and `bad`
    (non-finite inlier) of the same shape, the finite-inlier min and max [G] (0 for a
    group without any), and the non-finite flag [G].
    """
    rows, C = x2.shape
    xf = x2.float()
    is_out = outlier_positions(idx, C).ge(0).expand(rows, C)
    finite = torch.isfinite(xf)
    use = as_groups(finite & ~is_out, group_size, False)
    bad = as_groups(~finite & ~is_out, group_size, False)
    xg = as_groups(xf, group_size, 0.0)
    inf = torch.tensor(float("inf"), device=x2.device)
    has = use.any(dim=1)
    mn = torch.where(use, xg, inf).amin(dim=1)
    mx = torch.where(use, xg, -inf).amax(dim=1)
    mn = torch.where(has, mn, torch.zeros_like(mn))
    mx = torch.where(has, mx, torch.zeros_like(mx))
    return xg, use, bad, mn, mx, bad.any(dim=1)


def outlier_encode_ref(
    x2: torch.Tensor,
    idx: torch.Tensor,
    group_size: int,
    noise: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode contiguous `x2` [rows, C] given sorted outlier channel indices `idx`.

    `noise`: float [rows*C] in [0, 1) for stochastic rounding; `seed` (1-element int
    tensor) draws it here (`int_quant_ref.seeded_noise`; the kernel uses Philox instead:
    same distribution, other stream); neither: nearest rounding.
    Returns (packed uint8 [ceil(rows*C/2)], scale float32 [G] (sign bit = non-finite
    flag), zero float32 [G], values x2.dtype [rows, n]).
    """
    rows, C = x2.shape
    n = rows * C
    if noise is None:
        noise = seeded_noise(seed, n, x2.device)
    used = idx < C
    values = x2[:, idx.long().clamp_max(C - 1)]  # unused slots: zeros
    values = torch.where(used, values, torch.zeros_like(values))
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, float("nan")))
    # outlier positions take their group's inlier min: code 0, no effect on the range
    xg, use, bad, mn, mx, flag = group_stats(x2, idx, group_size)
    is_out = as_groups(outlier_positions(idx, C).ge(0).expand(rows, C), group_size, False)
    filled = torch.where(is_out, mn[:, None], xg).reshape(-1)[:n]
    packed, scale, zero = int_quant_encode_ref(filled, BITS, group_size, False, noise)
    return packed, scale, zero, values


def outlier_decode_ref(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    idx: torch.Tensor,
    values: torch.Tensor,
    group_size: int,
    rows: int,
    C: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of `outlier_encode_ref`: a [rows, C] tensor of `dtype`."""
    out = int_quant_decode_ref(packed, scale, zero, BITS, group_size, False, rows * C, dtype)
    out = out.view(rows, C)
    if idx.numel():  # unused slots (index C) repeat the first slot's write, or column 0's own
        idx = idx.long()
        used = idx < C
        first = idx[:1]
        target = torch.where(first < C, first, torch.zeros_like(first))
        fallback = torch.where(first < C, values[:, :1].to(dtype), out[:, target])
        out[:, torch.where(used, idx, target)] = torch.where(used, values.to(dtype), fallback)
    return out
