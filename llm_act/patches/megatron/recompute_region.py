"""Where a layer's recomputation keeps its state between forward and backward.

`RegionFunction` is megatron's CheckpointFunction with its inputs kept or encoded (`RegionBox` holds
them, readable from outside the autograd context so a rebuild can read them too): stock
modules whose internals are sites -- the core attention, the whole block -- run in one.
`LayerFrame` is one forward of one layer: the values a rebuild reads, the RNG states it
replays and the cache of a group of consecutive recomputed sites, rebuilt once and held
until their own consumers take them (the transient of one group).

The layer's binder (`recompute.LayerRecompute`) creates both; they refer to it only as an
object (`owner.rebuild`, `owner.index`).
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from llm_act.codecs.registry import RECOMPUTE
from llm_act.patches.megatron.act_module import report_to_ledger
from llm_act.patches.megatron.recompute_codec import RecomputeOwner
from llm_act.patches.megatron.recompute_producers import PRODUCER_INPUTS
from llm_act.patches.megatron.rng_replay import capture_rng, recomputing, replay_rng
from llm_act.sites import ATTN_OUT, QKV_SITES

# ---- regions: megatron's CheckpointFunction with kept or encoded inputs --------------------------


class RegionBox:
    """What a region stored, readable from outside its autograd context (for rebuilds)."""

    def __init__(self, codecs: list, layer: Optional[int], sites: list):
        self.codecs, self.layer, self.sites = codecs, layer, sites
        self.stored: list = []
        self.rng: tuple = ()

    def store(self, tensors) -> None:
        seen: set[int] = set()
        for t, codec, site in zip(tensors, self.codecs, self.sites):
            if codec is None:
                st = t.untyped_storage()
                if site is not None and id(st) not in seen:
                    report_to_ledger(self.layer, site, t, st.nbytes())
                seen.add(id(st))
                self.stored.append(("raw", t))
            else:
                enc = codec.encode(t)
                if site is not None:
                    report_to_ledger(self.layer, site, enc, enc.nbytes, replaces=t)
                self.stored.append((codec, enc))

    def value(self, i: int) -> torch.Tensor:
        kind, item = self.stored[i]
        return item if kind == "raw" else kind.decode(item)


class RegionFunction(torch.autograd.Function):
    """out = run(*xs) under no_grad; xs stored by `box`; backward re-runs `rerun` with grad
    on the stored (decoded) copies under the recorded RNG states and backpropagates."""

    @staticmethod
    def forward(ctx, run, rerun, box, *xs):
        box.rng = capture_rng()
        with torch.no_grad():
            outs = run(*xs)
        box.store(xs)
        ctx.rerun, ctx.box = rerun, box
        ctx.needs = [x.requires_grad for x in xs]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        box = ctx.box
        inputs = [box.value(i).detach().requires_grad_(need) for i, need in enumerate(ctx.needs)]
        ctx.box = None
        with replay_rng(box.rng), torch.enable_grad(), recomputing():
            outs = ctx.rerun(*inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None) + tuple(x.grad if need else None for x, need in zip(inputs, ctx.needs))


# ---- one layer's forward state ------------------------------------------------------------------


class LayerFrame:
    """One forward of one layer: stored values, RNG states and the rebuild cache.

    It refers to the records and the attention box only weakly: their owners are the autograd
    contexts that store them, and the frame is itself referred to by those contexts (its
    tickets). A strong reference closes a cycle through the C++ graph that Python's collector
    cannot see, so a step that fails before its backward (an out-of-memory, say) would keep
    the whole graph alive for good -- 102 GiB on an H200 after one out-of-memory probe."""

    def __init__(self, owner: RecomputeOwner):
        self.owner = owner
        self.choice = dict(owner.choice)
        self.values: dict[str, Callable[[], torch.Tensor]] = {}
        self.cache: dict[str, torch.Tensor] = {}
        self.pending: set[str] = set()
        self.rng: dict[str, tuple] = {}
        self.attention: Optional[tuple] = None  # (weakref to box, call) of the core-attention region

    def value(self, site: str) -> torch.Tensor:
        if site in self.cache:
            return self.cache[site]
        if self.choice.get(site) == RECOMPUTE and site in PRODUCER_INPUTS:
            v = self.owner.rebuild(self, site)
            if site in self.pending:
                self.cache[site] = v
            return v
        getter = self.values.get(site)
        if getter is None:
            raise RuntimeError(
                f"layer {self.owner.index}: site {site!r} is needed to recompute "
                f"{sorted(self.pending)} but was not stored in forward")
        return getter()

    def take(self, site: str) -> torch.Tensor:
        v = self.value(site)
        self.pending.discard(site)
        self.cache.pop(site, None)
        self._trim()
        return v

    def _trim(self) -> None:
        """Drop what no pending rebuild needs any more (records stay alive only as needed)."""
        needed: set[str] = set()
        todo = [s for s in self.pending if self.choice.get(s) == RECOMPUTE]
        while todo:
            s = todo.pop()
            for i in PRODUCER_INPUTS.get(s, ()):
                if i not in needed:
                    needed.add(i)
                    if self.choice.get(i) == RECOMPUTE:
                        todo.append(i)
        for table in (self.values, self.cache):
            for s in [s for s in table if s not in needed and s not in self.pending]:
                del table[s]
        if not (needed & set(QKV_SITES)) and ATTN_OUT not in needed:
            self.attention = None


def alive_object(ref: "weakref.ref", layer: int, site: str):
    """The object behind `ref`; its autograd context keeps it until its own backward, which
    comes after every rebuild that reads it."""
    obj = ref()
    if obj is None:
        raise RuntimeError(f"layer {layer}: the record of {site!r} was freed before a rebuild read it "
                           "(its backward already ran); please report this plan")
    return obj
