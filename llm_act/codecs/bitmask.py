"""Dropout-mask codecs: `BitMask` (1 bit per element) and `RegenMask` (0 bits per element).

A dropout mask is binary, so storing it as bool or float wastes 8 to 32 bits per element.
`BitMask` packs any given 0/1 mask 8 per byte. `RegenMask` goes further when it draws the
mask itself: it records the generator state it drew from and draws the same mask again
in backward (Megatron's and DIVISION's "regenerate from the RNG" trick), so only the
state is stored: the 16-byte seed + offset of a CUDA philox generator, or the
get_state() bytes of a CPU generator (5056 for mt19937), whatever the mask size.
Both are lossless.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from llm_act.codecs.base import FLOAT_DTYPES, Codec, Encoded
from llm_act.kernels import bitmask_ref as ref
from llm_act.kernels import use_triton

MASK_DTYPES = (torch.bool,) + FLOAT_DTYPES


def _check_mask_dtype(codec: Codec, dtype: torch.dtype) -> None:
    if dtype not in MASK_DTYPES:
        raise TypeError(
            f"codec {codec.name!r} stores masks of dtype bool, float32, float16 or bfloat16, "
            f"got dtype {dtype}")


class BitMask(Codec):
    """A 0/1 (bool or float) mask packed 8 elements per byte; decodes to its own dtype.

    The mask is stored as `mask != 0`. On CPU, values other than 0 and 1 (NaN included)
    raise ValueError; on CUDA they are not checked (that would cost a host sync) and any
    nonzero value decodes to 1. Size: ceil(numel / 8) bytes.
    """

    name = "bitmask"
    lossless = True

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec {self.name!r} encodes tensors, got {type(x).__name__}")
        _check_mask_dtype(self, x.dtype)

    def nbytes_for(self, shape, dtype: torch.dtype) -> int:
        return ref.mask_nbytes(math.prod(int(s) for s in shape))

    def _encode(self, x: torch.Tensor) -> Encoded:
        if x.dtype != torch.bool and not x.is_cuda and x.numel():
            if not bool(((x == 0) | (x == 1)).all()):
                raise ValueError(
                    f"codec {self.name!r} stores 0/1 masks; got values other than 0 and 1 "
                    f"(NaN or a scaled mask?): pass the keep-mask, e.g. `x != 0`")
        pack = ref.pack_mask_ref
        if use_triton(x):
            from llm_act.kernels.bitmask_triton import pack_mask as pack
        return self._record(x, bits=pack(x))

    def _decode(self, enc: Encoded) -> torch.Tensor:
        bits = enc.data["bits"]
        unpack = ref.unpack_mask_ref
        if use_triton(bits):
            from llm_act.kernels.bitmask_triton import unpack_mask as unpack
        return unpack(bits, enc.numel, enc.dtype).view(enc.shape)


def _state_nbytes(device: torch.device) -> int:
    return torch.Generator(device=device).get_state().numel()


class RegenMask(Codec):
    """A dropout keep-mask stored as the generator state it was drawn from.

    Formula (fixed; decode repeats it): `keep = torch.rand(shape, generator=g,
    device=device) >= p`, float32 uniforms, so P(keep) = 1 - p; the mask is `keep` cast to
    `dtype` (True/False or 1/0). Use `sample()` to draw a mask; `encode()` of a mask drawn
    elsewhere is impossible (no seed can be recovered from it) and raises ValueError.
    """

    name = "regen"
    lossless = True

    def sample(self, shape: Sequence[int], p: float,
               generator: Optional[torch.Generator] = None,
               device: Optional[torch.device | str] = None,
               dtype: torch.dtype = torch.bool) -> tuple[torch.Tensor, Encoded]:
        """Draw a keep-mask from `generator` (advancing it, as dropout would) and its record.

        `generator` None uses torch's default generator of `device`. Returns (mask, enc);
        `decode(enc)` gives the same mask bit for bit.
        """
        _check_mask_dtype(self, dtype)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a dropout probability in [0, 1], got {p!r}")
        if generator is not None and device is not None \
                and torch.device(device).type != generator.device.type:
            raise ValueError(
                f"device {device!r} does not match the generator's device {generator.device}")
        if device is None:
            device = generator.device if generator is not None else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if generator is None:
            generator = (torch.cuda.default_generators[device.index] if device.type == "cuda"
                         else torch.default_generator)
        shape = torch.Size(int(s) for s in shape)
        state = generator.get_state()  # a CPU uint8 tensor, before drawing
        mask = self._draw(shape, float(p), generator, device, dtype)
        enc = Encoded(self.name, shape, dtype, device, {"state": state}, {"p": float(p)})
        return mask, enc

    @staticmethod
    def _draw(shape, p, generator, device, dtype) -> torch.Tensor:
        keep = torch.rand(shape, generator=generator, device=device) >= p
        return keep if dtype == torch.bool else keep.to(dtype)

    def encode(self, x: torch.Tensor) -> Encoded:
        if isinstance(x, torch.Tensor):
            _check_mask_dtype(self, x.dtype)
        raise ValueError(
            "RegenMask cannot encode a mask it did not draw: a generator state cannot be "
            "recovered from the mask. Draw it with `mask, enc = RegenMask().sample(shape, p, "
            "generator, device, dtype)`, or store a given mask with BitMask.")

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Redraw the mask from a private generator set to the recorded state (the
        generator passed to `sample` is not touched)."""
        gen = torch.Generator(device=enc.device)
        gen.set_state(enc.data["state"])
        return self._draw(enc.shape, enc.meta["p"], gen, enc.device, enc.dtype)

    def nbytes_for(self, shape, dtype: torch.dtype,
                   device: Optional[torch.device | str] = None) -> int:
        """The generator state's size on `device` (default: CUDA when present, else CPU),
        independent of `shape`: 16 bytes for CUDA philox, 5056 for the CPU mt19937."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return _state_nbytes(torch.device(device))
