"""OutlierInt4 (Adacc sec. 3.2): exact outlier channels, INT4 error bounds and model, size."""
import math

import pytest
import torch

from llm_act.codecs import OutlierInt4, make_codec
from llm_act.codecs.base import side_list_nbytes
from llm_act.kernels import outlier_ref as ref
from tests.codecs._checks import assert_nonfinite_kept, assert_nonfinite_kept_within_capacity

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUT_CH = [3, 77, 130, 255]


def _outlier_x(rows=256, C=256, dtype=torch.float32, scale=50.0, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    x = torch.randn(rows, C, generator=g)
    x[:, OUT_CH] *= scale
    return x.to(dtype)


def _rows_per_chunk(C, group_size=128):
    """Rows of a tile (`outlier_ref.tile_layout`): 4096 elements of 512 channels (whole
    groups), groups padded to powers of two."""
    tc = min(C, group_size * max(1, 512 // group_size))
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    return max(1, 4096 // (pow2(-(-tc // group_size)) * pow2(group_size)))


def _inlier_groups_delta(codec, x):
    """Per-element step Delta of its group (float32 [rows*C]) and the outlier mask."""
    rows, C = x.reshape(-1, x.shape[-1]).shape
    x2 = x.reshape(rows, C)
    idx = codec.select(x2)
    _, _, _, mn, mx, bad = ref.group_stats(x2, idx, codec.group_size)
    delta = (mx - mn) / torch.where(bad, 14.0, 15.0)  # [rows, groups of a row]
    per = delta.repeat_interleave(codec.group_size, dim=1)[:, :C].reshape(-1)
    is_out = ref.outlier_mask(idx, rows, C, _rows_per_chunk(C, codec.group_size)).reshape(-1)
    return per, is_out, idx


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_channels_are_found_and_recovered_exactly(dtype):
    codec = OutlierInt4()
    x = _outlier_x(dtype=dtype)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert enc.meta["n_outliers"] == 4 and codec.last_outlier_count == 4
    # one tile (all 256 channels), 4 slots; every chunk of 16 rows finds the same channels
    assert enc.data["index"].tolist() == [OUT_CH] * (256 // 16)
    assert enc.data["index"].dtype == torch.int16
    assert enc.data["values"].dtype == dtype
    assert torch.equal(y[:, OUT_CH], x[:, OUT_CH])
    assert y.shape == x.shape and y.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_inlier_error_is_at_most_one_step_of_its_group(dtype):
    codec = OutlierInt4(seed=5)
    # C = 264: a partial group ends each row (groups do not span rows); inliers lie
    # around 10, so a fill of 0 would stretch ranges
    x = (_outlier_x(rows=64, C=264) + 10.0).to(dtype)
    y = codec.roundtrip(x).float().reshape(-1)
    xf = x.float().reshape(-1)
    delta, is_out, _ = _inlier_groups_delta(codec, x)
    # the output cast adds at most half an ulp of the dtype
    slack = xf.abs() * torch.finfo(dtype).eps + 1e-6
    err = (y - xf).abs()
    assert bool((err[~is_out] <= delta[~is_out] * (1 + 1e-5) + slack[~is_out]).all())
    assert bool((err[is_out] == 0).all())
    # the outliers do not stretch the inlier ranges: steps stay those of N(0, 1) data
    assert float(delta.max()) < 8.0 / 15


def _distributions():
    g = torch.Generator().manual_seed(11)
    normal = torch.randn(256, 512, generator=g)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((256, 512)).to(torch.float32)
    outl = torch.randn(256, 512, generator=g)
    outl[:, [5, 100, 300, 511]] *= 50
    return {"normal": normal, "laplace": laplace, "outlier_channels": outl}


@pytest.mark.parametrize("name", ["normal", "laplace", "outlier_channels"])
def test_error_model_within_2x_of_measured_mse(name):
    x = _distributions()[name]
    codec = OutlierInt4(seed=2)
    mse = float(((codec.roundtrip(x) - x) ** 2).mean())
    predicted = codec.expected_error(x)
    assert 0.5 * mse <= predicted <= 2.0 * mse, (name, predicted, mse)


def test_outlier_separation_beats_plain_int4_on_outlier_channels():
    x = _distributions()["outlier_channels"]
    sep = OutlierInt4(seed=3)
    plain = OutlierInt4(seed=3, max_outlier_frac=0.0)  # nothing separated: plain INT4
    mse_sep = float(((sep.roundtrip(x) - x) ** 2).mean())
    mse_plain = float(((plain.roundtrip(x) - x) ** 2).mean())
    assert plain.last_outlier_count == 0
    assert mse_plain > 20 * mse_sep, (mse_plain, mse_sep)
    # the error models agree on the gap
    assert plain.expected_error(x) > 20 * sep.expected_error(x)


def test_mean_of_many_decodes_converges_to_x():
    x = _outlier_x(rows=8, C=256, scale=20.0)
    x[:, 0] += 3.0  # a channel away from zero
    codec = OutlierInt4(seed=9)
    n = 800
    acc = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(n):
        acc += codec.roundtrip(x).double()
    mean = (acc / n).float()
    delta, _, _ = _inlier_groups_delta(codec, x)
    tol = 5 * delta.reshape(x.shape) / math.sqrt(6 * n) + 1e-6
    assert bool(((mean - x).abs() <= tol).all())
    # and single decodes are really random
    assert not torch.equal(codec.roundtrip(x), codec.roundtrip(x))


def test_own_generator_leaves_global_rng_untouched_and_is_reproducible():
    x = torch.randn(33, 128)
    state = torch.get_rng_state()
    a = OutlierInt4(seed=7).encode(x)
    assert torch.equal(torch.get_rng_state(), state)
    b = OutlierInt4(seed=7).encode(x)
    c = OutlierInt4(seed=8).encode(x)
    assert torch.equal(a.data["packed"], b.data["packed"])
    assert not torch.equal(a.data["packed"], c.data["packed"])
    codec = OutlierInt4(seed=7)
    codec.encode(x)
    saved = codec.state_dict()
    first = codec.encode(x).data["packed"]
    codec.load_state_dict(saved)
    assert torch.equal(codec.encode(x).data["packed"], first)


@pytest.mark.parametrize("shape", [(512, 512), (3, 5, 130), (1, 300), (127,), (2, 64, 4000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nbytes_matches_formula_and_encode(shape, dtype):
    codec = OutlierInt4()
    x = torch.randn(shape).to(dtype)
    if shape[-1] >= 64:
        x[..., 7] *= 100
    enc = codec.encode(x)
    k = enc.meta["n_outliers"]
    numel = x.numel()
    C = shape[-1]
    itemsize = x.element_size()
    index_bytes = 2 if C < 2**15 else 4
    rows = numel // C
    chunks = math.ceil(rows / _rows_per_chunk(C))
    # rows padded to whole bytes, groups within rows, k slots per row, indices per chunk
    formula = (rows * math.ceil(C / 2) + 8 * rows * math.ceil(C / 128)
               + k * (rows * itemsize + chunks * index_bytes) + side_list_nbytes(numel, dtype))
    assert enc.nbytes == codec.nbytes_for(shape, dtype, k) == formula
    # floor(1/64 of each tile's channels) per tile: tiles of 512 (C below 512: all of C)
    tiles = math.ceil(C / 512)
    assert k == tiles * (min(C, 512) // 64)
    if shape[-1] >= 64:
        assert k >= 1


def test_bits_per_element_at_defaults():
    codec = OutlierInt4()
    n = 512 * 512
    side = side_list_nbytes(n, torch.bfloat16)
    assert (codec.nbytes_for((512, 512), torch.bfloat16, 0) - side) * 8 / n == 4.5
    # the default: its fixed slots, 1/64 of the channels (8 of 512), whatever the data
    assert codec.nbytes_for((512, 512), torch.bfloat16) == codec.nbytes_for((512, 512), torch.bfloat16, 8)
    with_4 = (codec.nbytes_for((512, 512), torch.bfloat16, 4) - side) * 8 / n
    # values: 4 per row; indices: 4 per chunk of 8 rows (one tile of 512 channels)
    assert with_4 == pytest.approx(4.5 + (4 * 512 * 2 + 4 * (512 // 8) * 2) * 8 / n)
    assert codec.nbytes_for((0, 512), torch.float16) == 0
    with pytest.raises(ValueError, match="n_outliers"):
        codec.nbytes_for((4, 8), torch.float32, 9)


def test_cap_keeps_the_largest_z_channels():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    big = list(range(0, 256, 32))  # 8 candidates, all far above z = 3
    for i, c in enumerate(big):
        x[:, c] = x[:, c].sign() * (30.0 + i)  # later ones larger
    codec = OutlierInt4(max_outlier_frac=1 / 64)  # cap 4
    assert codec.max_outliers(256) == 4
    colsum = ref.column_abs_sums(x)
    z = (colsum - colsum.mean()) / colsum.std(correction=0)
    assert bool((z[big] > 3).all())
    enc = codec.encode(x)
    assert enc.data["index"].tolist() == [big[-4:]] * (64 // 16)  # every chunk of 16 rows
    assert torch.equal(codec.decode(enc)[:, big[-4:]], x[:, big[-4:]])
    # the other 4 are quantized: within a step of their group, not exact
    y = codec.decode(enc)
    assert not torch.equal(y[:, big[:4]], x[:, big[:4]])
    # an infinite threshold separates nothing: the 4 slots stay unused (index C)
    enc = OutlierInt4(z_threshold=float("inf"), max_outlier_frac=1 / 64).encode(x)
    assert enc.meta["n_outliers"] == 4 and OutlierInt4.outlier_count(enc) == 0
    assert enc.data["index"].tolist() == [[256] * 4] * 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1000), (7, 130), (1,), (), (5, 1), (3, 5, 130)])
def test_odd_shapes_round_trip(shape, dtype):
    codec = OutlierInt4(group_size=64)
    x = torch.randn(shape).to(dtype)
    y = codec.roundtrip(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    rng = float(x.float().max() - x.float().min()) if x.numel() else 0.0
    assert float((y.float() - x.float()).abs().max()) <= rng / 15 * 1.01 + 1e-2


def test_non_contiguous_input_reads_as_contiguous():
    base = torch.randn(130, 96)
    base[5, :] *= 40  # becomes channel 5 after the transpose
    x = base.t()
    assert not x.is_contiguous()
    a = OutlierInt4(seed=4).encode(x)
    b = OutlierInt4(seed=4).encode(x.contiguous())
    # 2 slots for 130 channels (one tile), one unused (C), in each of 6 chunks of 16 rows
    assert a.data["index"].tolist() == [[5, 130]] * 6
    for key in a.data:
        assert torch.equal(a.data[key], b.data[key])
    y = OutlierInt4(seed=4).decode(a)
    assert torch.equal(y[:, 5], x[:, 5])


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0,)])
def test_empty_tensors(shape):
    codec = OutlierInt4()
    x = torch.empty(shape, dtype=torch.bfloat16)
    enc = codec.encode(x)
    assert enc.nbytes == 0 == codec.nbytes_for(shape, x.dtype)
    assert enc.meta["n_outliers"] == 0 and codec.expected_error(x) == 0.0
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_values_are_kept_at_their_positions(dtype):
    x = _outlier_x(rows=40, C=256, dtype=dtype)
    bad = [(0, 5, float("nan")), (3, 77, float("inf")), (9, 9, float("-inf")),
           (10, 130, float("nan")), (39, 255, float("-inf")), (20, 200, float("inf"))]
    for r, c, v in bad:
        x[r, c] = v
    codec = OutlierInt4()
    enc = codec.encode(x)
    # non-finite values do not sway selection (40 rows: 3 chunks of 16)
    assert enc.data["index"].tolist() == [OUT_CH] * 3
    y = codec.decode(enc)
    expect = torch.zeros(x.shape, dtype=torch.bool)
    for r, c, _ in bad:
        expect[r, c] = True
    assert_nonfinite_kept_within_capacity(x, y)  # 6 of them, 5 slots: the last decodes to NaN
    # finite inliers, also those in groups flagged for a non-finite value, stay within a step
    inlier = ~torch.isin(torch.arange(256), torch.tensor(OUT_CH))
    ok = ~expect & inlier.expand(40, 256)
    assert float((y[ok].float() - x[ok].float()).abs().max()) < 1.0


def test_all_nonfinite_group_and_constant_groups():
    x = torch.full((4, 64), 2.5)
    x[0, :] = float("nan")
    y = OutlierInt4(group_size=64).roundtrip(x)
    assert torch.isnan(y[0]).all()
    assert torch.equal(y[1:], x[1:])


def test_registry_and_bad_arguments():
    codec = make_codec("outlier_int4", seed=3)
    assert isinstance(codec, OutlierInt4) and codec.stochastic and codec.seed == 3
    for kw in [{"group_size": 7}, {"group_size": 0}, {"group_size": 64.0},
               {"max_outlier_frac": 1.5}, {"z_threshold": float("nan")}, {"z_threshold": "3"}]:
        with pytest.raises(ValueError, match=next(iter(kw))):
            OutlierInt4(**kw)
    with pytest.raises(TypeError, match="dtype"):
        OutlierInt4().encode(torch.arange(10))


def test_each_tile_keeps_its_own_outlier_channels():
    """C = 1024: two tiles of 512 channels with 8 slots each, chosen per chunk of 8 rows;
    8 outlier channels crowded into the first tile all fit, the second tile's are found
    too, all exactly; the error model uses the same choice."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(48, 1024, generator=g)
    crowded, other = [0, 1, 2, 60, 61, 200, 300, 511], [512, 1023]
    x[:, crowded + other] *= 40.0
    codec = OutlierInt4(seed=1)
    enc = codec.encode(x)
    assert enc.meta["n_outliers"] == 16 == codec.max_outliers(1024)
    index = enc.data["index"]
    assert index.shape == (6, 16)  # 48 rows / 8
    assert index.tolist() == [crowded + other + [1024] * 6] * 6
    y = codec.decode(enc)
    assert torch.equal(y[:, crowded + other], x[:, crowded + other])
    inl = torch.ones(1024, dtype=torch.bool)
    inl[crowded + other] = False
    assert float((y - x)[:, inl].abs().max()) < 1.0  # steps of N(0, 1) groups, not of 40x
    mse = float(((y - x) ** 2).mean())
    assert 0.5 <= mse / codec.expected_error(x) <= 2.0
