"""One sm_90 compile configuration per Triton kernel, for `test_sm90_compile`.

Each entry is what a launcher passes at a typical shape (bf16 [4096, 2048] input, the
registry's default codec settings; checked against real launches under the interpreter):
`args` maps every runtime argument to a pointer type ("*bf16") or an example value (an int
specialises as the launcher's would: i32/i64, divisible by 16 or not, 1 -> constexpr),
`constexprs` the constexpr arguments. `stream` names the kernel's main stream: the input
load of an encode kernel, the output store of a decode kernel ("ld x_ptr", "st out_ptr").
A kernel without an entry fails the test: a new kernel cannot be left unchecked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROWS, C = 4096, 2048
N = ROWS * C
GROUPS_128 = N // 128
SEED = 1234  # the Philox seed a codec passes: its own seed (the registry default)
#: the non-finite side list (`nonfinite_triton`) of a bf16 x: state, slots, count, capacity
SIDE = {"state_ptr": "*i64", "nf_index_ptr": "*i32", "nf_value_ptr": "*bf16",
        "nf_count_ptr": "*i32"}
CAP = 4 + N // 8192


@dataclass(frozen=True)
class Config:
    args: dict
    constexprs: dict
    stream: str
    options: dict = field(default_factory=dict)  # launch options beyond EXACT_LAUNCH


def _int_quant(bits: int, sym: bool, noise: int) -> dict:
    return dict(GS=128, BLOCK_G=128, GPP=32, BITS=bits, SYM=sym, NOISE=noise, SIDE=True)


CONFIGS: dict[str, Config] = {
    # ---- bitmask (dropout masks arrive as 0/1 bf16) ----
    "bitmask_triton._pack_mask_kernel": Config(
        {"x_ptr": "*bf16", "out_ptr": "*u8", "n": N, "nbytes": N // 8},
        {"BLOCK": 512}, "ld x_ptr"),
    "bitmask_triton._unpack_mask_kernel": Config(
        {"packed_ptr": "*u8", "out_ptr": "*bf16", "n": N, "nbytes": N // 8},
        {"BLOCK": 512}, "st out_ptr"),
    # ---- int_quant (int4: asymmetric, Philox rounding; int4_channel: symmetric, nearest) ----
    "int_quant_triton._encode_groups_kernel": Config(
        {"x_ptr": "*bf16", "noise_ptr": "*bf16", "seed": SEED, "out_ptr": "*u8",
         "scale_ptr": "*fp32", "zero_ptr": "*fp32", **SIDE, "n": N, "n_groups": GROUPS_128,
         "n_bytes": N // 2, "cap": CAP},
        _int_quant(4, False, 2), "ld x_ptr"),
    "int_quant_triton._decode_groups_kernel": Config(
        {"packed_ptr": "*u8", "scale_ptr": "*fp32", "zero_ptr": "*fp32", "out_ptr": "*i16",
         "n": N, "n_groups": GROUPS_128, "n_bytes": N // 2},
        dict(GS=128, BLOCK_G=128, GPP=32, BITS=4, SYM=False, BF16_BITS=True), "st out_ptr"),
    "int_quant_triton._encode_axis_kernel": Config(  # tiles of [AXIS_CHUNK rows, 16 columns]
        {"x_ptr": "*bf16", "noise_ptr": "*bf16", "seed": 0, "out_ptr": "*u8",
         "scale_ptr": "*fp32", "zero_ptr": "*fp32", **SIDE, "rows": ROWS, "C": C,
         "stride_r": 3 * C, "RB": C // 2, "cap": CAP},  # a strided view (attn.v)
        dict(BLOCK_R=256, BLOCK_C=16, BITS=4, SYM=True, NOISE=0, SIDE=True), "ld x_ptr",
        {"num_warps": 8}),
    "int_quant_triton._decode_axis_kernel": Config(
        {"packed_ptr": "*u8", "scale_ptr": "*fp32", "zero_ptr": "*fp32", "out_ptr": "*i16",
         "rows": ROWS, "C": C, "RB": C // 2},
        dict(BLOCK_R=256, BLOCK_C=16, BITS=4, SYM=True, BF16_BITS=True), "st out_ptr"),
    # ---- outlier_int4 (32 outlier slots = C / 64) ----
    "outlier_triton._encode_kernel": Config(  # tiles of [8 rows, 512 channels], 8 slots
        {"x_ptr": "*bf16", "noise_ptr": "*bf16", "seed": SEED, "packed_ptr": "*u8",
         "scale_ptr": "*fp32", "zero_ptr": "*fp32", "val_ptr": "*i16", "index_ptr": "*i16",
         **SIDE, "rows": ROWS, "C": C, "TC": 512, "RB": C // 2, "G": C // 128,
         "S": 32, "z_threshold": 3.0, "cap": CAP},
        dict(K=8, NOISE=2, SIDE=True, GS=128, GS_P=128, NG_P=4, CR=8), "ld x_ptr",
        {"num_warps": 8}),
    "outlier_triton._decode_kernel": Config(
        {"packed_ptr": "*u8", "scale_ptr": "*fp32", "zero_ptr": "*fp32", "val_ptr": "*i16",
         "index_ptr": "*i16", "out_ptr": "*i16", "rows": ROWS, "C": C, "TC": 512,
         "RB": C // 2, "G": C // 128, "S": 32},
        dict(K=8, KIND=0, GS=128, GS_P=128, NG_P=4, CR=8), "st out_ptr"),
    # ---- dual2 (pool 8, 2-bit residual, Philox rounding) ----
    "dual_triton._dual_encode_kernel": Config(  # tiles of [32 pool blocks x 8, 16 channels]
        {"x_ptr": "*bf16", "noise_ptr": "*bf16", "seed": SEED, "lfc_ptr": "*i16",
         "codes_ptr": "*u8", "zero_ptr": "*i16", "step_ptr": "*i16", **SIDE, "s": ROWS,
         "C": C, "pool": 8, "nb": ROWS // 8, "RB": C // 4, "cap": CAP},
        dict(BITS=2, BLOCKS=32, POOL_P=8, BLOCK_C=16, NOISE=2, SIDE=True), "ld x_ptr",
        {"num_warps": 8}),
    "dual_triton._dual_decode_kernel": Config(
        {"lfc_ptr": "*i16", "codes_ptr": "*u8", "zero_ptr": "*i16", "step_ptr": "*i16",
         "out_ptr": "*i16", "s": ROWS, "C": C, "pool": 8, "nb": ROWS // 8, "RB": C // 4,
         "big": 3.3895313892515355e38},
        dict(BITS=2, BLOCKS=32, POOL_P=8, BLOCK_C=16, OUT_BF16=True), "st out_ptr"),
    # ---- fp8 (e4m3, block 128; HW: a GPU's own float8 casts) ----
    "fp8_triton._fp8_encode_kernel": Config(
        {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*fp32", **SIDE, "n": N,
         "nblocks": GROUPS_128, "block": 128, "cap": CAP},
        dict(FMAX=448.0, MBITS=3, BIAS=7, NAN_BITS=127, IS_E4M3=True, BLOCK_P=128, GROUPS=8,
             HW=True, SIDE=True), "ld x_ptr"),
    "fp8_triton._fp8_decode_kernel": Config(
        {"code_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*bf16", "n": N,
         "nblocks": GROUPS_128, "block": 128},
        dict(EBITS=4, MBITS=3, BIAS=7, IS_E4M3=True, BLOCK_P=128, GROUPS=8, HW=True),
        "st out_ptr"),
    # ---- fewbit3 (gelu: asymmetric table) ----
    "fewbit_triton._fewbit_encode_kernel": Config(
        {"x_ptr": "*bf16", "cuts_ptr": "*fp32", "code_ptr": "*u8", "flag_ptr": "*u8",
         "n": N, "nbytes": N * 3 // 8},
        dict(BITS=3, BYTES_P2=4, SYMMETRIC=False, GROUP=128, GROUPS=8), "ld x_ptr"),
    "fewbit_triton._fewbit_decode_kernel": Config(
        {"code_ptr": "*u8", "flag_ptr": "*u8", "levels_ptr": "*fp32", "out_ptr": "*bf16",
         "n": N, "nbytes": N * 3 // 8},
        dict(BITS=3, BYTES_P2=4, GROUP=128, GROUPS=8, HW=True), "st out_ptr"),
    # ---- the non-finite side list's restore (after every decode): its output is a scatter
    # to the recorded positions by design, so its stream is the slot list it reads ----
    "nonfinite_triton._restore_kernel": Config(
        {"out_ptr": "*i16", "index_ptr": "*i32", "value_ptr": "*i16", "count_ptr": "*i32",
         "cap": CAP},
        {"BLOCK": 1024}, "ld index_ptr"),
}

#: kernel -> why its main stream does not compile to vector accesses today. The test fails
#: for a listed kernel that vectorises (drop it here then), so this list stays true.
NOT_VECTORISED_YET: dict[str, str] = {
    "nonfinite_triton._restore_kernel":
        "its loads are masked by `s < count`, a count loaded on the device, so no mask "
        "constancy can be proven (ld.global.b32 each); at most 4 + n / 8192 slots",
}
