"""Dropout masks stored 1 bit per element: `BitMask`.

A dropout mask is binary, so storing it as bool or float wastes 8 to 32 bits per element;
`BitMask` packs any given 0/1 mask 8 per byte, losslessly. A mask the codec draws itself
needs no bits at all: `llm_act.codecs.regen.RegenMask`.
"""
from __future__ import annotations

import math

import torch

from llm_act.codecs.base import FLOAT_DTYPES, Codec, Encoded
from llm_act.kernels import bitmask_ref as ref
from llm_act.kernels import custom_ops, use_triton

MASK_DTYPES = (torch.bool,) + FLOAT_DTYPES


def check_mask_dtype(codec: Codec, dtype: torch.dtype) -> None:
    if dtype not in MASK_DTYPES:
        raise TypeError(
            f"codec {codec.name!r} stores masks of dtype bool, float32, float16 or bfloat16, "
            f"got dtype {dtype}")


class BitMask(Codec):
    """A 0/1 (bool or float) mask packed 8 elements per byte; decodes to its own dtype.

    The mask is stored as `mask != 0`. On CPU (the torch reference), values other than 0
    and 1 (NaN included) raise ValueError. On CUDA and wherever the Triton kernel runs they
    are not checked: raising needs the host to read a device value (a sync per encode, and
    the check alone would read the mask twice more), and the masks this codec is given are
    keep-masks by construction; any nonzero value (NaN too) decodes to 1 there. Encode is
    then one launch reading the mask once. Size: ceil(numel / 8) bytes.
    """

    name = "bitmask"
    lossless = True

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec {self.name!r} encodes tensors, got {type(x).__name__}")
        check_mask_dtype(self, x.dtype)

    def nbytes_for(self, shape, dtype: torch.dtype) -> int:
        return ref.mask_nbytes(math.prod(int(s) for s in shape))

    def _encode(self, x: torch.Tensor) -> Encoded:
        if x.dtype != torch.bool and x.numel() and not (x.is_cuda or use_triton(x)):
            if not bool(((x == 0) | (x == 1)).all()):
                raise ValueError(
                    f"codec {self.name!r} stores 0/1 masks; got values other than 0 and 1 "
                    f"(NaN or a scaled mask?): pass the keep-mask, e.g. `x != 0`")
        return self._record(x, bits=custom_ops.bitmask_pack(x))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return custom_ops.bitmask_unpack(enc.data["bits"], enc.numel, enc.dtype).view(enc.shape)
