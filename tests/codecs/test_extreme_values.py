"""Extreme values through every codec of the registry: finite in, finite out; Inf keeps its
sign; NaN stays NaN; shape and dtype preserved (issue 13, part 5).

Values near the dtype's maximum used to overflow group ranges (max - min), LFC sums and
residuals into Inf/NaN, and every non-finite input came back as NaN.
"""
import pytest
import torch


from llm_act.codecs import make_codec
from llm_act.codecs.base import nonfinite_capacity
from llm_act.codecs.registry import CODEC_NAMES, FEWBIT_CODECS, MASK_CODECS
from tests.codecs._checks import assert_nonfinite_kept_within_capacity

VALUE_CODECS = [n for n in CODEC_NAMES if n not in MASK_CODECS and n not in FEWBIT_CODECS]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPE = (24, 2, 80)  # dual2 pools along dim 0, outlier_int4 reads 80 channels


def _base(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def _near_max(dtype):
    """Small values mixed with +-max and +-0.99 max, in the same groups and channels."""
    big = torch.finfo(dtype).max
    x = _base(dtype).float()
    flat = x.view(-1)
    flat[::7] = big
    flat[3::11] = -big
    flat[5::13] = 0.99 * big
    flat[6::17] = -0.99 * big
    return x.clamp(-big, big).to(dtype)


def _huge_all(dtype):
    """Whole tensor at +-max, alternating: every range is 2 max."""
    big = torch.finfo(dtype).max
    x = torch.full(SHAPE, big, dtype=torch.float32)
    x.view(-1)[1::2] = -big
    return x.to(dtype)


def _nonfinite(dtype):
    x = _near_max(dtype).float()
    flat = x.view(-1)
    flat[1::19] = float("inf")
    flat[2::23] = float("-inf")
    flat[4::29] = float("nan")
    flat[200:328] = float("inf")  # a whole group of +Inf
    flat[400:528] = float("nan")  # and one of NaN
    return x.to(dtype)


def _subnormal(dtype):
    tiny = torch.finfo(dtype).smallest_normal
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(1)) * tiny
    x.view(-1)[::3] *= -1
    x.view(-1)[::5] = 0.0
    return x.to(dtype)


def _all_equal(dtype):
    return torch.full(SHAPE, 3.75, dtype=dtype)


def _all_zero(dtype):
    return torch.zeros(SHAPE, dtype=dtype)


CASES = {"near_max": _near_max, "huge_all": _huge_all, "nonfinite": _nonfinite,
         "subnormal": _subnormal, "all_equal": _all_equal, "all_zero": _all_zero}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", VALUE_CODECS)
def test_finite_in_finite_out(name, case, dtype):
    x = CASES[case](dtype)
    codec = make_codec(name, seed=3)
    enc = codec.encode(x)
    y = codec.decode(enc)
    cap = nonfinite_capacity(x.numel())
    bad_at = torch.nonzero(~torch.isfinite(x.reshape(-1))).reshape(-1)
    # within the capacity exact (NaN stays NaN, +-Inf keeps its sign); past it NaN, never
    # finite, and counted; finite stays finite everywhere
    assert_nonfinite_kept_within_capacity(x, y)
    assert codec.nonfinite_overflow == max(0, bad_at.numel() - cap)
    # the side list of non-finite values: fixed capacity, counted, its used slots first
    n_bad = int((~torch.isfinite(x)).sum())
    index = enc.data["nonfinite_index"]
    used = min(n_bad, cap)
    assert index.numel() == cap and int(enc.data["nonfinite_count"]) == n_bad
    assert torch.equal(index[:used].long(), bad_at[:used])
    assert bool((index[used:] == (bad_at[0] if used else 0)).all())  # unused: a used slot again
    assert enc.nbytes == codec.nbytes_for(x.shape, dtype, **(
        {"n_outliers": enc.meta["n_outliers"]} if name == "outlier_int4" else {}))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", VALUE_CODECS)
def test_constant_tensors_are_exact_or_close(name, dtype):
    """All-zero tensors decode to zeros; all-equal ones to (nearly) the constant."""
    codec = make_codec(name, seed=3)
    assert torch.equal(codec.roundtrip(_all_zero(dtype)), _all_zero(dtype))
    y = codec.roundtrip(_all_equal(dtype)).float()
    assert torch.allclose(y, torch.full_like(y, 3.75), rtol=2e-2, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", VALUE_CODECS)
def test_huge_values_keep_their_sign_and_size(name, dtype):
    """+-max alternating: decoded values stay within the input range and, for every codec
    with at least two levels per range, keep each element's sign and magnitude order."""
    x = _huge_all(dtype)
    y = make_codec(name, seed=3).roundtrip(x).float()
    big = torch.finfo(dtype).max
    assert (y.abs() <= big).all()
    if name == "dual2":  # the token mean of +-max is ~0; the 2-bit residual spans 2 max
        assert (y.abs() >= 0.3 * big).float().mean() > 0.9
        return
    xf = x.float()
    assert torch.equal(torch.sign(y), torch.sign(xf))
    assert ((y - xf).abs() <= 0.02 * big).all()


@pytest.mark.parametrize("name", ["fewbit1", "fewbit2", "fewbit3", "fewbit4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fewbit_nonfinite_gives_nonfinite_derivative(name, dtype):
    """Few-bit decode is f'(x), not x: a NaN/+-Inf input gives NaN (documented), and
    finite inputs, huge ones included, give finite derivatives."""
    x = _nonfinite(dtype)
    codec = make_codec(name, seed=3)
    d = codec.decode(codec.encode(x))
    assert d.shape == x.shape and d.dtype == dtype
    assert torch.isnan(d[~torch.isfinite(x)]).all()
    assert torch.isfinite(d[torch.isfinite(x)]).all()
    assert "nonfinite_index" not in codec.encode(x).data


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitmask_rejects_nonfinite_masks(dtype):
    """A mask holds 0/1 only: a NaN or Inf in it is an error, never a silent 1."""
    codec = make_codec("bitmask")
    m = torch.ones(SHAPE, dtype=dtype)
    assert torch.equal(codec.roundtrip(m), m)
    m.view(-1)[3] = float("inf")
    with pytest.raises(ValueError, match="0 and 1"):
        codec.encode(m)


@pytest.mark.parametrize("name", ["int4", "outlier_int4", "dual2", "fp8_e4m3"])
def test_error_on_normal_data_is_unchanged_by_a_far_group(name):
    """Extreme values in one region do not spoil the rest: elements in other groups,
    blocks and channels decode as accurately as when the huge ones are absent."""
    x = _base(torch.float32, seed=5)
    codec = make_codec(name, seed=3)
    clean = (codec.roundtrip(x) - x)[8:, 1].pow(2).mean()
    x2 = x.clone()
    x2[0, 0, :4] = torch.tensor([3e38, -3e38, float("inf"), float("nan")])
    err = (make_codec(name, seed=3).roundtrip(x2) - x2)[8:, 1].pow(2).mean()
    assert 0 < err <= 1.5 * clean


@pytest.mark.parametrize("name", ["int4", "fp8_e5m2", "dual2"])
def test_restoring_nonfinite_values_leaves_the_record_untouched(name):
    """Decode puts the side list's values back out of place: decoding twice gives the same
    tensor and the stored record is not written to."""
    x = _nonfinite(torch.float32)
    codec = make_codec(name, seed=3)
    enc = codec.encode(x)
    before = {k: v.clone() for k, v in enc.data.items()}
    a, b = codec.decode(enc), codec.decode(enc)
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert all(torch.equal(v.nan_to_num(), before[k].nan_to_num()) for k, v in enc.data.items())
