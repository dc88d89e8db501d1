"""IntQuant: error bounds, unbiasedness, own generator, sizes, edge cases, error model."""
import math

import pytest
import torch

from llm_act.codecs import IntQuant, make_codec
from llm_act.codecs.base import side_list_nbytes
from tests.codecs._checks import assert_nonfinite_kept, assert_nonfinite_kept_within_capacity

REGISTERED = ["int1", "int2", "int4", "int8", "int4_sym", "int8_sym", "int4_asym", "int4_channel"]
EXTRA = {  # variants the registry does not name
    "int2_sym_sr": dict(bits=2, symmetric=True, stochastic=True),
    "int8_g32_axis0": dict(bits=8, group_size=32, axis=0),
    "int4_axis1_sr": dict(bits=4, symmetric=True, stochastic=True, axis=1),
}
VARIANTS = REGISTERED + list(EXTRA)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _codec(name, seed=1234):
    if name in EXTRA:
        return IntQuant(seed=seed, **EXTRA[name])
    return make_codec(name, seed=seed)


def _bound(codec, x):
    """Largest |decode - x| allowed per element: Delta (stochastic) or Delta / 2 (nearest),
    plus float32 arithmetic and the rounding of the output dtype."""
    delta = codec.step_sizes(x)
    if codec.axis is not None:  # step_sizes is in the moved-axis order
        ax = codec.axis % x.dim()
        delta = delta.view(x.movedim(ax, -1).shape).movedim(-1, ax).reshape(-1)
    factor = 1.0 if codec.stochastic else 0.5
    eps = torch.finfo(x.dtype).eps
    xf = x.reshape(-1).float().nan_to_num(0.0, 0.0, 0.0).abs()
    return factor * delta * (1 + 1e-5) + eps * xf + 1e-6 * xf.max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", VARIANTS)
def test_roundtrip_within_bound(name, dtype):
    codec = _codec(name)
    x = (torch.randn(37, 3, 70) * 2 + 1).to(dtype)  # 7770 elements: last group padded
    d = codec.decode(codec.encode(x))
    assert d.shape == x.shape and d.dtype == dtype and d.device == x.device
    err = (d.float() - x.float()).reshape(-1).abs()
    bound = _bound(codec, x)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert err.max() > 0  # it is lossy: the check above is not vacuous


@pytest.mark.parametrize("name", ["int1", "int2", "int4", "int8", "int2_sym_sr", "int4_axis1_sr"])
def test_stochastic_rounding_is_unbiased(name):
    codec = _codec(name)
    assert codec.stochastic
    x = torch.randn(8, 256)
    trials = 200
    mean = sum(codec.roundtrip(x) for _ in range(trials)) / trials
    # per element Var <= Delta^2 / 4, so the mean of `trials` decodes is within
    # 5 standard deviations except with probability < 1e-6 per element
    delta = _bound(codec, x) / (1 + 1e-5)
    err = (mean - x).reshape(-1)
    assert (err.abs() <= 5 * delta / (2 * math.sqrt(trials)) + 1e-6).all()
    # a small bias common to all elements shows in the mean of the normalised errors
    signed = (err / delta.clamp_min(1e-12)).mean().item()
    assert abs(signed) <= 5 * 0.5 / math.sqrt(trials * x.numel()), signed


def test_nearest_rounding_is_deterministic_and_biased():
    codec = make_codec("int4_asym")
    assert not codec.stochastic and not codec.lossless
    x = torch.randn(4, 128)
    assert torch.equal(codec.roundtrip(x), codec.roundtrip(x))


def test_own_generator():
    x = torch.randn(3000)
    state = torch.get_rng_state()
    a, b = IntQuant(seed=7), IntQuant(seed=7)
    ea, eb = a.encode(x), b.encode(x)
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched
    assert torch.equal(ea.data["codes"], eb.data["codes"])  # same seed, same codes
    assert not torch.equal(a.encode(x).data["codes"], ea.data["codes"])  # stream advances
    assert not torch.equal(IntQuant(seed=8).encode(x).data["codes"], ea.data["codes"])
    saved = a.state_dict()
    first = a.encode(x).data["codes"]
    a.load_state_dict(saved)
    assert torch.equal(a.encode(x).data["codes"], first)


def _formula(codec, shape):
    n = math.prod(shape)
    if n == 0:
        return 0
    per_param = 4 if codec.symmetric else 8
    if codec.axis is None:
        return (math.ceil(n * codec.bits / 8) + per_param * math.ceil(n / codec.group_size)
                + side_list_nbytes(n, torch.bfloat16))
    # per axis: rows padded to whole bytes, a scale (and zero) per column per 256 rows
    C = shape[codec.axis]
    rows = n // C
    return (rows * math.ceil(C * codec.bits / 8) + per_param * C * math.ceil(rows / 256)
            + side_list_nbytes(n, torch.bfloat16))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (10, 100), (3, 5, 130), (64, 2, 512)],
                         ids=str)
def test_nbytes(name, shape):
    codec = _codec(name)
    x = torch.randn(shape, dtype=torch.bfloat16)
    enc = codec.encode(x)
    assert enc.nbytes == codec.nbytes_for(shape, torch.bfloat16) == _formula(codec, shape)


@pytest.mark.parametrize("name,bits", [("int1", 1.5), ("int2", 2.5), ("int4", 4.5), ("int8", 8.5),
                                       ("int4_sym", 4.25), ("int4_asym", 4.5),
                                       # scales per column per 256 of the 512 rows
                                       ("int4_channel", 4 + 32 * 2 * 512 / (256 * 2 * 512))])
def test_bits_per_element_at_defaults(name, bits):
    codec = make_codec(name)
    enc = codec.encode(torch.randn(256, 2, 512, dtype=torch.bfloat16))
    side = side_list_nbytes(enc.numel, torch.bfloat16) * 8 / enc.numel
    assert enc.bits_per_element() == pytest.approx(bits + side)


@pytest.mark.parametrize("name", ["int4", "int1", "int8_sym", "int4_channel", "int8_g32_axis0"])
@pytest.mark.parametrize("shape", [(1,), (127,), (129,), (3, 5, 130), (1001, 3)], ids=str)
def test_odd_sizes(name, shape):
    codec = _codec(name)
    x = torch.randn(shape)
    d = codec.roundtrip(x)
    assert d.shape == x.shape
    assert ((d - x).reshape(-1).abs() <= _bound(codec, x)).all()


@pytest.mark.parametrize("name", ["int4", "int4_sym", "int4_channel", "int8_g32_axis0"])
def test_non_contiguous(name):
    base = torch.randn(66, 40)
    x = base.t()
    assert not x.is_contiguous()
    d = _codec(name, seed=3).roundtrip(x)
    assert torch.equal(d, _codec(name, seed=3).roundtrip(x.contiguous()))
    x3 = torch.randn(6, 10, 9)[:, ::2, 1:]  # strided view
    d3 = _codec(name).roundtrip(x3)
    assert d3.shape == x3.shape
    assert ((d3 - x3).reshape(-1).abs() <= _bound(_codec(name), x3.contiguous())).all()


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 5)], ids=str)
def test_empty(name, shape):
    codec = _codec(name)
    x = torch.empty(shape, dtype=torch.float16)
    enc = codec.encode(x)
    assert enc.nbytes == 0 == codec.nbytes_for(shape, torch.float16)
    d = codec.decode(enc)
    assert d.shape == x.shape and d.dtype == torch.float16
    assert codec.expected_error(x) == 0.0


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_range(name, dtype):
    codec = _codec(name)
    zeros = torch.zeros(5, 300, dtype=dtype)
    assert torch.equal(codec.roundtrip(zeros), zeros)
    if not codec.symmetric:  # constant groups / columns decode exactly
        x = torch.full((4, 256), 0.3, dtype=dtype)
        x[2:] = torch.randn(2, 256, dtype=dtype)
        if codec.axis is not None:
            x = x.t().contiguous() if codec.axis % 2 == 1 else x
        d = codec.roundtrip(x)
        assert torch.equal(d[:2], x[:2]) if codec.axis is None or codec.axis % 2 == 0 \
            else torch.equal(d[:, :2], x[:, :2])


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_positions(name, dtype):
    codec = _codec(name)
    x = torch.randn(6, 256)
    x[0, 3], x[1, 200], x[4, 17], x[4, 18] = float("nan"), float("inf"), float("-inf"), float("nan")
    x[5, 128:] = float("inf")  # a group with nothing finite
    x = x.to(dtype)
    d = codec.roundtrip(x)
    assert_nonfinite_kept_within_capacity(x, d)  # 132 of them: the whole group decodes to NaN
    fin = torch.isfinite(x)
    # groups holding a non-finite value lose one level: the step grows by at most 1.5x
    # (with one bit their finite values decode to the middle of the range)
    bound = _bound(codec, x) * 1.5
    err = (d.float() - x.float()).reshape(-1).abs()
    assert (err[fin.reshape(-1)] <= bound[fin.reshape(-1)]).all()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.complex64, torch.bool], ids=str)
def test_type_errors(dtype):
    x = torch.ones(8, dtype=dtype)
    with pytest.raises(TypeError, match="dtype"):
        IntQuant().encode(x)
    with pytest.raises(TypeError, match="dtype"):
        IntQuant().expected_error(x)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3), "bits"), (dict(bits=16), "bits"), (dict(bits=0), "bits"),
    (dict(bits=True), "bits"), (dict(bits=1, symmetric=True), "symmetric"),
    (dict(group_size=0), "group_size"), (dict(bits=4, group_size=3), "group_size"),
    (dict(bits=1, group_size=12), "group_size"), (dict(axis=1.5), "axis"),
])
def test_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IntQuant(**kwargs)


def test_axis_out_of_range():
    with pytest.raises(ValueError, match="axis"):
        IntQuant(axis=2).encode(torch.randn(4, 4))
    with pytest.raises(ValueError, match="axis"):
        IntQuant(axis=-1).encode(torch.tensor(1.0))


def _distributions():
    g = torch.Generator().manual_seed(5)
    normal = torch.randn(64, 2, 512, generator=g)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((64, 2, 512))
    outliers = torch.randn(64, 2, 512, generator=g)
    outliers[..., [3, 100, 257, 400]] *= 10.0  # a few outlier channels
    return {"normal": normal, "laplace": laplace, "outlier_channels": outliers}


# Not int2_sym_sr: with 3 levels and outlier channels most values sit near code 0, where the
# fractional part is far from uniform and Delta^2 / 6 over-predicts about 3x.
@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "int2_sym_sr"])
def test_error_model_within_2x(name):
    codec = _codec(name)
    for dist, x in _distributions().items():
        measured = (codec.roundtrip(x) - x).pow(2).mean().item()
        predicted = codec.expected_error(x)
        assert 0.5 <= measured / predicted <= 2.0, (dist, measured, predicted)


def test_registry_flags_and_names():
    for name in REGISTERED:
        codec = make_codec(name)
        assert codec.name == name and codec.lossless is False
        assert codec.stochastic == (name in ("int1", "int2", "int4", "int8"))
    ch = make_codec("int4_channel")
    assert (ch.bits, ch.symmetric, ch.axis) == (4, True, -1)
    assert make_codec("int4").group_size == 128


def test_channel_scales_are_per_chunk_of_256_rows():
    """int4_channel stores a scale per column per 256 rows (one-pass encode): a loud chunk
    keeps its own scale, the others' errors stay within half their own step, and the error
    model uses the same steps as the record."""
    codec = make_codec("int4_channel")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(600, 2, 32, generator=g)  # rows = 1200 (s * b), C = 32: 5 chunks
    x[128:256] *= 100.0  # rows 256..511 of the [1200, 32] view
    enc = codec.encode(x)
    scale = enc.data["scale"]
    assert scale.shape == (5, 32)
    assert (scale[1] > 20 * scale[0]).all() and (scale[1] > 20 * scale[2]).all()
    rows = x.view(1200, 32)
    amax = torch.stack([rows[i:i + 256].abs().amax(0) for i in range(0, 1200, 256)])
    torch.testing.assert_close(scale, amax / torch.full_like(amax, 7.0), rtol=0, atol=0)
    delta = codec.step_sizes(x).view(1200, 32).float()
    torch.testing.assert_close(delta, scale.repeat_interleave(256, dim=0)[:1200])
    err = (codec.decode(enc) - x).view(1200, 32).abs()
    assert (err <= delta / 2 * (1 + 1e-5)).all()  # nearest rounding, each chunk's own step
    assert (err[:256].amax() < scale[1].amin() / 2)  # a whole-column scale would fail this
    measured = float(((codec.decode(enc) - x) ** 2).mean())
    assert 0.5 <= measured / codec.expected_error(x) <= 2.0
