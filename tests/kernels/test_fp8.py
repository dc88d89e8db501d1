"""FP8 kernels vs the reference (interpreter on CPU); the bit arithmetic vs torch's casts;
the non-finite side list filled in the encode's own pass; the hardware casts of the GPU
path, checked in the sm_90 compile (no GPU here: its arithmetic is the float8 format's own
round-to-nearest-even, i.e. torch's cast of the clamped values, which the bit arithmetic
is tested against)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_act.kernels import fp8_ref as ref
from llm_act.kernels import nonfinite_ref
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


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaN payloads and signs compare exactly)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _with_nonfinite(n, dtype, where, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    kinds = [float("nan"), float("inf"), float("-inf")]
    for i, at in enumerate(where):
        x[at] = kinds[i % 3]
    if dtype == torch.float32:  # NaN payloads and a negative NaN: kept bit for bit
        _int_bits(x)[where[0]] = 0x7FC01234
        _int_bits(x)[where[3]] = -0x400000  # 0xFFC00000
    elif dtype == torch.bfloat16:
        _int_bits(x)[where[0]] = 0x7FC5
    return x


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [5, 11])  # within and past the capacity (6 slots)
def test_side_list_is_filled_in_the_encode_pass(fmt, dtype, count, grids):
    """The kernel records every non-finite value's position and exact bits (ascending, as
    the reference, under the interpreter), the count, the overflow past the capacity, and
    leaves the state ready for the next call; a single launch over several programs."""
    grids.watch(triton_fp8, "_fp8_encode_kernel")
    n = 20000
    where = torch.linspace(7, n - 1, count).long().tolist()
    x = _with_nonfinite(n, dtype, where)
    side = {}
    for who, encode in (("kernel", triton_fp8.fp8_encode), ("ref", ref.fp8_encode_ref)):
        state = nonfinite_ref.new_state("cpu")
        buffers = nonfinite_ref.empty_side_list(n, dtype, "cpu")
        assert buffers[0].numel() == 6
        out = encode(x, 128, fmt, state, *buffers)
        side[who] = (out, state, buffers)
    (bits, scale), state, (index, value, cnt) = side["kernel"]
    (rbits, rscale), rstate, (rindex, rvalue, rcnt) = side["ref"]
    assert grids.most("_fp8_encode_kernel") > 1 and len(grids.programs["_fp8_encode_kernel"]) == 1
    assert torch.equal(bits, rbits) and torch.equal(scale, rscale)
    assert cnt.tolist() == rcnt.tolist() == [count]
    used = min(count, 6)
    assert index.tolist()[:used] == rindex.tolist()[:used] == where[:used]
    assert torch.equal(_int_bits(value[:used]), _int_bits(rvalue[:used]))
    assert torch.equal(_int_bits(value[:used]), _int_bits(x[where[:used]]))
    over = nonfinite_ref.OVERFLOW
    assert int(state[over]) == int(rstate[over]) == count - used
    # the running count and the program counter are reset, the call counted
    assert state.tolist()[:3] == [1, 0, 0]
    # the main decode alone gives NaN at every non-finite input (never a finite value)
    y = triton_fp8.fp8_decode(bits, scale, 128, fmt, dtype)
    assert torch.isnan(y[where]).all() and torch.isfinite(y[torch.isfinite(x)]).all()
    nonfinite_ref.restore_nonfinite_ref(y, index, value, cnt)
    assert torch.equal(_int_bits(y[where[:used]]), _int_bits(x[where[:used]]))


def test_without_a_state_nothing_is_recorded():
    x = _with_nonfinite(3000, torch.float32, [1, 2, 3, 4])
    bits, scale = triton_fp8.fp8_encode(x, 128, "e4m3")
    assert torch.equal(bits, ref.fp8_encode_ref(x, 128, "e4m3")[0])
    assert (bits[[1, 2, 3, 4]] == ref.NAN_CODE).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy: to float16
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_decodes_as_the_format_says(fmt, dtype):
    """All 256 codes (scale 1): the kernel's value is the reference's (NaN, infinities and
    signed zeros exactly), every finite code torch's float8 value, every NaN code NaN (no
    code decodes a NaN to a finite value)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)  # 1024: several blocks
    f = ref.get_format(fmt)
    scale = torch.ones(ref.num_blocks(codes.numel(), 128))
    y = triton_fp8.fp8_decode(codes, scale, 128, fmt, dtype)
    want = ref.fp8_decode_ref(codes, scale, 128, fmt, dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    assert torch.equal(_int_bits(y[~nan]), _int_bits(want[~nan]))
    value = codes.view(f.torch_dtype).float()
    assert torch.equal(nan, torch.isnan(value)) and torch.isnan(y[codes == ref.NAN_CODE]).all()
    finite = torch.isfinite(value)
    assert torch.equal(y[finite], value[finite].to(dtype))


def test_hw_casts_only_off_the_interpreter(monkeypatch):
    """The launchers pick the bit arithmetic under the interpreter (these tests), the
    hardware casts otherwise."""
    import triton

    from llm_act.kernels import hardware_casts

    assert triton.knobs.runtime.interpret and not hardware_casts()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert hardware_casts()


_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels import fp8_triton as F
from llm_act.kernels.fp8_ref import get_format
out = {}
for fmt in ("e4m3", "e5m2"):
    f = get_format(fmt)
    for hw in (True, False):
        enc = dict(FMAX=f.fmax, MBITS=f.mbits, BIAS=f.bias, NAN_BITS=127, IS_E4M3=fmt == "e4m3",
                   BLOCK_P=128, GROUPS=8, HW=hw, SIDE=True)
        dec = dict(EBITS=f.ebits, MBITS=f.mbits, BIAS=f.bias, IS_E4M3=fmt == "e4m3",
                   BLOCK_P=128, GROUPS=8, HW=hw)
        for kernel, cons, ptrs in (
                (F._fp8_encode_kernel, enc, ["*bf16", "*u8", "*fp32", "*i64", "*i32", "*bf16",
                                             "*i32"]),
                (F._fp8_decode_kernel, dec, ["*u8", "*fp32", "*bf16"])):
            names = [a for a in kernel.arg_names if a not in cons]
            sig = {a: (ptrs[i] if i < len(ptrs) else "i32") for i, a in enumerate(names)}
            sig.update({a: "constexpr" for a in cons})
            c = triton.compile(ASTSource(kernel, sig, cons), target=GPUTarget("cuda", 90, 32),
                               options=EXACT_LAUNCH)
            cvts = sorted(set(re.findall(r"cvt\.\S+", c.asm["ptx"])))
            out[f"{kernel.__name__} {fmt} {hw}"] = cvts
json.dump(out, sys.stdout)
"""


def test_gpu_path_compiles_to_hardware_conversions():
    """sm_90 PTX of the GPU path (HW=True) converts with `cvt.rn.satfinite.e4m3x2.f32` /
    `e5m2x2` (round to nearest even, saturating: torch's cast of the clamped values) and
    `cvt.rn.f16x2.e4m3x2` / `e5m2x2` back; the interpreter's bit path (HW=False) has none."""
    import json

    pytest.importorskip("triton.backends.nvidia.compiler")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _SM90], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    cvts = json.loads(proc.stdout)
    for fmt in FMTS:
        enc = cvts[f"_fp8_encode_kernel {fmt} True"]
        dec = cvts[f"_fp8_decode_kernel {fmt} True"]
        assert f"cvt.rn.satfinite.{fmt}x2.f32" in enc, enc
        assert f"cvt.rn.f16x2.{fmt}x2" in dec and "cvt.rn.bf16.f32" in dec, dec
        for kernel in ("_fp8_encode_kernel", "_fp8_decode_kernel"):
            found = cvts[f"{kernel} {fmt} False"]
            assert not [c for c in found if re.search(r"e[45]m[23]", c)], found
