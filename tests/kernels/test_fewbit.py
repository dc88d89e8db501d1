"""Few-bit code kernels: Triton (interpreter on CPU) against the torch reference, bit for bit."""
import math

import pytest
import torch

from llm_act.kernels.fewbit_ref import (
    GROUP,
    code_bytes,
    fewbit_decode_ref,
    fewbit_encode_ref,
    flag_bytes,
    pack_codes,
    unpack_codes,
)
from llm_act.kernels.packing_ref import pack_bits
from tests.kernels._values import tiny_values

fewbit_triton = pytest.importorskip("llm_act.kernels.fewbit_triton")

SHAPES = [(1,), (127,), (1000,), (3, 5, 130), (2053,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _table(bits, symmetric, gen):
    """A synthetic sorted cut table (float32) and random levels."""
    cuts = torch.randn(2**bits - 1, generator=gen) * 3
    if symmetric:
        cuts = cuts.abs()
    cuts = torch.unique(cuts)  # sorted, distinct
    while cuts.numel() < 2**bits - 1:  # (never in practice) keep 2**bits - 1 entries
        cuts = torch.unique(torch.cat([cuts, cuts[-1:] + 1]))
    return cuts, torch.randn(2**bits, generator=gen)


def _input(shape, dtype, gen, cuts=None, non_finite=True):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    flat = x.view(-1)
    if cuts is not None and flat.numel() > 2 * cuts.numel() + 20:
        k = cuts.numel()  # exact cut values (and their negatives) test the (s_k, s_{k+1}] rule
        flat[10:10 + k], flat[10 + k:10 + 2 * k] = cuts.to(dtype), -cuts.to(dtype)
    if non_finite and flat.numel() > 10:
        flat[3], flat[-1] = math.nan, math.inf
        flat[flat.numel() // 2] = -math.inf
    return x


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_codes_round_trips_and_matches_pack_bits(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 9, 1001):
        codes = torch.randint(0, 2**bits, (n,), generator=gen)
        packed = pack_codes(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == code_bytes(n, bits)
        assert torch.equal(unpack_codes(packed, bits, n), codes)
        if bits in (1, 2, 4, 8):
            assert torch.equal(packed, pack_bits(codes, bits))


def test_three_bit_codes_are_packed_tightly():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    packed = pack_codes(codes, 3)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert packed.tolist() == [word & 255, (word >> 8) & 255, word >> 16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "bits,symmetric", [(1, False), (2, True), (3, False), (3, True), (4, False)])
def test_encode_and_decode_match_the_reference(shape, dtype, bits, symmetric):
    gen = torch.Generator().manual_seed(7)
    cuts, levels = _table(bits, symmetric, gen)
    x = _input(shape, dtype, gen, cuts)
    codes_ref, flags_ref = fewbit_encode_ref(x, cuts, bits, symmetric)
    codes, flags = fewbit_triton.fewbit_encode(x, cuts, bits, symmetric)
    assert codes.dtype == torch.uint8 and flags.dtype == torch.uint8
    assert torch.equal(codes, codes_ref)
    assert torch.equal(flags, flags_ref)
    n = x.numel()
    out_ref = fewbit_decode_ref(codes_ref, flags_ref, levels, bits, n, dtype)
    out = fewbit_triton.fewbit_decode(codes_ref, flags_ref, levels, bits, n, dtype)
    assert out.dtype == dtype and out.shape == (n,)
    assert torch.equal(torch.isnan(out), ~torch.isfinite(x.reshape(-1)))
    assert torch.equal(out.nan_to_num(123.0), out_ref.nan_to_num(123.0))


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_wide_codes_match_the_reference(bits):
    gen = torch.Generator().manual_seed(bits)
    cuts, levels = _table(bits, False, gen)
    x = _input((1500,), torch.float32, gen, cuts[:100])
    codes_ref, flags_ref = fewbit_encode_ref(x, cuts, bits, False)
    codes, flags = fewbit_triton.fewbit_encode(x, cuts, bits, False)
    assert torch.equal(codes, codes_ref) and torch.equal(flags, flags_ref)
    out = fewbit_triton.fewbit_decode(codes, flags, levels, bits, x.numel(), torch.float32)
    out_ref = fewbit_decode_ref(codes, flags, levels, bits, x.numel(), torch.float32)
    assert torch.equal(out.nan_to_num(123.0), out_ref.nan_to_num(123.0))


def test_reference_codes_are_the_bucket_of_x():
    gen = torch.Generator().manual_seed(3)
    cuts, _ = _table(3, False, gen)
    x = torch.cat([torch.randn(500, generator=gen) * 4, cuts])
    codes = unpack_codes(fewbit_encode_ref(x, cuts, 3, False)[0], 3, x.numel())
    want = (x[:, None] > cuts[None, :]).sum(1)  # intervals (s_k, s_{k+1}]
    assert torch.equal(codes, want)
    sym = unpack_codes(fewbit_encode_ref(-x, cuts.abs().sort().values, 3, True)[0], 3, x.numel())
    assert torch.equal(sym, (x.abs()[:, None] > cuts.abs().sort().values[None, :]).sum(1))


def test_flag_layout_and_sizes():
    n = 128 * 19 + 5
    x = torch.zeros(n)
    x[128 * 9 + 4] = math.nan  # group 9 -> byte 1, bit 1
    x[-1] = math.inf  # group 19 -> byte 2, bit 3
    cuts = torch.tensor([0.0])
    for enc in (fewbit_encode_ref, fewbit_triton.fewbit_encode):
        codes, flags = enc(x, cuts, 1, False)
        assert codes.numel() == code_bytes(n, 1) and flags.numel() == flag_bytes(n) == 3
        assert flags.tolist() == [0, 2, 8]


def test_large_inputs_launch_several_programs(grids):
    """SHAPES' largest input reaches past one program in both kernels."""
    grids.watch(fewbit_triton, "_fewbit_encode_kernel", "_fewbit_decode_kernel")
    cuts, levels = _table(3, False, torch.Generator().manual_seed(0))
    n = max(math.prod(s) for s in SHAPES)
    codes, flags = fewbit_triton.fewbit_encode(torch.randn(n), cuts, 3, False)
    fewbit_triton.fewbit_decode(codes, flags, levels, 3, n, torch.float32)
    assert grids.most("_fewbit_encode_kernel") > 1 and grids.most("_fewbit_decode_kernel") > 1
    assert all(grids.exact(k) for k in grids.programs), grids.fusion  # no FMA contraction


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values_match_the_reference(dtype):
    """Values at the dtype's max and subnormals get finite derivatives, non-finite ones
    NaN, bit for bit with the reference."""
    gen = torch.Generator().manual_seed(9)
    cuts, levels = _table(3, True, gen)
    f = torch.finfo(dtype)
    x = torch.randn(2053, generator=gen)
    x[::7], x[3::11] = f.max, -f.max
    x[5::13] = tiny_values(x[5::13].numel(), dtype)
    x[1::19], x[2::23], x[4::29] = math.inf, -math.inf, math.nan
    x = x.to(dtype)
    codes, flags = fewbit_triton.fewbit_encode(x, cuts, 3, True)
    codes_ref, flags_ref = fewbit_encode_ref(x, cuts, 3, True)
    assert torch.equal(codes, codes_ref) and torch.equal(flags, flags_ref)
    out = fewbit_triton.fewbit_decode(codes, flags, levels, 3, x.numel(), dtype)
    out_ref = fewbit_decode_ref(codes, flags, levels, 3, x.numel(), dtype)
    assert torch.equal(out.nan_to_num(123.0), out_ref.nan_to_num(123.0))
    assert torch.equal(torch.isnan(out), ~torch.isfinite(x))


def test_empty():
    cuts, levels = _table(2, False, torch.Generator().manual_seed(0))
    codes, flags = fewbit_triton.fewbit_encode(torch.empty(0), cuts, 2, False)
    assert codes.numel() == 0 and flags.numel() == 0
    out = fewbit_triton.fewbit_decode(codes, flags, levels, 2, 0, torch.bfloat16)
    assert out.shape == (0,) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bits", range(1, 9))
def test_each_stored_byte_and_element_is_read_once(bits):
    """Encode reads each element once and decode each stored byte once (bytes of a word
    loaded as one vector, codes shifted apart); the tables cost a few loads per program,
    not one per element (scalars up to SCAN_BITS, a gathered vector above)."""
    from tests.kernels.traffic import measure

    gen = torch.Generator().manual_seed(bits)
    cuts, levels = _table(bits, False, gen)
    n = 5 * 1024 + 77  # six programs, the last one partial
    x = _input((n,), torch.bfloat16, gen, cuts[:50])
    (codes, flags), enc = measure(lambda: fewbit_triton.fewbit_encode(x, cuts, bits, False))
    out, dec = measure(lambda: fewbit_triton.fewbit_decode(codes, flags, levels, bits, n,
                                                           torch.bfloat16))
    programs = -(-n // (GROUP * fewbit_triton.GROUPS))
    for t in (enc, dec):
        assert len(t.launches) == 1 and not t.ops and not t.syncs, (t.launches, t.ops)
    table = 4 * 2**bits * programs  # at most the whole float32 table once per program
    assert 2 * n <= enc.lane_read <= 2 * n + table
    assert dec.kernel_read == code_bytes(n, bits) + flag_bytes(n) + 4 * 2**bits
    assert dec.lane_read <= code_bytes(n, bits) + programs + table
    assert torch.equal(out.nan_to_num(9.0), fewbit_decode_ref(codes, flags, levels, bits, n,
                                                              torch.bfloat16).nan_to_num(9.0))
