"""DIVISION's dual-precision activations (sec. 4), along the token dimension.

Backward mostly uses an activation's low-frequency component (LFC), which is small, while
the high-frequency component (HFC) holds most of the bytes and tolerates low precision.
So: keep the average over each `pool` consecutive tokens in bfloat16 (the LFC) and
quantize the residual x - upsample(LFC) to `hfc_bits` bits with stochastic rounding,
unbiased given the LFC. Quantization follows the paper: asymmetric (zero = min,
step = range / (2^bits - 1), both bfloat16), one (zero, step) per channel ("per-channel
quantization"; here per channel and chunk of 256 tokens, see below), a channel being
every index of the other dimensions ((b, h) in megatron's [s, b, h]).

Layout, with s tokens along `dim`, C channels, nb = ceil(s / pool): lfc bfloat16 [nb, C],
codes uint8 [s, ceil(C * bits / 8)], zero and step bfloat16 [chunks, C] each, those of the
residual / 4 so that ranges near the float32 maximum fit (see `llm_act.kernels.dual_ref`).
Size: 2 * nb * C + s * ceil(C * bits / 8) + 4 * chunks * C bytes.
Smooth-along-tokens activations leave a small residual, hence a small step and error.

Chunks (issue 26): the paper's zero/step are per channel over all tokens, which a kernel
knows only after reading all of x; here they are per channel and chunk of 256 tokens (32
pool blocks of 8; `dual_ref.chunk_blocks`), so one launch encodes in one pass, a program
holding a chunk's tokens for a few channels. What it stores: 4 bytes per channel per 256
tokens, 1/64 byte per element (dual2 in bf16: 0.5156 bytes per element for s a multiple of 256;
whole-tensor: 0.5 + 4 / s). What it changes in the error: a chunk's residual range is at
most the whole range, so every step is at most the whole-tensor step, and
`expected_error` uses the chunks' steps. Measured on bf16 Gaussian [4096 tokens, 1024]:
relative RMSE 0.939 -> 0.727 (with 8 channels x30: 0.940 -> 0.735), at 0.5156 bytes per
element instead of 0.5010.
"""
from __future__ import annotations

import math

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.kernels import custom_ops, use_triton
from llm_act.kernels import dual_ref as ref
from llm_act.kernels.nonfinite_ref import unmove_index


class DualPrecision(Codec):
    """bfloat16 token-pooled LFC + `hfc_bits`-bit stochastic per-channel HFC (DIVISION)."""

    name = "dual2"
    stochastic = True

    def __init__(self, pool: int = 8, hfc_bits: int = 2, dim: int = 0, seed: int = 1234):
        super().__init__(seed=seed)
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"pool must be a positive integer, got {pool!r}")
        if hfc_bits not in ref.BITS_ALLOWED or isinstance(hfc_bits, bool):
            raise ValueError(f"hfc_bits must be one of {ref.BITS_ALLOWED}, got {hfc_bits!r}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim must be an integer, got {dim!r}")
        self.pool, self.hfc_bits, self.dim = pool, hfc_bits, dim

    # ---- the [s, C] view ----------------------------------------------------------------
    def _dim(self, ndim: int) -> int:
        nd = max(ndim, 1)
        if not -nd <= self.dim < nd:
            raise ValueError(f"dim={self.dim} is out of range for a {ndim}-d tensor")
        return self.dim % nd

    def _matrix(self, shape) -> tuple[int, int]:
        shape = tuple(int(v) for v in shape) or (1,)
        s = shape[self._dim(len(shape))]
        return s, (math.prod(shape) // s if s else 0)

    def _as_matrix(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(1) if x.dim() == 0 else x
        s, C = self._matrix(x.shape)
        return x.movedim(self._dim(x.dim()), 0).reshape(s, C)

    # ---- size ---------------------------------------------------------------------------
    def nbytes_for(self, shape, dtype: torch.dtype) -> int:
        s, C = self._matrix(shape)
        if s * C == 0:
            return 0
        nb = ref.num_pool_blocks(s, self.pool)
        return (2 * nb * C + s * ref.row_bytes(C, self.hfc_bits)
                + 4 * ref.num_chunks(s, self.pool) * C + self.side_list_bytes(shape, dtype))

    # ---- encode / decode --------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> Encoded:
        if x.numel() == 0:
            return self._record(x)
        x2 = self._as_matrix(x)
        side = self.side_buffers(x)
        if use_triton(x2):  # Philox bits keyed by the seed and the call count
            rounding = {"seed": self.seed}
        else:
            rounding = {"noise": torch.rand(x2.shape, generator=self.generator(x.device),
                                             device=x.device)}
        lfc, codes, zero, step = custom_ops.dual_encode(x2, self.pool, self.hfc_bits,
                                                        **rounding, **side)
        k = self._dim(x.dim())
        if k != 0:  # the kernel saw x moved to [s, C]; the record keeps x's positions
            side["nf_index"] = unmove_index(side["nf_index"], x.shape, k, 0)
        enc = self._record(x, lfc=lfc, codes=codes, zero=zero, step=step)
        enc.data.update(self.side_record(side))
        return enc

    def _decode(self, enc: Encoded) -> torch.Tensor:
        d = enc.data
        s, C = self._matrix(enc.shape)
        y2 = custom_ops.dual_decode(d["lfc"], d["codes"], d["zero"], d["step"], self.pool,
                                    self.hfc_bits, s, C, enc.dtype)
        shape = tuple(enc.shape) or (1,)
        k = self._dim(len(shape))
        moved = (shape[k],) + shape[:k] + shape[k + 1:]
        return y2.reshape(moved).movedim(0, k).contiguous().reshape(enc.shape)

    # ---- error model ------------------------------------------------------------------
    def expected_error(self, x: torch.Tensor) -> float:
        """Stochastic-rounding variance per element: each finite element adds its chunk's
        step^2 / 6 (residual uniform within a step), over the finite count."""
        self.check_input(x)
        if x.numel() == 0:
            return 0.0
        x2 = self._as_matrix(x)
        _, _, fin, _, step, _ = ref.dual_stats_ref(x2, self.pool, self.hfc_bits)
        step = step.double()[ref.token_chunk(x2.shape[0], self.pool, x2.device)]
        step = step / ref.H_SCALE  # the stored step is that of h * H_SCALE
        n = fin.sum()
        return float((fin * step**2 / 6.0).sum()) / max(float(n), 1.0)
