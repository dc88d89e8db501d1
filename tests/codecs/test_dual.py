"""DualPrecision (DIVISION along tokens): size, LFC, error model, unbiasedness, odd inputs."""
import math

import pytest
import torch

from llm_act.codecs import DualPrecision, make_codec
from llm_act.codecs.base import side_list_nbytes
from llm_act.kernels import dual_ref
from tests.codecs._checks import assert_nonfinite_kept


def _dists(shape=(64, 2, 128)):
    g = torch.Generator().manual_seed(2)
    normal = torch.randn(shape, generator=g)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample(shape)
    outliers = torch.randn(shape, generator=g) * torch.where(
        torch.rand(shape[-1], generator=g) < 0.03, 40.0, 1.0)
    return {"normal": normal, "laplace": laplace, "outlier_channels": outliers}


def _smooth(shape=(256, 2, 512)):
    g = torch.Generator().manual_seed(3)
    t = torch.linspace(0, 2 * math.pi, shape[0])[:, None, None]
    freq = torch.rand(shape[1:], generator=g) * 3
    amp = torch.randn(shape[1:], generator=g) * 2
    return amp * torch.sin(freq * t + 6 * torch.rand(shape[1:], generator=g)) \
        + 0.05 * torch.randn(shape, generator=g)


def test_bad_arguments():
    for kw in ({"pool": 0}, {"hfc_bits": 3}, {"hfc_bits": 1}, {"dim": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            DualPrecision(**kw)
    with pytest.raises(ValueError, match="dim"):
        DualPrecision(dim=3).encode(torch.randn(4, 4))


@pytest.mark.parametrize("shape,dim", [((1,), 0), ((13, 3, 10), 0), ((256, 2, 512), 0),
                                       ((600, 3, 4), 0), ((5, 17, 6), 1), ((4, 6, 19), -1),
                                       ((3, 300, 2), 1)])
@pytest.mark.parametrize("bits", [2, 4])
def test_nbytes_exact(shape, dim, bits):
    c = DualPrecision(hfc_bits=bits, dim=dim)
    x = torch.randn(shape)
    enc = c.encode(x)
    s = shape[dim]
    C = math.prod(shape) // s
    # zero and step (bf16) per channel per chunk of 256 tokens (32 pool blocks of 8)
    formula = (2 * math.ceil(s / 8) * C + s * math.ceil(C * bits / 8)
               + 4 * C * math.ceil(s / 256) + side_list_nbytes(x.numel(), x.dtype))
    assert enc.nbytes == c.nbytes_for(shape, x.dtype) == formula
    assert c.decode(enc).shape == x.shape


def test_lfc_is_the_token_pool_mean_with_a_partial_last_block():
    x = torch.randn(13, 2, 6)  # 13 tokens: blocks of 8 and 5
    enc = DualPrecision().encode(x)
    lfc = enc.data["lfc"].float().view(2, 2, 6)
    torch.testing.assert_close(lfc[0], x[:8].mean(0).bfloat16().float())
    torch.testing.assert_close(lfc[1], x[8:].mean(0).bfloat16().float())


@pytest.mark.parametrize("dist", ["normal", "laplace", "outlier_channels"])
def test_expected_error_within_2x(dist):
    x = _dists()[dist]
    c = DualPrecision()
    measured = float(((c.roundtrip(x) - x).double() ** 2).mean())
    predicted = c.expected_error(x)
    assert measured / 2 <= predicted <= 2 * measured


def test_smooth_tensors_compress_far_better():
    c = DualPrecision()
    smooth, rough = _smooth((128, 2, 64)), torch.randn(128, 2, 64)
    rel = [float(((c.roundtrip(x) - x) ** 2).mean() / (x**2).mean()) for x in (smooth, rough)]
    assert rel[0] < rel[1] / 20
    pred = [c.expected_error(x) / float((x**2).mean()) for x in (smooth, rough)]
    assert pred[0] < pred[1] / 20


def test_unbiased_given_the_lfc():
    c = DualPrecision(seed=5)
    x = torch.randn(24, 3, 10) * torch.linspace(0.1, 3, 10)
    n = 400
    mean = sum(c.roundtrip(x) for _ in range(n)) / n
    # the stored step is that of the residual * H_SCALE (so ranges near 2 max fit); 24
    # tokens: one chunk
    step = c.encode(x).data["step"].float().abs().view(3, 10) / dual_ref.H_SCALE
    # per-element std of the mean <= step / (2 sqrt(n)); allow 5 sigma
    assert ((mean - x).abs() <= 5 * step / (2 * math.sqrt(n)) + 1e-6).all()


def test_own_generator_global_rng_untouched_and_reproducible():
    x = torch.randn(40, 2, 16)
    state = torch.get_rng_state()
    a = make_codec("dual2", seed=9)
    ya = a.roundtrip(x)
    assert torch.equal(torch.get_rng_state(), state)
    b = make_codec("dual2", seed=9)
    assert torch.equal(b.roundtrip(x), ya)
    assert not torch.equal(a.roundtrip(x), ya)  # the codec's stream advanced


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_positions_and_dtypes(dtype):
    x = torch.randn(19, 2, 12).to(dtype)
    bad = torch.zeros_like(x, dtype=torch.bool)
    for idx, v in (((0, 0, 0), float("nan")), ((5, 1, 3), float("inf")),
                   ((18, 1, 11), float("-inf")), ((6, 1, 3), float("nan"))):
        x[idx] = v
        bad[idx] = True
    y = DualPrecision().roundtrip(x)
    assert_nonfinite_kept(x, y)  # 4 non-finite values: within the side list's 4 slots
    # a flagged channel keeps its other values close (non-finite values stay out of the LFC)
    assert (y[:, 1, 3][~bad[:, 1, 3]].float() - x[:, 1, 3][~bad[:, 1, 3]].float()).abs().max() < 3


def test_fp16_near_its_max_stays_finite():
    x = torch.full((16, 4), 60000.0, dtype=torch.float16)
    x[::3] = -65504.0
    y = DualPrecision(hfc_bits=2).roundtrip(x)
    assert torch.isfinite(y).all()


def test_constant_noncontiguous_empty_and_types():
    c = DualPrecision()
    const = torch.full((20, 3), 0.75)
    assert torch.equal(c.roundtrip(const), const)
    x = torch.randn(32, 24)
    c1, c2 = DualPrecision(seed=4), DualPrecision(seed=4)
    assert torch.equal(c1.roundtrip(x.t()), c2.roundtrip(x.t().contiguous()))
    e = c.encode(torch.empty(0, 2, 8))
    assert e.nbytes == 0 == c.nbytes_for((0, 2, 8), torch.float32)
    assert c.decode(e).shape == (0, 2, 8)
    for bad in (torch.ones(8, 2, dtype=torch.int32), torch.ones(8, 2, dtype=torch.complex64)):
        with pytest.raises(TypeError):
            c.encode(bad)


def test_zero_and_step_are_per_chunk_of_256_tokens():
    """One-pass encode: zero/step per channel per 256 tokens. A loud chunk keeps its own
    step, the quiet chunks' errors stay within their own (much smaller) steps, and the
    error model uses the chunks' steps."""
    c = DualPrecision(seed=6)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(700, 2, 8, generator=g)  # 3 chunks of 256 tokens
    x[256:512] *= 50.0
    enc = c.encode(x)
    step = enc.data["step"].float().abs() / dual_ref.H_SCALE  # [3, 16]
    assert enc.data["zero"].shape == enc.data["step"].shape == (3, 16)
    assert (step[1] > 20 * step[0]).all() and (step[1] > 20 * step[2]).all()
    err = (c.decode(enc) - x).abs().view(700, 16)
    own = step[torch.arange(700) // 256]
    assert (err <= own * (1 + 1e-5) + 1e-6).all()  # stochastic: within one step of its own
    assert err[:256].max() < step[1].min() / 4  # a whole-tensor step would not be
    measured = float(((c.decode(c.encode(x)) - x).double() ** 2).mean())
    assert 0.5 <= measured / c.expected_error(x) <= 2.0
