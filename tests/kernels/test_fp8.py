"""FP8 kernels vs the reference (interpreter on CPU); the bit arithmetic vs torch's casts."""
import pytest
import torch

from llm_act.kernels import fp8_ref as ref
from tests.kernels._values import tiny_values

triton_fp8 = pytest.importorskip("llm_act.kernels.fp8_triton")

FMTS = ["e4m3", "e5m2"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _edge_values(fmt: str) -> torch.Tensor:
    """Every finite float8 value, every midpoint (ties), their neighbours, subnormals."""
    f = ref.get_format(fmt)
    vals = torch.arange(256, dtype=torch.uint8).view(f.torch_dtype).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    tiny = torch.linspace(-1, 1, 401) * 2.0 ** (f.min_exp - f.mbits) * 1.5
    y = torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), tiny])
    return y.clamp(-f.fmax, f.fmax)


@pytest.mark.parametrize("fmt", FMTS)
def test_bit_arithmetic_matches_torch_casts(fmt):
    f = ref.get_format(fmt)
    y = _edge_values(fmt)
    assert torch.equal(ref.fp8_bits_ref(y, fmt), y.to(f.torch_dtype).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8)
    a, b = codes.view(f.torch_dtype).float(), ref.fp8_value_ref(codes, fmt)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_rounds_ties_and_subnormals_like_torch(fmt):
    y = _edge_values(fmt)
    # blocks each holding FMAX keep scale 1, so the kernel converts y itself; 64 blocks
    # of 16 span several programs
    x = torch.cat([y, torch.tensor([ref.get_format(fmt).fmax])])
    x = torch.cat([x, x.new_full(((-x.numel()) % 15,), 0.0)]).view(-1, 15)
    x = torch.cat([x, x.new_full((x.shape[0], 1), ref.get_format(fmt).fmax)], 1).reshape(-1)
    bits, scale = triton_fp8.fp8_encode(x, 16, fmt)
    assert (scale == 1.0).all() and scale.numel() > triton_fp8.GROUPS
    assert torch.equal(bits, ref.fp8_encode_ref(x, 16, fmt)[0])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", [((1,), 128), ((127,), 128), ((1000,), 100),
                                         ((3, 5, 130), 128), ((2, 33), 7)])
def test_kernels_match_reference(fmt, dtype, shape, block):
    x = (torch.randn(shape) * torch.logspace(-4, 3, shape[-1])).to(dtype)
    flat = x.view(-1)
    if flat.numel() > 10:
        flat[3], flat[-1], flat[5] = float("nan"), float("inf"), float("-inf")
    bits, scale = triton_fp8.fp8_encode(x, block, fmt)
    rbits, rscale = ref.fp8_encode_ref(x, block, fmt)
    assert torch.equal(bits, rbits) and torch.equal(scale, rscale)
    y = triton_fp8.fp8_decode(bits, scale, block, fmt, dtype)
    ry = ref.fp8_decode_ref(rbits, rscale, block, fmt, dtype)
    assert y.dtype == dtype
    assert torch.equal(torch.isnan(y), torch.isnan(ry))
    assert torch.equal(y.nan_to_num(0.0), ry.nan_to_num(0.0))


def test_large_inputs_launch_several_programs(grids):
    grids.watch(triton_fp8, "_fp8_encode_kernel", "_fp8_decode_kernel")
    bits, scale = triton_fp8.fp8_encode(torch.randn(3, 5, 130), 128, "e4m3")
    triton_fp8.fp8_decode(bits, scale, 128, "e4m3", torch.float32)
    assert grids.most("_fp8_encode_kernel") > 1 and grids.most("_fp8_decode_kernel") > 1
    assert all(grids.exact(k) for k in grids.programs), grids.fusion  # no FMA contraction


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values_match_reference_and_stay_finite(fmt, dtype):
    """Blocks whose amax is the dtype's max: FMAX * scale may round past it; decode
    clamps, bit for bit with the reference."""
    f = torch.finfo(dtype)
    x = torch.randn(3000)
    x[::7], x[3::11], x[:128] = f.max, -f.max, -f.max
    x[128:256] = tiny_values(128, dtype)
    x[5::13] = float("nan")
    x[6::17] = float("inf")
    x = x.to(dtype)
    bits, scale = triton_fp8.fp8_encode(x, 128, fmt)
    rbits, rscale = ref.fp8_encode_ref(x, 128, fmt)
    assert torch.equal(bits, rbits) and torch.equal(scale, rscale)
    y = triton_fp8.fp8_decode(bits, scale, 128, fmt, dtype)
    ry = ref.fp8_decode_ref(rbits, rscale, 128, fmt, dtype)
    assert torch.equal(torch.isnan(y), torch.isnan(ry))
    assert torch.equal(y.nan_to_num(0.0), ry.nan_to_num(0.0))
    assert torch.isfinite(ry[torch.isfinite(x)]).all()
    first = torch.isfinite(x[:128])
    assert (ry[:128][first] == -f.max).all()  # a block at -max decodes to -max exactly


def test_empty():
    bits, scale = triton_fp8.fp8_encode(torch.empty(0), 128, "e4m3")
    assert bits.numel() == scale.numel() == 0
    assert triton_fp8.fp8_decode(bits, scale, 128, "e4m3", torch.float16).numel() == 0
