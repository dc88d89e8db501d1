"""A dropout mask stored as the generator state it was drawn from: `RegenMask` (0 bits
per element).

When the codec draws the mask itself, it records the generator state it drew from and
draws the same mask again in backward (Megatron's and DIVISION's "regenerate from the RNG"
trick), so only the state is stored: the 16-byte seed + offset of a CUDA philox generator,
or the get_state() bytes of a CPU generator (5056 for mt19937), whatever the mask size.
Lossless. A mask drawn elsewhere needs `llm_act.codecs.bitmask.BitMask`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.bitmask import check_mask_dtype


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
        check_mask_dtype(self, dtype)
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
            check_mask_dtype(self, x.dtype)
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
