"""Outlier INT4 Triton kernels against the torch reference (interpreter on CPU).

Same noise passed in -> identical codes, scales, zeros, outlier slots and values, and
decode; the in-kernel Philox path is checked statistically; the per-tile outlier choice
(`outlier_ref.select_tiles_ref`) against planted outlier channels.
"""
import math

import pytest
import torch

from llm_act.kernels import outlier_ref as ref
from tests.kernels._values import assert_same_side_list, side_lists

tri = pytest.importorskip("llm_act.kernels.outlier_triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (1, 127), (8, 125), (15, 130), (40, 100), (3, 600)]


def _matrix(shape, dtype, seed=0, nonfinite=True):
    g = torch.Generator().manual_seed(seed)
    x2 = torch.randn(shape, generator=g)
    C = shape[-1]
    idx = torch.tensor(sorted({c for c in (0, C // 3, C - 1)}), dtype=torch.int64)
    x2[:, idx] *= 40
    if nonfinite and x2.numel() > 20:  # non-finite values among inliers and in an outlier channel
        x2.view(-1)[7] = float("nan")
        x2.view(-1)[-3] = float("inf")
        x2[-1, C - 1] = float("-inf")
    return x2.to(dtype).contiguous(), idx


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def _slots(C, gs):
    return max(1, ref.slots_per_tile(C, gs, 1 / 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_encode_decode_match_reference_with_the_same_noise(shape, dtype):
    x2, _ = _matrix(shape, dtype)
    rows, C = x2.shape
    noise = torch.rand(x2.numel(), generator=torch.Generator().manual_seed(1))
    for gs in (128, 6):
        K = _slots(C, gs)
        want = ref.outlier_encode_ref(x2, gs, 3.0, K, noise=noise)
        got = tri.outlier_encode(x2, gs, 3.0, K, noise=noise)
        for name, w, g in zip(("packed", "scale", "zero", "values", "index"), want, got):
            assert _same(w, g), (name, gs)
        dec_ref = ref.outlier_decode_ref(*want, gs, rows, C, dtype)
        dec_tri = tri.outlier_decode(*want, gs, rows, C, dtype)
        assert _same(dec_ref, dec_tri)
        assert torch.equal(torch.isnan(dec_tri), ~torch.isfinite(x2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nearest_rounding_matches_reference(dtype):
    x2, _ = _matrix((24, 96), dtype, seed=3)
    want = ref.outlier_encode_ref(x2, 64, 3.0, 2)
    got = tri.outlier_encode(x2, 64, 3.0, 2)
    for w, g in zip(want, got):
        assert _same(w, g)


def test_tiles_pick_their_own_outlier_channels():
    """C = 1024: two tiles of 512 channels, 8 slots each. Each chunk of 8 rows keeps the
    channels planted in its tile (the largest z first past 8), values bit for bit; the
    record's layout is the documented one."""
    g = torch.Generator().manual_seed(4)
    x2 = torch.randn(20, 1024, generator=g)
    # 9 in tile 0 (channel 255 the smallest, all with z > 3), 1 in tile 1
    tile0 = [3, 77, 130, 200, 255, 300, 301, 400, 511]
    for c in tile0:
        x2[:, c] = x2[:, c].sign() * (30.0 if c == 255 else 31.0 + c / 100)
    x2[:, 700] = x2[:, 700].sign() * 40.0
    x2 = x2.to(torch.bfloat16)
    kept = [c for c in tile0 if c != 255] + [700]
    packed, scale, zero, values, index = tri.outlier_encode(x2, 128, 3.0, 8, seed=5)
    assert packed.shape == (20, 512) and scale.shape == zero.shape == (20, 8)
    assert values.shape == (20, 16) and values.dtype == torch.bfloat16
    assert index.shape == (3, 16) and index.dtype == torch.int16  # ceil(20 / 8) chunks
    assert index.tolist() == [kept + [1024] * 7] * 3
    assert torch.equal(index, ref.select_tiles_ref(x2, 128, 3.0, 8).to(torch.int16))
    assert torch.equal(values[:, :9], x2[:, kept])
    assert torch.equal(values[:, 9:], torch.zeros(20, 7, dtype=torch.bfloat16))
    y = tri.outlier_decode(packed, scale, zero, values, index, 128, 20, 1024, torch.bfloat16)
    assert torch.equal(y[:, kept], x2[:, kept])
    # past the tile's 8 slots, channel 255 (+-30) stays an inlier and stretches its group
    # (channels 128..255; scale: the step of x / 2), the kept ones do not stretch theirs
    assert (scale[:, 1] > 0.9).all() and (scale[:, [0, 2, 3, 5]] < 0.5).all()
    # an infinite threshold keeps nothing: every slot unused (index C), values 0
    _, _, _, values, index = tri.outlier_encode(x2, 128, float("inf"), 8, seed=5)
    assert (index == 1024).all() and (values == 0).all()


def test_philox_noise_is_unbiased_and_within_one_step():
    x2, idx = _matrix((16, 256), torch.float32, seed=4, nonfinite=False)
    rows, C = x2.shape
    gs = 128
    index = ref.select_tiles_ref(x2, gs, 3.0, 4)
    assert index.tolist() == [idx.tolist() + [C]]  # the 3 planted channels
    _, _, _, mn, mx, _ = ref.group_stats(x2, index, gs)
    delta = ((mx - mn) / 15).repeat_interleave(gs, dim=1)
    n = 10
    acc = torch.zeros_like(x2, dtype=torch.float64)
    decodes = []
    for s in range(n):
        enc = tri.outlier_encode(x2, gs, 3.0, 4, seed=1000 + s)
        assert torch.equal(enc[4], index.to(torch.int16))
        y = tri.outlier_decode(*enc, gs, rows, C, x2.dtype)
        assert bool(((y - x2).abs() <= delta * (1 + 1e-5) + 1e-6).all())
        assert torch.equal(y[:, idx], x2[:, idx])
        acc += y.double()
        decodes.append(y)
    assert not torch.equal(decodes[0], decodes[1])
    # per-element mean over n draws: bias << step; averaged over all elements: ~0
    err = (acc / n).float() - x2
    inl = torch.ones(C, dtype=torch.bool)
    inl[idx] = False
    e, d = err[:, inl], delta[:, inl]
    assert abs(float(e.mean())) < 5 * float(d.mean()) / math.sqrt(6 * n * e.numel())
    mse = float(((decodes[0] - x2)[:, inl] ** 2).mean())
    assert 0.5 < mse / float((d**2 / 6).mean()) < 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_side_list_is_filled_in_the_encode_pass(dtype, grids):
    """With a state, the kernel's side list is the reference's (in the one launch)."""
    grids.watch(tri, "_encode_kernel")
    x2, _ = _matrix((40, 100), dtype)  # 3 non-finite values, 2 programs
    x2[30, 50] = float("nan")
    found = side_lists((tri.outlier_encode, ref.outlier_encode_ref), x2, 128, 3.0, 1, seed=3)
    assert grids.most("_encode_kernel") == 2
    assert_same_side_list(found, 4)


def test_no_slots_and_empty():
    x2, _ = _matrix((20, 70), torch.float16, seed=5)
    noise = torch.rand(x2.numel())
    want = ref.outlier_encode_ref(x2, 128, 3.0, 0, noise=noise)
    got = tri.outlier_encode(x2, 128, 3.0, 0, noise=noise)
    for w, g in zip(want, got):
        assert _same(w, g)
    assert got[3].shape == (20, 0) and got[4].shape == (1, 0)
    d = tri.outlier_decode(*got, 128, 20, 70, torch.float16)
    assert _same(d, ref.outlier_decode_ref(*want, 128, 20, 70, torch.float16))
    empty = torch.empty(0, 64)
    enc = tri.outlier_encode(empty, 128, 3.0, 1)
    assert sum(t.numel() for t in enc) == 0
    assert tri.outlier_decode(*enc, 128, 0, 64, torch.float32).shape == (0, 64)


def test_large_inputs_launch_several_programs(grids):
    """Programs along row chunks and channel tiles in both kernels (one launch each)."""
    grids.watch(tri, "_encode_kernel", "_decode_kernel")
    x2, _ = _matrix((40, 600), torch.float32)  # 5 chunks of 8 rows x 2 tiles (512 + 88)
    rows, C = x2.shape
    enc = tri.outlier_encode(x2, 128, 3.0, 4)
    tri.outlier_decode(*enc, 128, rows, C, torch.float32)
    assert len(grids.programs) == 2
    for k in ("_encode_kernel", "_decode_kernel"):
        assert grids.grids[k][-1] == (5, 2), grids.grids
    assert all(grids.exact(k) for k in grids.programs), grids.fusion  # no FMA contraction


# numpy (the interpreter) warns where a product overflows to Inf before the kernel clamps
# it or replaces it by NaN (the top code of a flagged group); the results are checked
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_values_match_reference_and_stay_finite(dtype):
    """Inlier ranges of 2 max and huge outlier channels: bit for bit with the reference,
    finite where the input is."""
    big = torch.finfo(dtype).max
    x2, idx = _matrix((30, 100), torch.float32, seed=6)
    x2.view(-1)[::7], x2.view(-1)[3::11] = big, -big
    x2[:, idx[0]] = big  # an outlier channel at the maximum
    x2[2, :] = big
    x2[2, ::2] = -big
    x2 = x2.to(dtype)
    rows, C = x2.shape
    noise = torch.rand(x2.numel(), generator=torch.Generator().manual_seed(1))
    want = ref.outlier_encode_ref(x2, 128, 3.0, 1, noise=noise)
    got = tri.outlier_encode(x2, 128, 3.0, 1, noise=noise)
    for w, g in zip(want, got):
        assert _same(w, g)
    dec_ref = ref.outlier_decode_ref(*want, 128, rows, C, dtype)
    dec_tri = tri.outlier_decode(*want, 128, rows, C, dtype)
    assert _same(dec_ref, dec_tri)
    assert torch.isfinite(dec_tri[torch.isfinite(x2)]).all()


@pytest.mark.gpu
def test_codec_on_cuda_matches_cpu_reference_statistically():
    from llm_act.codecs import OutlierInt4

    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    x[:, [3, 500]] *= 50
    x[1, 2] = float("nan")
    codec = OutlierInt4()
    enc = codec.encode(x)
    y = codec.decode(enc)
    index = enc.data["index"]
    assert index.shape == (64, 16)  # 512 / 8 chunks, 2 tiles of 8 slots
    assert set(index.unique().tolist()) == {3, 500, 1024}
    assert torch.equal(y[:, [3, 500]], x[:, [3, 500]])
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    mse = float(((y.float() - x.float()) ** 2).nan_to_num().mean())
    assert 0.5 < mse / codec.expected_error(x) < 2.0
    noise = torch.rand(x.numel(), device="cuda")
    got = tri.outlier_encode(x, 128, 3.0, 8, noise=noise)
    want = ref.outlier_encode_ref(x.cpu(), 128, 3.0, 8, noise=noise.cpu())
    assert torch.equal(got[4].cpu(), want[4])
    assert (got[0].cpu() == want[0]).all()  # div_rn, no FMA: the same codes
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0)
