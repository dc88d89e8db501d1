"""`ActCoreAttention`: megatron-core's DotProductAttention with memory-efficient backends.

Stock core attention materialises the attention scores and keeps the fp32 softmax, a
model-dtype copy of it and the dropout mask for backward: several s x s tensors per head,
the largest activations of a long-sequence block. This class sits in the layer's
`core_attention` slot (same constructor, convertible in place with `from_stock`; it has
no parameters of its own, so state_dict keys do not change) and picks, by its attention
*mode* (`set_attention_mode`):

- "stock": megatron's own forward, bit for bit and with the same RNG use. With a codec at
  `attn.q/k/v` or `attn.softmax` it takes the unfused path instead (the same math, the
  stored softmax and Q/K/V encoded); with only `attn.dropout_mask` (bitmask/regen) it
  stays stock and stores the attention-dropout mask packed or as the generator state
  (still bit-identical).
- "auto" (memory-efficient: SDPA without attention dropout or on CUDA, our chunked
  attention with dropout on CPU), "sdpa", "chunked": `llm_act.attention`, which never
  stores an s x s tensor (except "sdpa" with dropout on CPU, SDPA's math path). A codec at
  `attn.softmax` means nothing here (no softmax is stored). "unfused": always the unfused
  path.

ActConfig.attention = "auto" is resolved by the Controller ("stock" under the "keep"
plan, module mode "auto" otherwise); a converted module starts in "stock".

Sites: `attn.q/k/v` (after rotary; GQA K/V un-expanded), `attn.softmax` (unfused path
only), `attn.dropout_mask`, `attn.out` (SDPA output and logsumexp). A codec at `attn.out`
(here, or at the output projection linked with `link_out_site`, which stores the same
tensor encoded) makes the attention store no output of its own. With lossy Q/K/V codecs
(Adacc sec. 3.2) backward can run only the attention backward on the decoded Q/K/V, from the
output the projection stores (its record at `attn.out`, handed over by a one-shot
`act_record_tap`, or the very memory it keeps raw) and the forward's logsumexp (site
`attn.lse`), with no second attention forward, when `set_lossy_backward("stored")`;
by default it recomputes the forward from the decoded Q/K/V (`llm_act.attention.core` says
why: the measured gradient error). With exact Q/K/V and an encoded `attn.out`, backward
recomputes the forward from Q, K, V (exact).

Attention dropout is drawn inside megatron's RNG tracker fork (unless sequence parallel,
as the stock class does), so tensor-parallel ranks draw their own streams. Masks: causal
-> `is_causal` (the given mask, if any, is taken to be causal, as megatron's fused softmax
kernel and Transformer Engine do); no mask -> full attention. Explicit padding/arbitrary
masks, sliding windows, softmax offsets, attention bias and packed sequences fall back
to the stock forward with a warning.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Optional

import torch

from llm_act import ledger
from llm_act._imports import require
from llm_act.attention import (LOSSY_BACKWARDS, OutSource, attention, pick_backend,
                               resolve_lossy_backward)
from llm_act.attention._stash import is_lossy
from llm_act.codecs.base import Codec
from llm_act.codecs.registry import RECOMPUTE
from llm_act.config import ATTENTION_MODES
from llm_act.cpu import required as cpu_required
from llm_act.patches.megatron.act_module import ActModule, codec_within_raw
from llm_act.patches.megatron.dropout import StoredMaskDropout
from llm_act.sites import (
    ATTN_DROPOUT_MASK,
    ATTN_K,
    ATTN_OUT,
    ATTN_Q,
    ATTN_SOFTMAX,
    ATTN_V,
    QKV_SITES,
)

require("megatron.core", "llm_act.patches.megatron.attention")
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

#: what `set_attention_mode` takes: a user's `ActConfig.attention`, or "unfused" (megatron's
#: math with the stored mask, which the runtime itself selects, never a user setting)
RUNTIME_ATTENTION_MODES = ATTENTION_MODES + ("unfused",)
ATTENTION_SITES = (ATTN_Q, ATTN_K, ATTN_V, ATTN_SOFTMAX, ATTN_DROPOUT_MASK, ATTN_OUT)


class _StoredMaskAttentionDropout(torch.nn.Dropout):
    """The stock attention dropout; stores its mask through a codec when its owner says so.

    The owner puts `(codec, owner)` in `act_mask` for one stock forward; the mask is then
    drawn exactly as `torch.nn.Dropout` draws it (`dropout.StoredMaskDropout`), so results
    and RNG use stay stock."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.__dict__.get("act_mask")
        p = float(self.p)
        if (spec is None or not self.training or not torch.is_grad_enabled() or not x.requires_grad
                or not 0.0 < p < 1.0 or x.numel() == 0):
            return super().forward(x)

        codec, owner = spec
        return StoredMaskDropout.apply(x, p, codec, owner, ATTN_DROPOUT_MASK)


class ActCoreAttention(ActModule, DotProductAttention):
    """DotProductAttention with a mode (stock / memory-efficient) and encoded sites."""

    ACT_SITES = ATTENTION_SITES

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, *,
                 act_attention: str = "stock"):
        DotProductAttention.__init__(
            self, config, layer_number, attn_mask_type, attention_type,
            attention_dropout=attention_dropout, softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self._act_init(attention=act_attention)

    def _act_init(self, attention: str = "stock") -> None:
        ActModule._act_init(self)
        self.set_attention_mode(attention)
        self.set_lossy_backward("auto")
        self._act_out_source = None
        drop = self.attention_dropout
        if type(drop) is torch.nn.Dropout:
            drop.__class__ = _StoredMaskAttentionDropout

    # ---- configuration -------------------------------------------------------------------
    def set_attention_mode(self, mode: str) -> None:
        """"stock", "auto" (memory-efficient, backend by dropout and device), "sdpa",
        "chunked" or "unfused"; see the module docstring. Takes effect at the next forward."""
        if mode not in RUNTIME_ATTENTION_MODES:
            raise ValueError(f"mode: expected one of {RUNTIME_ATTENTION_MODES}, got {mode!r}")
        self.act_attention = mode

    def set_lossy_backward(self, mode: str) -> None:
        """With lossy Q/K/V: "stored" (backward from the stored output and logsumexp, no
        second forward), "recompute" (the forward again from the decoded Q/K/V) or "auto"
        (`llm_act.attention.DEFAULT_LOSSY_BACKWARD`). Takes effect at the next forward."""
        if mode not in LOSSY_BACKWARDS:
            raise ValueError(f"mode: expected one of {LOSSY_BACKWARDS}, got {mode!r}")
        self.act_lossy_backward = mode

    def link_out_site(self, module: Any) -> None:
        """Also read the `attn.out` codec from `module` (the output projection, which stores
        the same tensor): when it encodes that tensor, this attention keeps no raw copy."""
        if module is not None and not hasattr(module, "act_codecs"):
            raise TypeError(f"module: expected an ActModule (or None), got {type(module).__name__}")
        self._act_out_source = None if module is None else weakref.ref(module)

    def _out_codec(self, *tensors: torch.Tensor) -> Optional[Codec]:
        own = self.act_codec(ATTN_OUT, *tensors, stores=tensors[0])
        if own is not None or self._act_out_source is None:
            return own
        if not (self.training and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return None
        linear = self._act_out_source()
        codec = None if linear is None else linear.act_codecs.get(ATTN_OUT)
        if codec is not None and not codec_within_raw(codec, tensors[0]):
            return None  # never more than stock (the linear keeps its input too)
        return codec

    def _linked_linear(self) -> Optional[Any]:
        return self._act_out_source() if self._act_out_source is not None else None

    def _layer(self) -> int:
        return self.act_layer if self.act_layer is not None else max(0, int(self.layer_number) - 1)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None):
        linear = self._linked_linear()
        if linear is not None:  # a tap an earlier forward set and no record consumed
            linear.__dict__.pop("act_record_tap", None)
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        probs = (b, heads, sq, key.shape[0])
        # stock dropout keeps a bool mask on CUDA (native_dropout), the float noise on CPU
        mask_dtype = torch.bool if query.is_cuda else query.dtype
        stores = {ATTN_Q: query, ATTN_K: key, ATTN_V: value, ATTN_OUT: query,
                  ATTN_SOFTMAX: (probs, query.dtype), ATTN_DROPOUT_MASK: (probs, mask_dtype)}
        codecs = {site: self.act_codec(site, query, key, value, stores=stores[site])
                  for site in ATTENTION_SITES}
        codecs[ATTN_OUT] = self._out_codec(query, key, value)
        stock_args = (query, key, value, attention_mask, attn_mask_type, attention_bias,
                      packed_seq_params)
        stored = any(codecs[s] is not None for s in QKV_SITES + (ATTN_SOFTMAX,))
        if self.act_attention == "stock" and not stored:
            return self._stock(codecs[ATTN_DROPOUT_MASK], *stock_args)
        causal, why = self._mask_kind(query, key, attention_mask, attn_mask_type,
                                      attention_bias, packed_seq_params)
        if why is not None:
            warnings.warn(f"llm_act core attention (layer {self._layer()}): {why}; running the "
                          "stock megatron-core attention instead", stacklevel=2)
            return self._stock(codecs[ATTN_DROPOUT_MASK], *stock_args)
        return self._efficient(query, key, value, causal, codecs)

    def _stock(self, mask_codec: Optional[Codec], *args):
        if cpu_required.missing():
            cpu_required.require("megatron-core's stock attention (DotProductAttention's buffer "
                                 "on torch.cuda.current_device())",
                                 f"llm_act core attention (layer {self._layer()})")
        if mask_codec is None:
            return DotProductAttention.forward(self, *args)
        drop = self.attention_dropout
        drop.__dict__["act_mask"] = (mask_codec, self)
        try:
            return DotProductAttention.forward(self, *args)
        finally:
            drop.__dict__.pop("act_mask", None)

    def _mask_kind(self, query, key, attention_mask, attn_mask_type, attention_bias,
                   packed_seq_params) -> tuple[bool, Optional[str]]:
        """(causal, reason to fall back to stock or None)."""
        if attention_bias is not None:
            return False, "attention_bias is not supported"
        if packed_seq_params is not None:
            return False, "packed sequences are not supported"
        if self.softmax_offset is not None:
            return False, f"softmax_type={self.config.softmax_type!r} is not supported"
        if getattr(self.scale_mask_softmax, "window_size", None) is not None:
            return False, "sliding-window attention is not supported"
        kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, sk = query.shape[0], key.shape[0]
        if kind == AttnMaskType.causal or (kind == AttnMaskType.padding_causal and attention_mask is None):
            if sq == 1:  # one query (decoding): it sees every key, as in the stock softmax
                return False, None
            if sq != sk:
                return False, f"a causal mask needs equal query and key lengths, got {sq} and {sk}"
            return True, None
        if attention_mask is None and kind in (AttnMaskType.no_mask, AttnMaskType.padding):
            return False, None
        return False, (f"attn_mask_type {kind.name} with an explicit attention mask would need an "
                       "s x s mask (only causal and unmasked attention are memory-efficient)")

    def _efficient(self, query, key, value, causal: bool, codecs: dict) -> torch.Tensor:
        mode = self.act_attention
        p = float(self.attention_dropout.p) if self.training else 0.0
        backend = "unfused" if mode in ("stock", "unfused") else pick_backend(mode, p, query.device)
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        use = {site: codecs[site] for site in QKV_SITES + (ATTN_DROPOUT_MASK,)}
        if backend == "unfused":
            use[ATTN_SOFTMAX] = codecs[ATTN_SOFTMAX]
        recompute_out = backend != "unfused" and codecs[ATTN_OUT] is not None
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out_source = self._out_source(codecs, grads and recompute_out)
        layer = self._layer()
        report = None
        where = contextlib.nullcontext()
        if grads and ledger.current_ledger() is not None:  # nothing to tell without a ledger
            def report(site, tensors, nbytes):
                ledger.report(layer, site, list(tensors), int(nbytes))

            # what SDPA saves internally (logsumexp; its math path's s x s tensors with
            # dropout off CUDA) goes to the site that owns it
            math_path = backend == "sdpa" and p > 0.0 and query.device.type != "cuda"
            where = ledger.scope(layer, ATTN_SOFTMAX if math_path else ATTN_OUT)
        fork = contextlib.nullcontext()
        if p > 0.0 and not self.config.sequence_parallel:
            cpu_required.require("attention dropout (megatron's RNG tracker forks the CUDA generator)",
                                 f"llm_act core attention (layer {layer})")
            fork = tensor_parallel.get_cuda_rng_tracker().fork()
        with where, fork:
            out = attention(query, key, value, causal=causal, dropout_p=p, scale=scale,
                            backend=backend, codecs=use, report=report,
                            recompute_out=recompute_out,
                            lossy_backward=getattr(self, "act_lossy_backward", "auto"),
                            out_source=out_source)
        return out.reshape(out.shape[0], out.shape[1], self.hidden_size_per_partition)

    def _out_source(self, codecs: dict, wanted: bool) -> Optional[OutSource]:
        """Where the "stored" backward finds this forward's output when the output projection
        stores it encoded: an `OutSource` the projection's next record of `attn.out` fills
        (`act_record_tap`), or None (no linked projection encoding it, exact Q/K/V, or the
        "recompute" choice: backward then recomputes the output)."""
        linear = self._linked_linear()
        codec = codecs[ATTN_OUT]
        if (not wanted or linear is None or codec is None or codec.name == RECOMPUTE
                or codec is not linear.act_codecs.get(ATTN_OUT)
                or resolve_lossy_backward(getattr(self, "act_lossy_backward", "auto")) != "stored"
                or not any(is_lossy(codecs[s]) for s in QKV_SITES)):
            return None
        source = OutSource()

        def tap(site, record, replaces):
            enc = getattr(record, "enc", None)
            if site == ATTN_OUT and enc is not None and enc.codec == codec.name:
                source.offer(replaces, lambda: codec.decode(enc))

        linear.__dict__["act_record_tap"] = tap
        return source

    def extra_repr(self) -> str:
        return f"mode={self.act_attention!r}"
