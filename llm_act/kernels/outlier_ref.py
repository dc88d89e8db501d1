"""Outlier-separated INT4 (Adacc sec. 3.2), pure-torch reference: the spec of the kernels.

A tensor is read as a matrix `x2` of shape [rows, C] (C = last dim = channels). Outlier
channels are kept exactly, everything else is IntQuant's asymmetric INT4 over groups of
`group_size` consecutive channels of a row (no transpose, the paper's point).

One pass (issue 26): Adacc picks outlier channels by the z-score of their absolute column
sums over the whole tensor, which a kernel can only know after reading all of it. Here the
choice is made per tile, inside the program that quantizes it: x2 is cut into tiles of
`rows_per_chunk` rows by `channels_per_tile` channels (`tile_layout`: 512 channels, whole
groups, times as many rows as make about 4096 elements, 8 rows at group_size 128), and
each tile keeps its own `slots` outlier channels (`slots_per_tile`: floor(max_outlier_frac
* 512), 8 at the default 1/64, the same total as 1/64 of the channels): the channels whose
z-score among the tile's channels, z = (S_c - mean S) / std S with S_c = sum over the
tile's rows of finite |x| (float64), exceeds `z_threshold`, the largest z first when more
qualify (equal z: the lower channel; the threshold is compared as a float32 number). A
tile's slots list its channels in ascending order; unused slots hold C. Outlier channels
of LLM activations are the same in every row, so every row chunk finds them again; a tile
holding more of them than it has slots quantizes the rest with its inliers (512-channel
tiles: 8 outlier channels placed at random in 1024 never overflowed one in 30 draws, where
256-channel tiles with 4 slots did 3 times).

Stored (`outlier_encode_ref`):
- `packed` uint8 [rows, ceil(C / 2)]: INT4 codes, two per byte (element 2k in the low
  nibble), rows padded to whole bytes; outlier positions hold code 0;
- `scale`, `zero` float32 [rows, ceil(C / group_size)]: IntQuant's asymmetric parameters
  of each group's finite inliers (zero = min, scale = (max/2 - min/2) / 15, the step of
  x / 2, so no range overflows); a group holding a non-finite inlier is flagged by the
  sign bit of its scale, its finite values use codes 0..14 and code 15 decodes to NaN;
- `values` x.dtype [rows, tiles * slots]: row r's value of its chunk's slot j (0 for an
  unused slot, NaN for a non-finite value);
- `index` int16 (int32 when C > 32767) [row chunks, tiles * slots]: the slots' channels.

Codes: clamp(floor((x/2 - zero/2) / scale + u), 0, 15) with u ~ U[0, 1) (stochastic) or
u = 0.5 (nearest). Outliers are left out of their group's range, so they do not stretch
it (Adacc sets them to 0, which would stretch the range of a group lying away from 0).
All quantization arithmetic is float32 (`int_quant_ref.quant_params` / `quantize`).
"""
from __future__ import annotations

import math

import torch

from llm_act.kernels.int_quant_ref import dequantize, quant_params, quantize, seeded_noise
from llm_act.kernels.nonfinite_ref import record_side_list
from llm_act.kernels.packing_ref import pack_bits, unpack_bits

BITS = 4
LEVELS = (1 << BITS) - 1  # 15 steps in an unflagged group, 14 in a flagged one
TILE = 4096  # elements per tile (per program)
TILE_C = 512  # channels per tile, rounded down to whole groups (at least one)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_layout(C: int, group_size: int) -> tuple[int, int]:
    """(channels_per_tile, rows_per_chunk) for C channels: tiles are TILE_C channels rounded
    down to whole groups (all of C when C is smaller), chunks as many rows as make TILE
    elements with the kernel's padding (groups to powers of two), a power of two."""
    tc = min(C, group_size * max(1, TILE_C // group_size))
    groups = _pow2(-(-tc // group_size)) * _pow2(group_size)
    return tc, max(1, TILE // groups)


def slots_per_tile(C: int, group_size: int, max_outlier_frac: float) -> int:
    """Outlier slots of each tile: floor(max_outlier_frac * channels_per_tile), 0 when C < 2."""
    if C < 2:
        return 0
    tc, _ = tile_layout(C, group_size)
    return int(math.floor(max_outlier_frac * tc + 1e-9))


def record_layout(rows: int, C: int, group_size: int, slots: int) -> dict:
    """Shapes of the record: {'tiles', 'chunks', 'row_bytes', 'groups' (per row),
    'slots_per_row', 'channels_per_tile', 'rows_per_chunk'}."""
    tc, cr = tile_layout(C, group_size)
    tiles = -(-C // tc) if C else 0
    return {"tiles": tiles, "chunks": -(-rows // cr), "row_bytes": -(-C // 2),
            "groups": -(-C // group_size), "slots_per_row": tiles * slots,
            "channels_per_tile": tc, "rows_per_chunk": cr}


def index_dtype(C: int) -> torch.dtype:
    """The slots' channel indices (C, for an unused slot, must fit)."""
    return torch.int16 if C <= torch.iinfo(torch.int16).max else torch.int32


def column_abs_sums(x2: torch.Tensor) -> torch.Tensor:
    """Per-channel sum of |x| over all rows, float32 [C]; non-finite entries count as 0:
    the whole-tensor statistic behind `outlier_z`, for the data's outlier rate
    (`OutlierInt4.count_outliers`, at the planner's tracking points; encode does not use
    it)."""
    a = x2.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).sum(dim=0)


def outlier_z(colsum: torch.Tensor) -> torch.Tensor:
    """Per-channel z-score of the column sums, float32 [C] (0 where undefined)."""
    s = colsum.float()
    z = (s - s.mean()) / s.std(correction=0)
    return torch.where(torch.isfinite(z), z, torch.zeros_like(z))  # sd == 0 or inf sums


def _tiled(t: torch.Tensor, rows: int, C: int, lay: dict, fill=0) -> torch.Tensor:
    """[rows, C] -> [chunks, rows_per_chunk, tiles, channels_per_tile], padded with `fill`."""
    cr, tc = lay["rows_per_chunk"], lay["channels_per_tile"]
    K, T = lay["chunks"], lay["tiles"]
    out = t.new_full((K * cr, T * tc), fill)
    out[:rows, :C] = t
    return out.view(K, cr, T, tc)


def select_tiles_ref(x2: torch.Tensor, group_size: int, z_threshold: float,
                     slots: int) -> torch.Tensor:
    """The outlier slots of every tile (see the module doc): int64 [chunks, tiles * slots],
    ascending channels per tile, C for an unused slot."""
    rows, C = x2.shape
    lay = record_layout(rows, C, group_size, slots)
    K, T, tc = lay["chunks"], lay["tiles"], lay["channels_per_tile"]
    if slots == 0 or rows * C == 0:
        return torch.empty(K, 0, dtype=torch.int64, device=x2.device)
    a = x2.double().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    S = _tiled(a, rows, C, lay).sum(dim=1)  # [chunks, tiles, tc]
    ch = torch.arange(T * tc, device=x2.device).view(T, tc)
    cvalid = ch < C
    n_c = cvalid.sum(dim=-1, keepdim=True).double()
    # z = (S - mean) / std = d / sqrt(q / n) with d = n S - sum(S), q = sum(d^2): no
    # division (the kernel's rule), z > thr is d sqrt(n) > thr sqrt(q), and z orders as d
    d = n_c * S - torch.where(cvalid, S, 0.0).sum(dim=-1, keepdim=True)
    q = torch.where(cvalid, d * d, 0.0).sum(dim=-1, keepdim=True)
    thr = float(torch.tensor(z_threshold, dtype=torch.float32))  # the kernel's float32 scalar
    above = torch.where(q > 0, d * torch.sqrt(n_c) > thr * torch.sqrt(q), d * 0.0 > thr)
    key = torch.where(cvalid, d, float("-inf"))
    chosen = torch.zeros(key.shape, dtype=torch.bool, device=x2.device)
    for _ in range(slots):  # the largest z first; torch.argmax takes the first maximum
        j = key.argmax(dim=-1, keepdim=True)
        chosen = chosen | ((torch.arange(tc, device=x2.device) == j) & above)
        key = key.scatter(-1, j, float("-inf"))
    slot = torch.where(chosen, ch.expand_as(key), C)
    return slot.sort(dim=-1).values[..., :slots].reshape(K, T * slots)


def outlier_mask(index: torch.Tensor, rows: int, C: int, rows_per_chunk: int) -> torch.Tensor:
    """bool [rows, C]: the positions the slots `index` [chunks, n] keep exactly."""
    K = index.shape[0]
    m = torch.zeros(K, C + 1, dtype=torch.bool, device=index.device)
    m.scatter_(1, index.long(), True)
    chunk = torch.arange(rows, device=index.device) // rows_per_chunk
    return m[:, :C][chunk]


def group_stats(x2: torch.Tensor, index: torch.Tensor, group_size: int):
    """Per-group statistics of the inliers of `x2` (the slots `index` left out).

    Returns float32 groups [rows, G, group_size] (G = ceil(C / group_size), padded with 0),
    the masks `use` (finite inlier) and `bad` (non-finite inlier) of that shape, the
    finite-inlier min and max [rows, G] (0 for a group without any) and the flag [rows, G].
    """
    rows, C = x2.shape
    _, cr = tile_layout(C, group_size)
    G = -(-C // group_size)
    xf = x2.float()
    inlier = ~outlier_mask(index, rows, C, cr)
    finite = torch.isfinite(xf)

    def grouped(t, fill):
        out = t.new_full((rows, G * group_size), fill)
        out[:, :C] = t
        return out.view(rows, G, group_size)

    xg = grouped(xf, 0.0)
    use = grouped(finite & inlier, False)
    bad = grouped(~finite & inlier, False)
    has = use.any(dim=2)
    mn = torch.where(use, xg, float("inf")).amin(dim=2)
    mx = torch.where(use, xg, float("-inf")).amax(dim=2)
    mn = torch.where(has, mn, torch.zeros_like(mn))
    mx = torch.where(has, mx, torch.zeros_like(mx))
    return xg, use, bad, mn, mx, bad.any(dim=2)


def outlier_encode_ref(
    x2: torch.Tensor,
    group_size: int,
    z_threshold: float,
    slots: int,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    state: torch.Tensor | None = None,
    nf_index: torch.Tensor | None = None,
    nf_value: torch.Tensor | None = None,
    nf_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode contiguous `x2` [rows, C] with `slots` outlier slots per tile.

    `noise`: float [rows * C] in [0, 1) for stochastic rounding; `seed` (an int) draws it
    here (`int_quant_ref.seeded_noise`; the kernel uses Philox: same distribution, other
    stream); neither: nearest rounding. With `state`, x2's non-finite values go to the
    side-list buffers `nf_*` (`nonfinite_ref`). Returns (packed, scale, zero, values,
    index) as in the module doc.
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even integer >= 2, got {group_size!r}")
    record_side_list(x2, state, nf_index, nf_value, nf_count)
    rows, C = x2.shape
    lay = record_layout(rows, C, group_size, slots)
    dev = x2.device
    if rows * C == 0:
        return (torch.empty(rows, lay["row_bytes"], dtype=torch.uint8, device=dev),
                torch.empty(rows, lay["groups"], device=dev),
                torch.empty(rows, lay["groups"], device=dev),
                torch.empty(rows, lay["slots_per_row"], dtype=x2.dtype, device=dev),
                torch.empty(lay["chunks"], lay["slots_per_row"], dtype=index_dtype(C),
                            device=dev))
    if noise is None:
        noise = seeded_noise(seed, rows * C, dev)
    index = select_tiles_ref(x2, group_size, z_threshold, slots)
    # exact values of the slots, row by row (unused slots: 0; non-finite: NaN)
    chunk = torch.arange(rows, device=dev) // lay["rows_per_chunk"]
    idx_rows = index[chunk]  # [rows, slots_per_row]
    used = idx_rows < C
    values = x2.gather(1, torch.where(used, idx_rows, 0))
    values = torch.where(used, values, torch.zeros_like(values))
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, float("nan")))
    xg, use, bad, mn, mx, flag = group_stats(x2, index, group_size)
    scale, zero = quant_params(mn, mx, None, flag, BITS, False)
    u = None
    if noise is not None:
        u = noise.reshape(rows, C).float()
        u = torch.cat([u, u.new_zeros(rows, xg.shape[1] * group_size - C)], 1).view_as(xg)
    codes = quantize(xg, scale[..., None], zero[..., None], BITS, False, u)
    codes = torch.where(use | bad, codes, torch.zeros_like(codes)).view(rows, -1)
    codes = codes[:, :2 * lay["row_bytes"]]  # G * group_size >= C, and even
    packed = pack_bits(codes, BITS).view(rows, lay["row_bytes"])
    return packed, scale, zero, values, index.to(index_dtype(C))


def outlier_decode_ref(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    group_size: int,
    rows: int,
    C: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of `outlier_encode_ref`: a [rows, C] tensor of `dtype`."""
    out = torch.empty(rows, C, dtype=dtype, device=packed.device)
    if rows * C == 0:
        return out
    G = scale.shape[1]
    codes = unpack_bits(packed.reshape(-1), BITS, packed.numel() * 2).view(rows, -1)
    width = G * group_size
    codes = codes[:, :width] if codes.shape[1] >= width else torch.cat(
        [codes, codes.new_zeros(rows, width - codes.shape[1])], 1)
    val = dequantize(codes.view(rows, G, group_size).to(torch.int64), scale[..., None],
                     zero[..., None], BITS, False)
    out = torch.cat([val.view(rows, width)[:, :C].to(dtype),
                     out.new_zeros(rows, 1)], dim=1)  # column C: the unused slots' target
    if index.numel():
        _, cr = tile_layout(C, group_size)
        chunk = torch.arange(rows, device=packed.device) // cr
        out.scatter_(1, index.long()[chunk], values.to(dtype))
    return out[:, :C].contiguous()
