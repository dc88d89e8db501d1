"""The protocol every compressed megatron-core module follows (`ActModule` mixin).

A compressed module is a stock megatron-core module whose class was swapped in place
(`Cls.from_stock(module)`), so parameters and state_dict keys stay the stock ones. It
stores one or more *sites* (names from `llm_act.sites`); the Controller hands each site a
shared codec instance (or None = "keep"). With every codec None, under `torch.no_grad()`
or in eval mode the module runs the stock code path: same math, same op order, same RNG
consumption. Modules never build codecs: the Controller owns them (one generator state).
"""
from __future__ import annotations

from typing import Any

import torch

from llm_act import ledger
from llm_act.codecs.base import Codec
from llm_act.patches.megatron.recompute_codec import VisibleKeep
from llm_act.sites import check_site


class ActModule:
    """Mixin: site -> codec table, the stock/compressed switch and ledger reporting."""

    #: the sites this module stores (an instance may narrow it, e.g. one linear = one site)
    ACT_SITES: tuple[str, ...] = ()
    #: `layer_contract.SiteModule`: no MLP activation (ActMLP says its own) and no core
    #: attention (ActCoreAttention has its mode) unless a subclass holds one
    act_activation: str | None = None
    act_attention: str | None = None

    def set_attention_mode(self, mode: str) -> None:
        """Nothing: this module holds no core attention (`ActCoreAttention` overrides it)."""

    # ---- conversion --------------------------------------------------------------------
    @classmethod
    def from_stock(cls, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """Turn a stock instance into `cls` in place (parameters untouched) and return it."""
        stock = [b for b in cls.__bases__ if not issubclass(b, ActModule)]
        if stock and not isinstance(module, tuple(stock)):
            raise TypeError(
                f"{cls.__name__}.from_stock needs a {stock[0].__name__}, "
                f"got {type(module).__name__}"
            )
        module.__class__ = cls
        cls._act_init(module, **kwargs)
        return module

    def _act_init(self, **kwargs: Any) -> None:
        """Initialise the act_* fields (also called by apply after a class swap)."""
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}._act_init got unexpected arguments {sorted(kwargs)}"
            )
        self.act_layer: int | None = getattr(self, "act_layer", None)
        self.act_codecs: dict[str, Codec | None] = {s: None for s in self.ACT_SITES}

    # ---- the codec table ---------------------------------------------------------------
    #: sites an instance built without a site (e.g. from a ModuleSpec) may be bound to by
    #: its first `set_act_codec` (one class serving several sites: linears, norms)
    ACT_BINDABLE: tuple[str, ...] = ()

    def set_act_codec(self, site: str, codec: Codec | None) -> None:
        check_site(site)
        if not self.ACT_SITES and site in self.ACT_BINDABLE:
            self.ACT_SITES = (site,)
            self.act_site = site
            self.act_codecs = {site: None}
        if site not in self.ACT_SITES:
            raise ValueError(
                f"{type(self).__name__} stores sites {self.ACT_SITES}, not site {site!r}"
            )
        if codec is not None and not isinstance(codec, Codec):
            raise TypeError(f"codec for site {site!r} must be a Codec or None, got {codec!r}")
        self.act_codecs[site] = codec

    def act_codec(self, site: str, *tensors: torch.Tensor | None,
                  stores: torch.Tensor | tuple | None = None) -> Codec | None:
        """The codec to use for `site` in this forward, or None for the stock path.

        None under torch.no_grad(), in eval mode, when the site is kept, or when none of
        `tensors` (if given: the op's differentiable inputs) requires grad. Never more than
        stock: with `stores` (the tensor the site would encode, or its (shape, dtype)),
        also None where the codec's size formula stores more bytes than `stores`
        raw (`Codec.within_raw`); the site then runs the stock path, whose raw bytes the
        ledger books at the site, and `act_kept[site]` counts the eager forwards that kept
        it (`count_kept`; under a layer's recomputation the kept tensor is handed over as a
        record).
        """
        if not (self.training and torch.is_grad_enabled()):
            return None
        if tensors and not any(t is not None and t.requires_grad for t in tensors):
            return None
        codec = self.act_codecs.get(site)
        if codec is not None and stores is not None and not codec_within_raw(codec, stores):
            count_kept(self, site)
            if getattr(self, "act_record_sink", None) is not None:
                # a recomputation may rebuild a later site from this one's record: keep x
                # itself through the compressed path (the bytes stock keeps)
                return VisibleKeep()
            return None
        return codec

    def act_compressing(self) -> bool:
        """True when at least one site of this module is encoded in this forward."""
        return any(self.act_codec(s) is not None for s in self.ACT_SITES)

    # ---- ledger ------------------------------------------------------------------------
    def act_report(self, site: str, record, nbytes: int, replaces: torch.Tensor | None = None) -> None:
        """Tell the active ledgers that `site` of this layer stores `record` (`nbytes`), and
        the layer's recomputation (`act_record_sink`, set by `recompute.LayerRecompute`),
        which may rebuild a later site from this record in backward, and a one-shot
        `act_record_tap(site, record, replaces)` (set for one forward by the core attention,
        whose backward reads the output projection's record of its output)."""
        report_to_ledger(self.act_layer, site, record, nbytes, replaces)
        sink = getattr(self, "act_record_sink", None)
        if sink is not None:
            sink(site, record)
        tap = self.__dict__.pop("act_record_tap", None)
        if tap is not None:  # one forward's consumer of the record (e.g. the core attention)
            tap(site, record, replaces)


def count_kept(module: torch.nn.Module, site: str) -> None:
    """Count a forward in which `site` of `module` was kept because its codec would store
    more than stock (`module.act_kept[site]`). Eager forwards only: under torch.compile a
    Python counter that changes every call would be a guard that fails every call (a
    recompile per step), so compiled forwards are not counted."""
    if torch.compiler.is_compiling():
        return
    kept = module.__dict__.setdefault("act_kept", {})
    kept[site] = kept.get(site, 0) + 1


def codec_within_raw(codec: Codec, x) -> bool:
    """Whether `codec` stores no more bytes for `x` (a tensor, or its (shape, dtype)) than `x`
    raw, from the codec's size formula (no trial encode). A dropout mask is priced as
    what stock stores: `dtype=torch.bool` for a bool mask, the noise's dtype on CPU."""
    shape, dtype = (x.shape, x.dtype) if isinstance(x, torch.Tensor) else x
    return _within_raw(codec, tuple(int(s) for s in shape), dtype)


@torch.compiler.assume_constant_result
def _within_raw(codec: Codec, shape: tuple, dtype: torch.dtype) -> bool:
    # Python arithmetic on the shape alone: under torch.compile (static shapes) dynamo calls
    # it once while tracing and keeps the answer as a constant, guarded on the codec's
    # identity (a plan switch binds new codecs: a recompile, never a stale answer)
    return codec.within_raw(shape, dtype)


def report_to_ledger(layer, site: str, record, nbytes: int, replaces=None) -> None:
    """Count `record` (an `Encoded` or an object with a `.data` dict of tensors, held by
    the autograd context until backward) at (layer, site) in every active ledger.

    `replaces` is the raw tensor the record stands for. A no-op without an active ledger.
    """
    ledger.report(layer, site, record, int(nbytes), replaces=replaces)
