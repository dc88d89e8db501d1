"""A dropout mask stored as the generator state it was drawn from: `RegenMask` (0 bits
per element), and `dropout_keep_mask`, the one formula every dropout of ours draws with.

When the codec draws the mask itself, it records the generator state it drew from and
draws the same mask again in backward (Megatron's and DIVISION's "regenerate from the RNG"
trick), so only the state is stored: the 16-byte seed + offset of a CUDA philox generator,
or the get_state() bytes of a CPU generator (5056 for mt19937), whatever the mask size.
Lossless. A mask drawn elsewhere needs `llm_act.codecs.bitmask.BitMask`.

The formula is torch's own dropout's, not a formula of ours: a compressed layer must draw
the mask stock draws from the same generator state, or turning compression on changes the
forward (a different dropout realization, not compression noise; issue 25: one batch of
the README job whose training loss moves by 0.8 nats between attention-dropout draws of
stock itself).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.bitmask import check_mask_dtype


def _state_nbytes(device: torch.device) -> int:
    return torch.Generator(device=device).get_state().numel()


def default_generator(device: torch.device | str) -> torch.Generator:
    """torch's default generator of `device` (what dropout draws from without one)."""
    device = torch.device(device)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


@contextlib.contextmanager
def generator_as_default(generator: Optional[torch.Generator], device) -> Iterator[None]:
    """Run the body with the device's default generator replaced by `generator`'s state;
    `generator` advances by what the body drew, the default generator is left as it was."""
    default = default_generator(device)
    if generator is None or generator is default:
        yield
        return
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
        generator.set_state(default.get_state())
    finally:
        default.set_state(saved)


def fused_dropout(device: torch.device | str, numel: int) -> bool:
    """Whether `torch.nn.functional.dropout` runs the fused `native_dropout` kernel there
    (aten's `is_fused_kernel_acceptable`, 0 < p < 1 assumed)."""
    return torch.device(device).type in ("cuda", "xpu", "lazy", "privateuseone") and numel > 0


def dropout_keep_mask(shape: Sequence[int], p: float, generator: Optional[torch.Generator] = None,
                      device: torch.device | str = "cpu", like_dtype: torch.dtype = torch.float32,
                      stride: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The keep-mask (bool) that `torch.nn.functional.dropout(x, p, training=True)` draws for
    an `x` of `shape`, `like_dtype` and `stride` on `device`, from `generator`'s current
    state (default: the device's default generator), advancing it exactly as dropout does.

    aten's dropout: on CPU `empty_like(x).bernoulli_(1 - p)` (the mask does not depend on
    the dtype there, so a bool tensor is drawn: 1 byte per element); on CUDA the fused
    `native_dropout` kernel, whose draw depends on x's dtype (vector width). p == 0 draws
    nothing and keeps everything, as dropout does; p == 1 keeps nothing.
    """
    shape = torch.Size(int(s) for s in shape)
    device = torch.device(device)
    if p == 0.0 or p == 1.0 or shape.numel() == 0:
        return torch.full(shape, p == 0.0, dtype=torch.bool, device=device)
    if fused_dropout(device, shape.numel()):
        like = torch.empty(shape, dtype=like_dtype, device=device) if stride is None else \
            torch.empty_strided(shape, tuple(stride), dtype=like_dtype, device=device)
        with generator_as_default(generator, device):
            return torch.native_dropout(like, p, True)[1]
    keep = torch.empty(shape, dtype=torch.bool, device=device) if stride is None else \
        torch.empty_strided(shape, tuple(stride), dtype=torch.bool, device=device)
    if generator is None:
        return keep.bernoulli_(1 - p)
    return keep.bernoulli_(1 - p, generator=generator)


class RegenMask(Codec):
    """A dropout keep-mask stored as the generator state it was drawn from.

    Formula: `dropout_keep_mask` (torch's dropout's own draw, for an input of
    `like_dtype`); the mask is cast to `dtype` (True/False or 1/0). Use `sample()` to draw
    a mask; `encode()` of a mask drawn elsewhere is impossible (no seed can be recovered
    from it) and raises ValueError.
    """

    name = "regen"
    lossless = True

    def sample(self, shape: Sequence[int], p: float,
               generator: Optional[torch.Generator] = None,
               device: Optional[torch.device | str] = None,
               dtype: torch.dtype = torch.bool,
               like_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Encoded]:
        """Draw a keep-mask from `generator` (advancing it, as dropout would) and its record.

        `generator` None uses torch's default generator of `device`; `like_dtype` is the
        dtype of the tensor the dropout applies to (it matters on CUDA only). Returns
        (mask, enc); `decode(enc)` gives the same mask bit for bit.
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
            generator = default_generator(device)
        shape = torch.Size(int(s) for s in shape)
        state = generator.get_state()  # a CPU uint8 tensor, before drawing
        mask = self._draw(shape, float(p), generator, device, dtype, like_dtype)
        enc = Encoded(self.name, shape, dtype, device, {"state": state},
                      {"p": float(p), "like_dtype": like_dtype})
        return mask, enc

    @staticmethod
    def _draw(shape, p, generator, device, dtype, like_dtype) -> torch.Tensor:
        keep = dropout_keep_mask(shape, p, generator, device, like_dtype)
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
        return self._draw(enc.shape, enc.meta["p"], gen, enc.device, enc.dtype,
                          enc.meta.get("like_dtype", torch.float32))

    def nbytes_for(self, shape, dtype: torch.dtype,
                   device: Optional[torch.device | str] = None) -> int:
        """The generator state's size on `device` (default: CUDA when present, else CPU),
        independent of `shape`: 16 bytes for CUDA philox, 5056 for the CPU mt19937."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return _state_nbytes(torch.device(device))
