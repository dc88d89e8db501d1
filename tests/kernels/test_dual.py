"""Dual-precision kernels vs the reference (interpreter on CPU)."""
import math

import pytest
import torch

from llm_act.kernels import dual_ref as ref
from tests.kernels._values import assert_same_side_list, side_lists, tiny_values

triton_dual = pytest.importorskip("llm_act.kernels.dual_triton")


def _input(s, C, dtype, nonfinite=True):
    x = (torch.randn(s, C) * torch.linspace(0.1, 4, C)).to(dtype)
    if nonfinite and s * C > 10:
        x[3 % s, 2 % C], x[(s - 1), C - 1], x[0, 1 % C] = float("nan"), float("inf"), float("-inf")
    return x


def _check(x, pool, bits):
    s, C = x.shape
    u = torch.rand(s, C)
    got = triton_dual.dual_encode(x, pool, bits, noise=u)
    want = ref.dual_encode_ref(x, pool, bits, u)
    for name, a, b in zip(("lfc", "codes", "zero", "step"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    y = triton_dual.dual_decode(*want, pool, bits, s, C, x.dtype)
    ry = ref.dual_decode_ref(*want, pool, bits, s, C, x.dtype)
    assert torch.equal(torch.isnan(y), torch.isnan(ry))
    assert torch.equal(y.nan_to_num(0.0), ry.nan_to_num(0.0))
    assert torch.equal(torch.isnan(y), ~torch.isfinite(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,C,pool", [(1, 1, 8), (13, 5, 3), (127, 3, 8), (30, 130, 8)])
def test_kernels_match_reference(dtype, s, C, pool):
    _check(_input(s, C, dtype), pool, 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_other_bit_widths(bits):
    _check(_input(20, 70, torch.float32), 6, bits)


def test_constant_channels():
    x = torch.full((40, 70), 0.3)  # 70 channels, 40 tokens: several encode/decode programs
    x[:, 2] = 1.0
    _check(x, 4, 2)


def test_large_inputs_launch_several_programs(grids):
    """Programs along token chunks and channel blocks in both kernels (one launch each)."""
    grids.watch(triton_dual, "_dual_encode_kernel", "_dual_decode_kernel")
    _check(_input(600, 40, torch.float32), 8, 2)  # 3 chunks of 256 tokens x 3 x 16 channels
    assert len(grids.programs) == 2
    for k in ("_dual_encode_kernel", "_dual_decode_kernel"):
        assert grids.grids[k] == [(3, 3)], grids.grids
    assert all(grids.exact(k) for k in grids.programs), grids.fusion  # no FMA contraction


@pytest.mark.parametrize("s,C,pool", [(600, 24, 8), (500, 10, 3)])
def test_chunks_have_their_own_zero_and_step(s, C, pool):
    """zero/step per channel and chunk (256 tokens at pool 8; 64 blocks of 3 = 192 tokens
    at pool 3): a loud chunk does not widen the others' steps; bit for bit."""
    x = _input(s, C, torch.float32)
    per = ref.chunk_blocks(pool) * pool
    x[per:2 * per] *= 100  # the second chunk only
    _check(x, pool, 2)
    lfc, codes, zero, step = triton_dual.dual_encode(x, pool, 2, seed=3)
    K = -(-s // per)
    assert zero.shape == step.shape == (K, C) and K == ref.num_chunks(s, pool) == 3
    mag = step.float().abs()
    assert (mag[1] > 20 * mag[0]).all() and (mag[1] > 20 * mag[2]).all()
    y = triton_dual.dual_decode(lfc, codes, zero, step, pool, 2, s, C, torch.float32)
    fin = torch.isfinite(x)
    err = (y - x).abs()
    # stochastic rounding: within one step of its own chunk (the stored step of h / 4)
    own = (mag / ref.H_SCALE)[ref.token_chunk(s, pool)]
    assert (err[fin] <= own[fin] * (1 + 1e-5) + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_side_list_is_filled_in_the_encode_pass(dtype, grids):
    """With a state, the kernel's side list is the reference's (in the one launch)."""
    grids.watch(triton_dual, "_dual_encode_kernel")
    x = _input(300, 40, dtype)  # 3 non-finite values, 2 x 3 programs
    x[290, 33] = float("nan")
    found = side_lists((triton_dual.dual_encode, ref.dual_encode_ref), x, 8, 2, seed=3)
    assert grids.most("_dual_encode_kernel") == 6
    assert_same_side_list(found, 4)


def test_pool_sum_adds_tokens_in_order():
    """The reference's block sum is sequential (the kernel's order), not torch's sum."""
    xp = torch.tensor([[[1.0], [2.0 ** -24], [2.0 ** -24], [-1.0]]])
    assert ref.pool_sum(xp, 1.0).item() == 0.0  # ((1 + e) + e) - 1 with e below half an ulp
    assert ref.pool_sum(xp.flip(1), 1.0).item() == 2.0 ** -23  # ((-1 + e) + e) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_values_match_reference_and_stay_finite(dtype):
    """Token means, residuals and ranges near the float32 max do not overflow: bit for bit
    with the reference, finite where the input is."""
    big = torch.finfo(dtype).max
    x = _input(40, 70, torch.float32)
    x[::3, ::2] = big
    x[1::3, ::2] = -big
    x[:, 5] = big  # a constant channel at the maximum
    x[:8, 7] = -big  # one pool block at -max, the rest normal
    x[:, 9] = tiny_values(40, dtype)
    x = x.to(dtype)
    _check(x, 8, 2)
    u = torch.rand(x.shape)
    y = ref.dual_decode_ref(*ref.dual_encode_ref(x, 8, 2, u), 8, 2, 40, 70, dtype)
    assert torch.isfinite(y[torch.isfinite(x)]).all()
    assert (y[:, 5].float() > 0.5 * big).all()


def test_in_kernel_noise_is_unbiased():
    s, C, pool, bits = 16, 80, 8, 2  # 80 channels: two programs
    x = _input(s, C, torch.float32, nonfinite=False)
    n = 24
    acc = torch.zeros(s, C)
    for i in range(n):
        enc = triton_dual.dual_encode(x, pool, bits, seed=1000 + 17 * i)
        acc += triton_dual.dual_decode(*enc, pool, bits, s, C, torch.float32)
    step = enc[3].float().abs() / ref.H_SCALE  # stored: the step of h * H_SCALE
    # std of the mean <= step / (2 sqrt(n)); 5 sigma per element
    assert ((acc / n - x).abs() <= 5 * step / (2 * math.sqrt(n)) + 1e-6).all()
    # and the same LFC / scales as the reference (only the noise differs)
    want = ref.dual_encode_ref(x, pool, bits, torch.rand(s, C))
    for i in (0, 2, 3):
        assert torch.equal(enc[i], want[i])


def test_needs_exactly_one_noise_source():
    with pytest.raises(ValueError, match="noise"):
        triton_dual.dual_encode(torch.randn(4, 4), 2, 2)
