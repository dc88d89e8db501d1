"""Outlier INT4 Triton kernels against the torch reference (interpreter on CPU).

Same noise passed in -> identical codes, scales, zeros, outlier values and decode; the
in-kernel Philox path is checked statistically.
"""
import math

import pytest
import torch

from llm_act.kernels import outlier_ref as ref
from llm_act.kernels import outlier_triton as tri

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (127,), (1000,), (3, 5, 130), (40, 100)]


def _matrix(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    C = shape[-1]
    x2 = x.reshape(-1, C)
    idx = torch.tensor([c for c in (0, C // 3, C - 1) if c < C and C >= 2],
                       dtype=torch.int64).unique()
    x2[:, idx] *= 40
    if x2.numel() > 20:  # non-finite values among inliers and in an outlier channel
        x2.view(-1)[7] = float("nan")
        x2.view(-1)[-3] = float("inf")
        x2[-1, C - 1] = float("-inf")
    return x2.to(dtype).contiguous(), idx


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_decode_match_reference_with_the_same_noise(shape, dtype):
    x2, idx = _matrix(shape, dtype)
    rows, C = x2.shape
    noise = torch.rand(x2.numel(), generator=torch.Generator().manual_seed(1))
    for gs in (128, 6):
        want = ref.outlier_encode_ref(x2, idx, gs, noise=noise)
        got = tri.outlier_encode(x2, idx, gs, noise=noise)
        for w, g in zip(want, got):
            assert _same(w, g)
        dec_ref = ref.outlier_decode_ref(*want[:3], idx, want[3], gs, rows, C, dtype)
        dec_tri = tri.outlier_decode(*want[:3], idx, want[3], gs, rows, C, dtype)
        assert _same(dec_ref, dec_tri)
        assert torch.equal(torch.isnan(dec_tri), ~torch.isfinite(x2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nearest_rounding_matches_reference(dtype):
    x2, idx = _matrix((24, 96), dtype, seed=3)
    want = ref.outlier_encode_ref(x2, idx, 64)
    got = tri.outlier_encode(x2, idx, 64)
    for w, g in zip(want, got):
        assert _same(w, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(300, 70), (5, 130), (1, 9)])
def test_colsum_matches_reference(shape, dtype):
    x2, _ = _matrix(shape, dtype, seed=2)
    want = ref.outlier_colsum_ref(x2)
    got = tri.outlier_colsum(x2)
    assert got.dtype == torch.float32 and got.shape == (shape[-1],)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the selection made from either sum is the same
    assert torch.equal(ref.select_outliers(got, 3.0, 8), ref.select_outliers(want, 3.0, 8))


def test_philox_noise_is_unbiased_and_within_one_step():
    x2, idx = _matrix((8, 256), torch.float32, seed=4)
    x2 = torch.nan_to_num(x2, nan=0.0, posinf=0.0, neginf=0.0)
    rows, C = x2.shape
    gs = 128
    _, _, _, mn, mx, _ = ref.group_stats(x2, idx, gs)
    delta = ((mx - mn) / 15).repeat_interleave(gs).view(rows, C)
    n = 10
    acc = torch.zeros_like(x2, dtype=torch.float64)
    decodes = []
    for s in range(n):
        enc = tri.outlier_encode(x2, idx, gs, seed=torch.tensor([1000 + s]))
        y = tri.outlier_decode(*enc[:3], idx, enc[3], gs, rows, C, x2.dtype)
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


def test_no_outliers_and_empty():
    x2, _ = _matrix((20, 70), torch.float16, seed=5)  # two programs
    none = torch.empty(0, dtype=torch.int64)
    noise = torch.rand(x2.numel())
    want = ref.outlier_encode_ref(x2, none, 128, noise=noise)
    got = tri.outlier_encode(x2, none, 128, noise=noise)
    for w, g in zip(want, got):
        assert _same(w, g)
    assert got[3].shape == (20, 0)
    empty = torch.empty(0, 64)
    packed, scale, zero, values = tri.outlier_encode(empty, none, 128)
    assert packed.numel() == scale.numel() == zero.numel() == values.numel() == 0
    assert tri.outlier_decode(packed, scale, zero, none, values, 128, 0, 64,
                              torch.float32).shape == (0, 64)
    assert torch.equal(tri.outlier_colsum(empty), torch.zeros(64))


def test_large_inputs_launch_several_programs(grids):
    """SHAPES' largest matrix reaches past one program in every kernel of the family."""
    grids.watch(tri, "_colsum_kernel", "_encode_kernel", "_decode_kernel")
    x2, idx = _matrix(SHAPES[-1], torch.float32)
    rows, C = x2.shape
    tri.outlier_colsum(x2)
    enc = tri.outlier_encode(x2, idx, 128)
    tri.outlier_decode(*enc[:3], idx, enc[3], 128, rows, C, torch.float32)
    assert len(grids.programs) == 3
    assert min(grids.most(k) for k in grids.programs) > 1, grids.programs
    assert all(grids.exact(k) for k in grids.programs), grids.fusion  # no FMA contraction


# numpy (the interpreter) warns where a product overflows to Inf before the kernel clamps
# it or replaces it by NaN (the top code of a flagged group); the results are checked
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
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
    want = ref.outlier_encode_ref(x2, idx, 128, noise=noise)
    got = tri.outlier_encode(x2, idx, 128, noise=noise)
    for w, g in zip(want, got):
        assert _same(w, g)
    dec_ref = ref.outlier_decode_ref(*want[:3], idx, want[3], 128, rows, C, dtype)
    dec_tri = tri.outlier_decode(*want[:3], idx, want[3], 128, rows, C, dtype)
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
    assert enc.data["index"].tolist() == [3, 500]
    assert torch.equal(y[:, [3, 500]], x[:, [3, 500]])
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    mse = float(((y.float() - x.float()) ** 2).nan_to_num().mean())
    assert 0.5 < mse / codec.expected_error(x) < 2.0
    noise = torch.rand(x.numel(), device="cuda")
    idx = enc.data["index"].long()
    got = tri.outlier_encode(x.view(512, 1024), idx, 128, noise=noise)
    want = ref.outlier_encode_ref(x.view(512, 1024).cpu(), idx.cpu(), 128, noise=noise.cpu())
    codes_differ = (got[0].cpu() != want[0]).float().mean()
    assert codes_differ < 1e-3  # division may round differently on the device, rarely
    torch.testing.assert_close(got[1].cpu(), want[1])
