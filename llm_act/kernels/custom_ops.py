"""The codec kernels as torch custom ops (`torch.ops.llm_act.<stem>_<what>`): what codecs call.

An op is opaque to torch.compile and export, and its fake implementation gives the output
shapes and dtypes without computing, so a compiled model can keep a codec in its graph
instead of tracing (or breaking) into Triton launchers and host-side sizing code.

Each op runs the family's Triton launcher where `use_triton(first tensor argument)` picks
it (CUDA, triton installed, `LLM_ACT_KERNELS` not "torch"), else the torch reference. The
reference's annotated signature is the op's schema, and each launcher takes the same
arguments, so both are called alike. Importing this module needs only torch; our Triton
modules load at the first CUDA call. (torch's custom-op wrapper imports torch._dynamo at
the first call of any op, and torch._dynamo imports triton when it is installed.)

Stochastic encodes take their randomness as inputs: `noise` drawn from the codec's own
generator (the references), or the codec's `seed` (an int), which the kernels key Philox
with, together with the call count in the codec's `state`; no op draws from a global
generator. Encodes also take the codec's `state` and the side-list buffers `nf_*`
(`nonfinite_ref`), which they write in place (declared mutated: `MUTATED_ARGS`).
No output size depends on data: OutlierInt4 keeps a fixed number of outlier slots per tile
(`outlier_ref.slots_per_tile`, chosen inside the encode kernel), an argument the fake reads.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch.library import infer_schema

from llm_act.kernels import (bitmask_ref, dual_ref, fewbit_ref, fp8_ref, int_quant_ref,
                             nonfinite_ref, outlier_ref)
from llm_act.kernels import use_triton
from llm_act.kernels.packing_ref import packed_numel

NAMESPACE = "llm_act"


@dataclass(frozen=True)
class KernelOp:
    """A registered op with what it runs: `reference` (torch) and `launcher`
    ("<family>_triton.<function>" under llm_act.kernels)."""

    op: torch.library.CustomOpDef
    reference: Callable
    launcher: str


#: op name (without the namespace) -> KernelOp, for every op this module registers
KERNEL_OPS: dict[str, KernelOp] = {}


#: arguments an op writes in place: the codec's state and the non-finite side list that an
#: encode fills (`nonfinite_ref`), and the output a restore writes into
MUTATED_ARGS = ("state", "nf_index", "nf_value", "nf_count", "out")


def kernel_op(name: str, reference: Callable, launcher: str,
              fake: Callable) -> torch.library.CustomOpDef:
    """Register `llm_act::<name>` with `reference`'s schema: the Triton `launcher` where
    `use_triton` picks it, else `reference`; `fake` gives the outputs' shapes and dtypes."""
    module, function = launcher.split(".")
    params = inspect.signature(reference).parameters
    mutates = tuple(a for a in MUTATED_ARGS if a in params)

    @functools.cache
    def triton_launcher() -> Callable:  # imported at the first CUDA call, then looked up once
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)

    def run(*args):
        if use_triton(args[0]):
            return triton_launcher()(*args)
        return reference(*args)

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", run, mutates_args=mutates,
                                 schema=infer_schema(reference, mutates_args=mutates))
    op.register_fake(fake)
    KERNEL_OPS[name] = KernelOp(op, reference, launcher)
    return op


def _new(like: torch.Tensor, *shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return like.new_empty(shape, dtype=dtype)


# ---- the non-finite side list ---------------------------------------------------------------
restore_nonfinite = kernel_op("restore_nonfinite", nonfinite_ref.restore_nonfinite_ref,
                              "nonfinite_triton.restore_nonfinite", lambda *args: None)


# ---- int_quant ------------------------------------------------------------------------------
def _int_quant_encode(x, bits, group_size, symmetric, noise=None, seed=None, state=None,
                      nf_index=None, nf_value=None, nf_count=None):
    n = x.numel()
    G = int_quant_ref.num_groups(n, group_size)
    return (_new(x, packed_numel(n, bits), dtype=torch.uint8), _new(x, G),
            _new(x, 0 if symmetric else G))


def _int_quant_axis_encode(x, bits, symmetric, noise=None, seed=None, state=None,
                           nf_index=None, nf_value=None, nf_count=None):
    rows, C = x.shape
    K = int_quant_ref.axis_chunks(rows)
    return (_new(x, rows * int_quant_ref.axis_row_bytes(C, bits), dtype=torch.uint8),
            _new(x, K, C), _new(x, 0 if symmetric else K, C))


def _int_quant_decode(packed, scale, zero, bits, group_size, symmetric, numel, dtype):
    return _new(packed, numel, dtype=dtype)


def _int_quant_axis_decode(packed, scale, zero, bits, symmetric, numel, dtype):
    return _new(packed, numel, dtype=dtype)


int_quant_encode = kernel_op("int_quant_encode", int_quant_ref.int_quant_encode_ref,
                             "int_quant_triton.int_quant_encode", _int_quant_encode)
int_quant_decode = kernel_op("int_quant_decode", int_quant_ref.int_quant_decode_ref,
                             "int_quant_triton.int_quant_decode", _int_quant_decode)
int_quant_axis_encode = kernel_op(
    "int_quant_axis_encode", int_quant_ref.int_quant_axis_encode_ref,
    "int_quant_triton.int_quant_axis_encode", _int_quant_axis_encode)
int_quant_axis_decode = kernel_op(
    "int_quant_axis_decode", int_quant_ref.int_quant_axis_decode_ref,
    "int_quant_triton.int_quant_axis_decode", _int_quant_axis_decode)


# ---- outlier --------------------------------------------------------------------------------
def _outlier_encode(x2, group_size, z_threshold, slots, noise=None, seed=None, state=None,
                    nf_index=None, nf_value=None, nf_count=None):
    rows, C = x2.shape
    lay = outlier_ref.record_layout(rows, C, group_size, slots)
    return (_new(x2, rows, lay["row_bytes"], dtype=torch.uint8),
            _new(x2, rows, lay["groups"]), _new(x2, rows, lay["groups"]),
            _new(x2, rows, lay["slots_per_row"], dtype=x2.dtype),
            _new(x2, lay["chunks"], lay["slots_per_row"], dtype=outlier_ref.index_dtype(C)))


def _outlier_decode(packed, scale, zero, values, index, group_size, rows, C, dtype):
    return _new(packed, rows, C, dtype=dtype)


outlier_encode = kernel_op("outlier_encode", outlier_ref.outlier_encode_ref,
                           "outlier_triton.outlier_encode", _outlier_encode)
outlier_decode = kernel_op("outlier_decode", outlier_ref.outlier_decode_ref,
                           "outlier_triton.outlier_decode", _outlier_decode)


# ---- dual -----------------------------------------------------------------------------------
def _dual_encode(x2, pool, bits, noise=None, seed=None, state=None, nf_index=None,
                 nf_value=None, nf_count=None):
    s, C = x2.shape
    K = dual_ref.num_chunks(s, pool)
    return (_new(x2, dual_ref.num_pool_blocks(s, pool), C, dtype=torch.bfloat16),
            _new(x2, s, dual_ref.row_bytes(C, bits), dtype=torch.uint8),
            _new(x2, K, C, dtype=torch.bfloat16), _new(x2, K, C, dtype=torch.bfloat16))


def _dual_decode(lfc, codes, zero, step, pool, bits, s, C, dtype):
    return _new(codes, s, C, dtype=dtype)


dual_encode = kernel_op("dual_encode", dual_ref.dual_encode_ref, "dual_triton.dual_encode",
                        _dual_encode)
dual_decode = kernel_op("dual_decode", dual_ref.dual_decode_ref, "dual_triton.dual_decode",
                        _dual_decode)


# ---- fp8 ------------------------------------------------------------------------------------
def _fp8_encode(x, block, fmt, state=None, nf_index=None, nf_value=None, nf_count=None):
    n = x.numel()
    return _new(x, n, dtype=torch.uint8), _new(x, fp8_ref.num_blocks(n, block))


def _fp8_decode(payload, scale, block, fmt, dtype):
    return _new(payload, payload.numel(), dtype=dtype)


fp8_encode = kernel_op("fp8_encode", fp8_ref.fp8_encode_ref, "fp8_triton.fp8_encode",
                       _fp8_encode)
fp8_decode = kernel_op("fp8_decode", fp8_ref.fp8_decode_ref, "fp8_triton.fp8_decode",
                       _fp8_decode)


# ---- fewbit ---------------------------------------------------------------------------------
def _fewbit_encode(x, cuts, bits, symmetric):
    n = x.numel()
    return (_new(x, fewbit_ref.code_bytes(n, bits), dtype=torch.uint8),
            _new(x, fewbit_ref.flag_bytes(n), dtype=torch.uint8))


def _fewbit_decode(packed, flags, levels, bits, n, dtype):
    return _new(packed, n, dtype=dtype)


fewbit_encode = kernel_op("fewbit_encode", fewbit_ref.fewbit_encode_ref,
                          "fewbit_triton.fewbit_encode", _fewbit_encode)
fewbit_decode = kernel_op("fewbit_decode", fewbit_ref.fewbit_decode_ref,
                          "fewbit_triton.fewbit_decode", _fewbit_decode)


# ---- bitmask --------------------------------------------------------------------------------
def _bitmask_pack(mask):
    return _new(mask, bitmask_ref.mask_nbytes(mask.numel()), dtype=torch.uint8)


def _bitmask_unpack(packed, n, dtype):
    return _new(packed, n, dtype=dtype)


bitmask_pack = kernel_op("bitmask_pack", bitmask_ref.pack_mask_ref, "bitmask_triton.pack_mask",
                         _bitmask_pack)
bitmask_unpack = kernel_op("bitmask_unpack", bitmask_ref.unpack_mask_ref,
                           "bitmask_triton.unpack_mask", _bitmask_unpack)
