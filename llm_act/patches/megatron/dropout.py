"""Bias-dropout-add that stores the hidden-dropout keep-mask packed or not at all.

megatron-core's layer calls `self.self_attn_bda(training, fused)(x_with_bias, residual, p)`
outside the RNG tracker's fork, so the hidden-dropout mask comes from the default
generator. `ActBiasDropoutAdd` replaces `self_attn_bda` / `mlp_bda`; with its site kept it
returns the stock function. Compressed, it runs the same ops as the stock *unfused* path
(x + bias, dropout, residual + out) with a dropout that draws its mask exactly as
`torch.nn.functional.dropout` does (same values, same RNG consumption) and stores it:

- `bitmask`: the keep-mask packed 1 bit per element (the site's BitMask codec);
- `regen`: only the generator state before the draw; backward draws the same mask again
  from a private generator set to that state, with dropout's own sampler
  (`llm_act.codecs.regen.dropout_keep_mask`: torch's CPU dropout is
  `empty_like(x).bernoulli_(1 - p).div_(1 - p)`, the CUDA one the fused `native_dropout`
  kernel).

Where x's dtype and the residual's differ (`fp32_residual_connection=True` with bf16 or fp16
params), the operands are cast as the installed megatron-core's own bias-dropout-add casts
them (`compat.bda_operands`: 0.16 computes in x's dtype, 0.19 in the residual's).
Gradients are bit-identical to stock in both cases. With `config.bias_dropout_fusion` the
stock function is torch.compile'd, whose generated RNG is not eager dropout's: compressed
masks then follow the unfused path (a different, equally valid mask stream).
"""
from __future__ import annotations

from typing import Callable

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.regen import default_generator, dropout_keep_mask, fused_dropout
from llm_act.patches.megatron import compat
from llm_act.patches.megatron.act_module import ActModule, codec_within_raw, count_kept
from llm_act.patches.megatron.functions import Record, report_record
from llm_act.sites import ATTN_HIDDEN_DROPOUT_MASK, sites_where

#: the hidden-dropout masks: the sites a bias-dropout-add stores (the schema's `holder` "bda")
DROPOUT_SITES = sites_where(holder="bda")


def _noise(keep: torch.Tensor, dtype: torch.dtype, p: float) -> torch.Tensor:
    """torch's CPU dropout noise from its keep-mask: 1 / (1 - p) where kept, in x's dtype."""
    return keep.to(dtype).div_(1 - p)


class StoredMaskDropout(torch.autograd.Function):
    """dropout(x, p, training=True) storing its mask with a bitmask or regen codec."""

    @staticmethod
    def forward(ctx, x, p: float, codec: Codec, owner, site: str):
        regen = codec.name == "regen" or type(codec).__name__ == "RegenMask"
        state = default_generator(x.device).get_state() if regen else None
        ctx.p, ctx.codec, ctx.regen = p, codec, regen
        ctx.fused = fused_dropout(x.device, x.numel())
        if ctx.fused:
            out, mask = torch.native_dropout(x, p, True)
            stored = mask
        else:
            ctx.noise_stride = torch.empty_like(x).stride()  # dropout draws on empty_like(x)
            stored = dropout_keep_mask(x.shape, p, None, x.device, x.dtype, ctx.noise_stride)
            out = x.mul(_noise(stored, x.dtype, p))
        ctx.shape, ctx.dtype = x.shape, x.dtype
        if regen:
            enc = Encoded(codec.name, x.shape, torch.bool, x.device, {"state": state}, {"p": p})
        else:
            enc = codec.encode(stored)
        record = Record(enc)
        ctx.record = record
        report_record(owner, site, record, None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        enc = ctx.record.enc
        ctx.record = None
        p = ctx.p
        if ctx.regen:  # the same draw again, from a private generator set to the state
            gen = torch.Generator(device=enc.device)
            gen.set_state(enc.data["state"])
            mask = dropout_keep_mask(ctx.shape, p, gen, enc.device, ctx.dtype,
                                     None if ctx.fused else ctx.noise_stride)
        else:
            mask = ctx.codec.decode(enc)
        if ctx.fused:
            return torch.ops.aten.native_dropout_backward(grad_out, mask, 1.0 / (1.0 - p)), None, None, None, None
        return grad_out * _noise(mask, ctx.dtype, p), None, None, None, None


class ActBiasDropoutAdd(ActModule, torch.nn.Module):
    """Replaces a layer's `self_attn_bda` / `mlp_bda` (a `get_bias_dropout_add`-like
    callable `(training, fused) -> fn(x_with_bias, residual, prob)`)."""

    def __init__(self, stock: Callable, site: str):
        torch.nn.Module.__init__(self)
        if site not in DROPOUT_SITES:
            raise ValueError(f"site: bias-dropout-add stores one of {DROPOUT_SITES}, got {site!r}")
        self.stock = stock
        self.ACT_SITES = (site,)
        self.act_site = site
        self._act_init()

    @classmethod
    def from_stock(cls, module: Callable, site: str = ATTN_HIDDEN_DROPOUT_MASK) -> "ActBiasDropoutAdd":
        """Wrap a stock bda callable (already-wrapped ones are returned as they are)."""
        if isinstance(module, cls):
            return module
        if not callable(module):
            raise TypeError(f"ActBiasDropoutAdd.from_stock needs a callable, got {type(module).__name__}")
        return cls(module, site)

    def forward(self, training: bool, fused: bool) -> Callable:
        stock_fn = self.stock(training, fused)
        codec = self.act_codecs.get(self.act_site)
        if codec is None or not (training and self.training):
            return stock_fn

        def bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            needs_grad = torch.is_grad_enabled() and (
                x.requires_grad or residual.requires_grad or (bias is not None and bias.requires_grad))
            if not needs_grad or not 0.0 < prob < 1.0 or x.numel() == 0:
                return stock_fn(x_with_bias, residual, prob)
            # the dtypes stock's installed version computes in where x's and the residual's
            # differ (fp32_residual_connection): 0.16 casts the residual to x's, 0.19 x and the
            # bias to the residual's (`compat.bda_operands`); the dropout then runs as stock's
            cast_x, bias, cast_residual = compat.bda_operands(x, bias, residual)
            # never more than stock, which keeps a bool mask (fused) or the noise in x's dtype
            stock_mask = (x.shape, torch.bool if fused_dropout(x.device, x.numel()) else cast_x.dtype)
            if not codec_within_raw(codec, stock_mask):
                count_kept(self, self.act_site)
                return stock_fn(x_with_bias, residual, prob)
            x, residual = cast_x, cast_residual
            if bias is not None:
                x = x + bias
            out = StoredMaskDropout.apply(x, float(prob), codec, self, self.act_site)
            return residual + out

        return bias_dropout_add

    def extra_repr(self) -> str:
        return f"site={self.act_site!r}"
