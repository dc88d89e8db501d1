"""Triton integer-quantization kernels against the torch reference (interpreter on CPU)."""
import math

import pytest
import torch

pytest.importorskip("triton")

from llm_act.kernels import int_quant_ref as ref  # noqa: E402
from llm_act.kernels import int_quant_triton as tri  # noqa: E402
from llm_act.kernels.packing_ref import unpack_bits  # noqa: E402
from tests.kernels._values import tiny_values  # noqa: E402

# The kernels do the reference's float32 operations one by one, with correctly rounded
# division and no FMA contraction (`llm_act.kernels`: no GPU-only semantics), so scales and
# decoded values match bit for bit, under the interpreter and on a GPU alike.
ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
RTOL = 0.0
SHAPES = [(1,), (127,), (5000,), (3, 5, 130)]  # 5000 > one 4096-element tile
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = [(1, False), (2, False), (2, True), (4, False), (4, True), (8, False), (8, True)]


def _dev(fn, *args, **kwargs):
    """Run a launcher on DEV (the interpreter on CPU) and bring its results to the CPU."""
    move = lambda a: a.to(DEV) if torch.is_tensor(a) else a  # noqa: E731
    out = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
    return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()


def _input(shape, dtype, nonfinite=True):
    x = torch.randn(shape) * 3 + 0.5
    if nonfinite and x.numel() > 200:
        flat = x.view(-1)
        flat[5], flat[77], flat[150] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


def _scaled(x, scale, zero, bits, symmetric, param_index):
    """v = the value before rounding, per element (as the reference computes it)."""
    xf = x.reshape(-1).float()
    s = scale.abs()[param_index]
    s = torch.where(s > 0, s, torch.ones_like(s))
    if symmetric:
        return xf / s
    return (0.5 * xf - 0.5 * zero[param_index]) / s  # the stored scale is that of x / 2


def _axis_codes(packed, bits, C):
    """Codes of a per-axis record in x's order (rows are padded to whole bytes)."""
    per = 8 // bits
    rb = -(-C * bits // 8)
    rows = packed.numel() // rb
    return unpack_bits(packed, bits, rows * rb * per).view(rows, -1)[:, :C].reshape(-1)


def _axis_param_index(rows, C):
    """Index into the flattened [chunks, C] parameters of each element of [rows, C]."""
    i = torch.arange(rows * C)
    return (i // C // 256) * C + i % C


def _assert_codes_match(x, r, k, bits, symmetric, param_index, noise=None, axis_c=None):
    """Same scales; codes equal except, at most one step apart, at exact rounding ties.
    `axis_c`: a per-axis record of C columns (row-padded codes, [chunks, C] parameters)."""
    torch.testing.assert_close(k[1], r[1], rtol=RTOL, atol=0)
    torch.testing.assert_close(k[2], r[2], rtol=RTOL, atol=0)
    n = x.numel()
    assert k[0].shape == r[0].shape and k[0].dtype == torch.uint8
    if axis_c is None:
        cr = unpack_bits(r[0], bits, n).long()
        ck = unpack_bits(k[0], bits, n).long()
    else:
        cr = _axis_codes(r[0], bits, axis_c).long()
        ck = _axis_codes(k[0], bits, axis_c).long()
    diff = (cr != ck).nonzero().flatten()
    if diff.numel():
        assert (cr[diff] - ck[diff]).abs().max() <= 1
        v = _scaled(x, r[1].reshape(-1), r[2].reshape(-1), bits, symmetric,
                    param_index)[diff]
        v = v + (0.5 if noise is None else noise.reshape(-1)[diff])
        assert torch.allclose(v, v.round(), atol=1e-4), f"non-tie code differences at {diff}"


def _group_index(n, group_size):
    return torch.arange(n) // group_size


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_group_kernels_match_reference(shape, dtype, bits, symmetric):
    x = _input(shape, dtype)
    n = x.numel()
    r = ref.int_quant_encode_ref(x, bits, 128, symmetric)
    k = _dev(tri.int_quant_encode, x, bits, 128, symmetric)
    _assert_codes_match(x, r, k, bits, symmetric, _group_index(n, 128))
    dr = ref.int_quant_decode_ref(*r, bits, 128, symmetric, n, dtype)
    dk = _dev(tri.int_quant_decode, *r, bits, 128, symmetric, n, dtype)
    assert dk.dtype == dtype and dk.shape == (n,)
    torch.testing.assert_close(dk, dr, rtol=RTOL, atol=0, equal_nan=True)
    noise = torch.rand(n)
    r = ref.int_quant_encode_ref(x, bits, 128, symmetric, noise)
    k = _dev(tri.int_quant_encode, x, bits, 128, symmetric, noise)
    _assert_codes_match(x, r, k, bits, symmetric, _group_index(n, 128), noise)


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (127, 1), (40, 125), (15, 130), (300, 21)], ids=str)
def test_axis_kernels_match_reference(shape, dtype, bits, symmetric):
    x = _input(shape, dtype)
    n, C = x.numel(), shape[1]
    pidx = _axis_param_index(*shape)
    r = ref.int_quant_axis_encode_ref(x, bits, symmetric)
    k = _dev(tri.int_quant_axis_encode, x, bits, symmetric)
    _assert_codes_match(x, r, k, bits, symmetric, pidx, axis_c=C)
    dr = ref.int_quant_axis_decode_ref(*r, bits, symmetric, n, dtype)
    dk = _dev(tri.int_quant_axis_decode, *r, bits, symmetric, n, dtype)
    torch.testing.assert_close(dk, dr, rtol=RTOL, atol=0, equal_nan=True)
    noise = torch.rand(n)
    r = ref.int_quant_axis_encode_ref(x, bits, symmetric, noise)
    k = _dev(tri.int_quant_axis_encode, x, bits, symmetric, noise)
    _assert_codes_match(x, r, k, bits, symmetric, pidx, noise, axis_c=C)


def test_many_rows_use_several_chunks():
    """Scales per column and chunk of 256 rows: a large value moves only its own chunk's."""
    x = _input((3000, 3), torch.float32, nonfinite=False)
    x[2999, 1] = 100.0  # the max of column 1 sits in the last chunk
    r = ref.int_quant_axis_encode_ref(x, 4, True)
    k = _dev(tri.int_quant_axis_encode, x, 4, True)
    _assert_codes_match(x, r, k, 4, True, _axis_param_index(3000, 3), axis_c=3)
    scale = k[1]
    assert scale.shape == (12, 3)  # ceil(3000 / 256) chunks
    assert scale[-1, 1] == 100.0 / 7  # the chunk that holds it
    assert (scale[:-1, 1] < 20.0 / 7).all()  # the others keep their own (N(0.5, 3)) range
    amax = torch.stack([x[i:i + 256, 0].abs().max() for i in range(0, 3000, 256)])
    torch.testing.assert_close(scale[:, 0], amax / torch.full_like(amax, 7.0), rtol=0, atol=0)
    d = _dev(tri.int_quant_axis_decode, *k, 4, True, x.numel(), torch.float32).view(3000, 3)
    step = scale.repeat_interleave(256, dim=0)[:3000]
    assert ((d - x).abs() <= step / 2 * (1 + 1e-5)).all()  # nearest: half a chunk step


@pytest.mark.parametrize("group_size", [8, 32, 96, 256])
@pytest.mark.parametrize("bits,symmetric", [(1, False), (4, True), (8, False)])
def test_group_sizes(group_size, bits, symmetric):
    n = 4500  # more than one tile
    x = _input((n,), torch.float32)
    r = ref.int_quant_encode_ref(x, bits, group_size, symmetric)
    k = _dev(tri.int_quant_encode, x, bits, group_size, symmetric)
    assert k[1].numel() == math.ceil(n / group_size)
    _assert_codes_match(x, r, k, bits, symmetric, _group_index(n, group_size))
    dr = ref.int_quant_decode_ref(*r, bits, group_size, symmetric, n, torch.float32)
    dk = _dev(tri.int_quant_decode, *r, bits, group_size, symmetric, n, torch.float32)
    torch.testing.assert_close(dk, dr, rtol=RTOL, atol=0, equal_nan=True)


def test_zero_range_and_all_nonfinite_groups():
    n = 4608  # two programs
    x = torch.randn(n)
    x[:128] = 0.37  # constant group
    x[128:256] = float("nan")  # nothing finite
    x[256:384] = 0.0
    for bits, symmetric in MODES:
        r = ref.int_quant_encode_ref(x, bits, 128, symmetric)
        k = _dev(tri.int_quant_encode, x, bits, 128, symmetric)
        _assert_codes_match(x, r, k, bits, symmetric, _group_index(n, 128))
        d = _dev(tri.int_quant_decode, *k, bits, 128, symmetric, n, torch.float32)
        assert torch.isnan(d[128:256]).all() and torch.isfinite(d[256:]).all()
        assert torch.equal(d[256:384], torch.zeros(128))
        if not symmetric:
            assert torch.equal(d[:128], x[:128])


def test_empty():
    x = torch.empty(0)
    packed, scale, zero = _dev(tri.int_quant_encode, x, 4, 128, False)
    assert packed.numel() == scale.numel() == zero.numel() == 0
    assert _dev(tri.int_quant_decode, packed, scale, zero, 4, 128, False, 0, torch.bfloat16).numel() == 0


def test_group_size_must_fill_whole_bytes():
    with pytest.raises(ValueError, match="group_size"):
        _dev(tri.int_quant_encode, torch.randn(10), 1, 12, False)


@pytest.mark.parametrize("axis", [False, True])
def test_seeded_rounding_is_unbiased(axis):
    """tl.rand cannot match torch's stream: check the rounding statistics instead."""
    bits, n, trials = 4, 8192, 10  # 8192: two programs
    x = torch.full((n,), 0.3)  # v = 0.3 / (1/15) = 4.5 -> P(up) = 0.5 ...
    x[0::64], x[1::64] = 0.0, 1.0  # ... in every group / every column of 64
    x[2::4] = 0.62  # v = 9.3 -> P(up) = 0.3
    pos = torch.arange(n) % 64
    if axis:  # column c of [64, n // 64] holds group c of the flat layout
        x, pos = x.view(-1, 64).t().reshape(-1), pos.view(-1, 64).t().reshape(-1)
    ups_a, ups_b, decs = [], [], []
    for t in range(trials):
        seed = torch.tensor([1000 + 7919 * t], dtype=torch.int64)
        if axis:
            enc = _dev(tri.int_quant_axis_encode, x.view(64, -1), bits, False, seed=seed)
            dec = _dev(tri.int_quant_axis_decode, *enc, bits, False, n, torch.float32)
        else:
            enc = _dev(tri.int_quant_encode, x, bits, 64, False, seed=seed)
            dec = _dev(tri.int_quant_decode, *enc, bits, 64, False, n, torch.float32)
        codes = unpack_bits(enc[0], bits, n)
        ups_a.append((codes[(x == 0.3) & (pos > 1)] == 5).float())
        ups_b.append((codes[x == 0.62] == 10).float())
        decs.append(dec)
    p_a, p_b = torch.cat(ups_a).mean().item(), torch.cat(ups_b).mean().item()
    assert abs(p_a - 0.5) < 0.02 and abs(p_b - 0.3) < 0.02, (p_a, p_b)
    assert not torch.equal(decs[0], decs[1])  # different seeds, different codes
    mean = torch.stack(decs).mean(0)
    assert (mean - x).abs().max() < 5 * (1 / 15) / 2 / math.sqrt(trials)


def test_large_inputs_launch_several_programs(grids):
    """The shapes above reach past one program in every kernel of the family."""
    grids.watch(tri, "_encode_groups_kernel", "_decode_groups_kernel", "_encode_axis_kernel",
                "_decode_axis_kernel")
    n = max(math.prod(s) for s in SHAPES)
    enc = _dev(tri.int_quant_encode, _input((n,), torch.float32), 4, 128, False)
    _dev(tri.int_quant_decode, *enc, 4, 128, False, n, torch.float32)
    x2 = _input((600, 130), torch.float32)  # 3 row chunks x 9 column blocks
    enc = _dev(tri.int_quant_axis_encode, x2, 4, True)
    _dev(tri.int_quant_axis_decode, *enc, 4, True, x2.numel(), torch.float32)
    assert min(grids.most(k) for k in grids.programs) > 1, grids.programs
    assert len(grids.programs) == 4
    # the axis encode and decode tile [row chunk, channels]: several programs along both
    for k in ("_encode_axis_kernel", "_decode_axis_kernel"):
        assert grids.most_along(k, 0) == 3 and grids.most_along(k, 1) > 1, grids.grids
    # every launch forbids FMA contraction (see llm_act.kernels: no GPU-only semantics)
    assert all(grids.exact(k) for k in grids.programs), grids.fusion


def _extreme(n, dtype):
    """Normal values mixed with +-max, 0.99 max, +-Inf, NaN, a group at max, a group
    alternating +-max, and a group of subnormals."""
    f = torch.finfo(dtype)
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x[::7], x[3::11], x[5::13] = f.max, -f.max, 0.99 * f.max
    x[1::19], x[2::23], x[4::29] = float("inf"), float("-inf"), float("nan")
    x[256:384] = f.max
    x[384:512] = f.max
    x[385:512:2] = -f.max
    x[512:640] = tiny_values(128, dtype)
    return x.to(dtype)


# numpy (the interpreter) warns where a product overflows to Inf before the kernel clamps
# it or replaces it by NaN (the top code of a flagged group); the results are checked
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_values_match_reference_and_stay_finite(dtype, bits, symmetric):
    """Ranges of 2 max do not overflow: the kernels equal the reference bit for bit and
    finite inputs decode to finite values (per group and per axis)."""
    n = 4500
    x = _extreme(n, dtype)
    fin = torch.isfinite(x)
    noise = torch.rand(n)
    r = ref.int_quant_encode_ref(x, bits, 128, symmetric, noise)
    k = _dev(tri.int_quant_encode, x, bits, 128, symmetric, noise)
    assert all(torch.equal(a, b) for a, b in zip(r, k))
    assert torch.isfinite(r[1]).all() and torch.isfinite(r[2]).all()
    dr = ref.int_quant_decode_ref(*r, bits, 128, symmetric, n, dtype)
    dk = _dev(tri.int_quant_decode, *r, bits, 128, symmetric, n, dtype)
    torch.testing.assert_close(dk, dr, rtol=RTOL, atol=0, equal_nan=True)
    assert torch.isfinite(dr[fin]).all()
    x2 = x.view(36, 125)
    r = ref.int_quant_axis_encode_ref(x2, bits, symmetric, noise)
    k = _dev(tri.int_quant_axis_encode, x2, bits, symmetric, noise)
    assert all(torch.equal(a, b) for a, b in zip(r, k))
    dr = ref.int_quant_axis_decode_ref(*r, bits, symmetric, n, dtype)
    dk = _dev(tri.int_quant_axis_decode, *r, bits, symmetric, n, dtype)
    torch.testing.assert_close(dk, dr, rtol=RTOL, atol=0, equal_nan=True)
    assert torch.isfinite(dr[fin]).all()


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_axis_tiles_with_whole_bytes_per_row_match_reference(bits, symmetric):
    """C a multiple of 8 // bits (here 136), two row chunks: with noise and non-finite
    values, bit for bit."""
    x = _input((300, 136), torch.float32)
    noise = torch.rand(x.numel())
    r = ref.int_quant_axis_encode_ref(x, bits, symmetric, noise)
    k = _dev(tri.int_quant_axis_encode, x, bits, symmetric, noise)
    assert all(torch.equal(a, b) for a, b in zip(r, k))
    dr = ref.int_quant_axis_decode_ref(*r, bits, symmetric, x.numel(), torch.bfloat16)
    dk = _dev(tri.int_quant_axis_decode, *r, bits, symmetric, x.numel(), torch.bfloat16)
    torch.testing.assert_close(dk, dr, rtol=RTOL, atol=0, equal_nan=True)
