"""Bias-dropout-add that stores the hidden-dropout keep-mask packed or not at all.

megatron-core's layer calls `self.self_attn_bda(training, fused)(x_with_bias, residual, p)`
outside the RNG tracker's fork, so the hidden-dropout mask comes from the default
generator. `ActBiasDropoutAdd` replaces `self_attn_bda` / `mlp_bda`; with its site kept it
returns the stock function. Compressed, it runs the same ops as the stock *unfused* path
(x + bias, dropout, residual + out) with a dropout that draws its mask exactly as
`torch.nn.functional.dropout` does (same values, same RNG consumption) and stores it:

- `bitmask`: the keep-mask packed 1 bit per element (the site's BitMask codec);
- `regen`: only the generator state before the draw; backward draws the same mask again
  from a private generator set to that state, with dropout's own sampler. (`RegenMask.sample`
  draws `rand >= p`, which is not dropout's mask: torch's CPU dropout is
  `empty_like(x).bernoulli_(1 - p).div_(1 - p)`, the CUDA one the fused `native_dropout`
  kernel; so the state is recorded here and replayed through those very calls.)

Gradients are bit-identical to stock in both cases. With `config.bias_dropout_fusion` the
stock function is torch.compile'd, whose generated RNG is not eager dropout's: compressed
masks then follow the unfused path (a different, equally valid mask stream).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.patches.megatron.act_module import ActModule, codec_within_raw
from llm_act.patches.megatron.functions import Record, _report

DROPOUT_SITES = ("attn.hidden_dropout_mask", "mlp.hidden_dropout_mask")


def _fused_dropout(x: torch.Tensor) -> bool:
    """Whether at::dropout takes the fused native_dropout kernel for x (0 < p < 1 assumed)."""
    return x.device.type in ("cuda", "xpu", "lazy", "privateuseone") and x.numel() > 0


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def _cpu_noise(like: torch.Tensor, p: float, generator: Optional[torch.Generator] = None):
    """torch's CPU dropout noise: bernoulli(1 - p) in x's dtype, scaled by 1 / (1 - p)."""
    noise = like.bernoulli_(1 - p, generator=generator) if generator is not None else like.bernoulli_(1 - p)
    return noise.div_(1 - p)


class StoredMaskDropout(torch.autograd.Function):
    """dropout(x, p, training=True) storing its mask with a bitmask or regen codec."""

    @staticmethod
    def forward(ctx, x, p: float, codec: Codec, owner, site: str):
        regen = codec.name == "regen" or type(codec).__name__ == "RegenMask"
        gen = _default_generator(x.device)
        state = gen.get_state() if regen else None
        ctx.p, ctx.codec, ctx.regen = p, codec, regen
        ctx.fused = _fused_dropout(x)
        if ctx.fused:
            out, mask = torch.native_dropout(x, p, True)
            stored = mask
        else:
            noise = _cpu_noise(torch.empty_like(x), p)
            out = x.mul(noise)
            stored = noise != 0
            ctx.noise_stride = noise.stride()
        ctx.shape, ctx.dtype = x.shape, x.dtype
        if regen:
            enc = Encoded(codec.name, x.shape, torch.bool, x.device, {"state": state}, {"p": p})
        else:
            enc = codec.encode(stored)
        record = Record(enc)
        ctx.record = record
        _report(owner, site, record, None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        enc = ctx.record.enc
        ctx.record = None
        p = ctx.p
        if ctx.fused:
            mask = _regen_fused_mask(enc, ctx.dtype, p) if ctx.regen else ctx.codec.decode(enc)
            return torch.ops.aten.native_dropout_backward(grad_out, mask, 1.0 / (1.0 - p)), None, None, None, None
        if ctx.regen:
            gen = torch.Generator(device=enc.device)
            gen.set_state(enc.data["state"])
            like = torch.empty_strided(ctx.shape, ctx.noise_stride, dtype=ctx.dtype, device=enc.device)
            noise = _cpu_noise(like, p, gen)
        else:
            noise = ctx.codec.decode(enc).to(ctx.dtype).div_(1 - p)
        return grad_out * noise, None, None, None, None


def _regen_fused_mask(enc: Encoded, dtype: torch.dtype, p: float) -> torch.Tensor:
    """Replay native_dropout's mask: set the device generator to the recorded state, draw
    on a fresh tensor, restore the generator (as megatron's CheckpointFunction does)."""
    gen = _default_generator(enc.device)
    saved = gen.get_state()
    try:
        gen.set_state(enc.data["state"])
        _, mask = torch.native_dropout(torch.empty(enc.shape, dtype=dtype, device=enc.device), p, True)
    finally:
        gen.set_state(saved)
    return mask


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
    def from_stock(cls, module: Callable, site: str = "attn.hidden_dropout_mask") -> "ActBiasDropoutAdd":
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
            # never more than stock, which keeps a bool mask (fused) or the noise in x's dtype
            stock_mask = (x.shape, torch.bool if _fused_dropout(x) else x.dtype)
            if not codec_within_raw(codec, stock_mask):
                kept = self.__dict__.setdefault("act_kept", {})
                kept[self.act_site] = kept.get(self.act_site, 0) + 1
                return stock_fn(x_with_bias, residual, prob)
            residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
            if bias is not None:
                x = x + bias
            out = StoredMaskDropout.apply(x, float(prob), codec, self, self.act_site)
            return residual + out

        return bias_dropout_add

    def extra_repr(self) -> str:
        return f"site={self.act_site!r}"
