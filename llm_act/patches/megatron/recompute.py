"""Recomputation in backward: the choice "recompute" for a site of a megatron-core block.

A recomputed site is one its consumer keeps *nothing* of: in backward the tensor is rebuilt
by re-running its producer (`recompute_producers.producer_of`) back to the nearest stored
tensor. `LayerRecompute` binds a layer's {site: choice} to its modules. A consumer that is a
compressed module (`ActModule`) gets `SiteRecompute` as its codec (`recompute_codec`); the
layer's per-forward frame (`recompute_region.LayerFrame`) rebuilds under `torch.no_grad()` (the
consumer's backward needs only the value), re-entering every module through `__call__` (so
hooks fire and ZeRO-3 gathers), with megatron's RNG states replayed (`rng_replay`) so a
dropout draws the same mask.

Stock modules whose internals are sites use a *region* (`recompute_region.RegionFunction`:
megatron's CheckpointFunction with its inputs kept or encoded): the core attention
(`attn.softmax`, `attn.dropout_mask` recomputed: Megatron's "selective", q/k/v stored per
their choices) and the whole block ("full": every site but `ln1.input` recomputed, GACT's
CB1: the block input kept or encoded, and backward re-runs the block from its decoded copy
at full precision). `attn.q/k/v` and the qk-layernorm inputs are recomputed only with the
whole block. Masks chosen "recompute" are regenerated from the recorded generator state
(the `regen` codec).

A recomputed region holds collectives under tensor parallelism: every rank of a TP group
must bind the same choices.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Mapping, Optional

import torch

from llm_act.codecs.base import Codec
from llm_act.codecs.registry import KEEP, RECOMPUTE, check_choice
from llm_act.layer_contract import LayerBinder, binder_of
from llm_act.patches.megatron.recompute_codec import SiteRecompute, VisibleKeep
from llm_act.patches.megatron.recompute_producers import MOE_FULL_ONLY, PRODUCER_INPUTS, producer_of
from llm_act.patches.megatron.recompute_region import LayerFrame, RegionBox, RegionFunction, alive_object
from llm_act.patches.megatron.rng_replay import capture_rng, is_recomputing, recomputing, replay_rng
from llm_act.sites import (
    ATTENTION_INTERNAL_SITES,
    ATTN_HIDDEN_DROPOUT_MASK,
    ATTN_OUT,
    CHECKPOINT_SITE,
    DENSE_MLP_SITES,
    LN2_INPUT,
    MASK_SITES,
    MLP_ACT_INPUT,
    MODEL_SITES,
    MOE_SITES,
    QKV_SITES,
    QK_NORM_SITES,
    SITES,
)
from llm_act.patches.megatron.mlp import activation_of
from llm_act.patches.megatron.model_shape import shape_of_config
from llm_act.planner.model_shape import ModelShape

#: sites a layer may lack (no qk-layernorm; a dense MLP or an MoE layer, not both)
OPTIONAL_SITES = frozenset(QK_NORM_SITES) | frozenset(DENSE_MLP_SITES) | frozenset(MOE_SITES)


def is_full(choice: Mapping[str, str], absent: frozenset = frozenset()) -> bool:
    """Whether `choice` recomputes every site but the block input (and the `absent` sites, which
    the layer does not have: the qk-layernorm inputs of a block without them; and the sites
    after the blocks, `MODEL_SITES`, which no layer stores)."""
    return all(choice.get(s, KEEP) == RECOMPUTE for s in SITES
               if s != CHECKPOINT_SITE and s not in absent and s not in MODEL_SITES)


class LayerRecompute(LayerBinder):
    """Binds a layer's {site: choice} to its modules, recomputation included (the runtime's
    `llm_act.layer_contract.LayerBinder`).

    `sites`: what `swap.convert_layer` returned (site -> the module that stores it).
    `codec_names(choice)` says which codec each site needs under `choice`; the owner of the
    plan (the Controller) builds those once and pushes them down with `bind(choice, codecs)`,
    which sets every module's codec and installs the hooks a plan with "recompute" needs; a
    plan without any leaves the layer exactly as the plain codec assignment would. The layer
    never calls back for a codec.
    """

    def __init__(self, layer: torch.nn.Module, sites: Mapping[str, Any], index: int):
        self.layer, self.sites, self.index = layer, dict(sites), index
        self.choice: dict[str, str] = {s: KEEP for s in SITES}
        self.frame: Optional[LayerFrame] = None
        self.mode = "none"  # "none" | "sites" | "full"
        self._handles: list = []
        self._checkpoint_codec: Optional[Codec] = None
        self._qkv_codecs: list = [None, None, None]
        self._attention_region = False
        for module in self.sites.values():
            module.act_binder = self  # how the runtime finds it (`layer_contract.binder_of`)

    # ---- binding ------------------------------------------------------------------------
    def codec_names(self, choice: Mapping[str, str]) -> dict[str, str]:
        """{site: codec name} of the codecs `bind(choice, ...)` needs: the checkpoint's under
        full recompute; otherwise every encoded site of this layer (q/k/v included) and the
        `regen` codec of every recomputed dropout mask outside the core attention (whose
        region replays the RNG state instead)."""
        choice = self._checked(choice)
        if is_full(choice, self._absent):
            name = choice[CHECKPOINT_SITE]
            return {} if name == KEEP else {CHECKPOINT_SITE: name}
        self._validate(choice, self._recomputed(choice))  # refuse here, first
        out = {}
        for site in list(self.sites) + [s for s in QKV_SITES if s not in self.sites]:
            name = choice[site]
            if name == RECOMPUTE and site in ATTENTION_INTERNAL_SITES:
                continue  # the core-attention region re-runs them (its RNG replayed)
            if name == RECOMPUTE and site in MASK_SITES:
                out[site] = "regen"
            elif name not in (KEEP, RECOMPUTE):
                out[site] = name
        return out

    @property
    def _absent(self) -> frozenset:
        """Optional sites a plan names and this layer does not have (the qk-layernorm inputs of
        a block without them, the dense MLP's of a MoE block): no part of it (`is_full`)."""
        return OPTIONAL_SITES - set(self.sites)

    def _recomputed(self, choice: Mapping[str, str]) -> set[str]:
        """The sites of this layer that `choice` recomputes (whatever it names at `_absent` ones:
        a plan leaving whole-block recompute still says "recompute" there)."""
        absent = self._absent
        return {s for s, c in choice.items() if c == RECOMPUTE and s not in absent}

    @staticmethod
    def _checked(choice: Mapping[str, str]) -> dict[str, str]:
        choice = {s: choice.get(s, KEEP) for s in SITES}
        for s, name in choice.items():
            check_choice(s, name)
        return choice

    def bind(self, choice: Mapping[str, str], codecs: Mapping[str, Codec]) -> None:
        """Bind `choice` with `codecs` (site -> codec, for every site of `codec_names(choice)`)."""
        choice = self._checked(choice)
        recomputed = self._recomputed(choice)
        full = is_full(choice, self._absent)
        if not full:
            self._validate(choice, recomputed)  # before anything changes
        self._unhook()
        self.choice = choice
        if full:
            self._bind_full(choice, codecs)
            return
        self._attention_region = bool(recomputed & set(ATTENTION_INTERNAL_SITES))
        needed = set()
        for s in recomputed:
            needed.update(PRODUCER_INPUTS.get(s, ()))
        self._needed = needed
        # Under the core-attention region the converted core attention (`ActCoreAttention`,
        # which `apply` always makes) stores nothing itself: the region's box stores q/k/v
        # (`_qkv_codecs`) and its backward re-runs the attention with grad, which must take
        # the path of the forward it repeats (that one ran under no_grad: no codec at all).
        # A site codec there would make that re-run store again: `SiteRecompute` at
        # attn.softmax asks for a frame that backward has not opened (it raised), and q/k/v
        # codecs (or `VisibleKeep`) send it down the unfused path re-encoding the decoded q/k/v.
        # (A stock DotProductAttention -- the benches' `convert_attention=False` -- has no
        # sites here, which is why binding one layer that way worked.)
        region = set(QKV_SITES) | set(ATTENTION_INTERNAL_SITES) if self._attention_region else set()
        for site, module in self.sites.items():
            name = choice[site]
            if site in region:
                codec = None
            elif name == RECOMPUTE:
                codec = codecs[site] if site in MASK_SITES else SiteRecompute(self, site)
            elif name == KEEP:
                codec = VisibleKeep() if site in needed else None
            else:
                codec = codecs[site]
            module.set_act_codec(site, codec)
        self._qkv_codecs = [None if choice[s] == KEEP else codecs[s] for s in QKV_SITES]
        self.mode = "sites" if (recomputed - MASK_SITES) else "none"
        if self.mode == "sites":
            self._hook_sites()

    def _validate(self, choice: Mapping[str, str], recomputed: set) -> None:
        where = f"layer {self.index}"
        qkv = recomputed & set(QKV_SITES + QK_NORM_SITES)
        if qkv:
            raise NotImplementedError(
                f"{where}: {sorted(qkv)} can be recomputed only with the whole block (plan "
                "'full': every site but ln1.input recomputed); keep or encode them")
        dispatched = recomputed & set(MOE_FULL_ONLY) & set(self.sites)
        if dispatched:
            raise NotImplementedError(
                f"{where}: {sorted(dispatched)} come out of the MoE token dispatcher and can be "
                "recomputed only with the whole block (plan 'full'); keep or encode them")
        inner = recomputed & set(ATTENTION_INTERNAL_SITES)
        if inner and inner != set(ATTENTION_INTERNAL_SITES):
            raise ValueError(
                f"{where}: the core attention is recomputed as a whole: choose 'recompute' for "
                f"both attn.softmax and attn.dropout_mask, got {dict((s, choice[s]) for s in ATTENTION_INTERNAL_SITES)}")
        if ATTN_OUT in recomputed and not inner:
            raise ValueError(
                f"{where}: recomputing 'attn.out' re-runs the core attention from q, k, v: "
                "recompute attn.softmax and attn.dropout_mask too (the 'selective' region)")
        for s in recomputed & set(PRODUCER_INPUTS):
            if s not in self.sites and s in OPTIONAL_SITES:
                continue  # the other MLP family's site (a dense layer beside MoE layers)
            if s not in self.sites and s not in (ATTN_OUT,):
                raise ValueError(f"{where}: site {s!r} does not exist in this layer")
            for i in PRODUCER_INPUTS[s]:
                if not self._value_available(i, choice[i]):
                    raise ValueError(
                        f"{where}: recomputing {s!r} needs the value of {i!r}, but {i!r} = "
                        f"{choice[i]!r} stores no value (choose keep, recompute or a value codec)")
        if (LN2_INPUT in recomputed and getattr(self.layer.config, "bias_dropout_fusion", False)
                and choice[ATTN_HIDDEN_DROPOUT_MASK] != KEEP and self.layer.hidden_dropout > 0):
            raise ValueError(
                f"{where}: recomputing 'ln2.input' with config.bias_dropout_fusion=True needs "
                "attn.hidden_dropout_mask kept (the fused and eager dropouts draw differently)")

    def _value_available(self, site: str, name: str) -> bool:
        if name in (KEEP, RECOMPUTE):
            if site == MLP_ACT_INPUT and name == KEEP:
                return self.mlp_kind() != "mask"
            return True
        if name.startswith("fewbit"):
            return False
        return not (site == MLP_ACT_INPUT and self.mlp_kind() == "mask")

    def mlp_kind(self) -> str:
        """The MLP activation's kind, "fewbit", "mask" (ReLU) or "value" (`mlp.activation_of`)."""
        return activation_of(self.layer.mlp.config)[0]

    def recompute_scope(self) -> str:
        """"sites": single sites from what the layer keeps, or the whole layer."""
        return "sites"

    def producer(self, site: str) -> Optional[Callable[..., torch.Tensor]]:
        """The layer's producer of `site` (`recompute_producers.producer_of`): what `rebuild` runs."""
        return producer_of(self.layer, site)

    def model_shape(self, *, count: int, seq_length: int, micro_batch: int, dtype: str,
                    position_embedding: str, attention: str) -> ModelShape:
        """The layer's TransformerConfig as the analytic model (`model_shape.shape_of_config`)."""
        return shape_of_config(self.layer.config, count=count, seq_length=seq_length, micro_batch=micro_batch,
                               dtype=dtype, position_embedding=position_embedding, attention=attention)

    def _bind_full(self, choice: Mapping[str, str], codecs: Mapping[str, Codec]) -> None:
        for site, module in self.sites.items():
            module.set_act_codec(site, None)  # the block re-runs stock, at full precision
        name = choice[CHECKPOINT_SITE]
        self._checkpoint_codec = None if name == KEEP else codecs[CHECKPOINT_SITE]
        self.mode = "full"
        layer = self.layer
        stock = type(layer).forward.__get__(layer)
        layer.forward = self._make_full_forward(stock)
        self._handles.append(("forward", layer))

    def _hook_sites(self) -> None:
        layer = self.layer
        self._handles.append(layer.register_forward_pre_hook(self._open))
        self._handles.append(layer.register_forward_hook(self._close, always_call=True))
        for module in self.sites.values():
            module.act_record_sink = self._on_record
        self._handles.append(("sink", list(self.sites.values())))
        if self.choice[LN2_INPUT] == RECOMPUTE:
            proj = layer.self_attention.linear_proj
            self._handles.append(proj.register_forward_pre_hook(self._capture_proj_rng))
        if self._attention_region:
            core = layer.self_attention.core_attention
            stock = type(core).forward.__get__(core)
            core.forward = self._make_attention_forward(core, stock)
            self._handles.append(("forward", core))

    def _unhook(self) -> None:
        for h in self._handles:
            if isinstance(h, tuple) and h[0] == "forward":
                h[1].__dict__.pop("forward", None)
            elif isinstance(h, tuple) and h[0] == "sink":
                for m in h[1]:
                    m.__dict__.pop("act_record_sink", None)
            else:
                h.remove()
        self._handles = []
        self.frame = None
        self.mode = "none"
        self._checkpoint_codec = None
        self._attention_region = False

    # ---- forward-time capture -----------------------------------------------------------------
    def _active(self) -> bool:
        return self.layer.training and torch.is_grad_enabled() and not is_recomputing()

    def _open(self, module, args) -> None:
        self.frame = LayerFrame(self) if self._active() else None

    def _close(self, module, args, output) -> None:
        self.frame = None

    def _on_record(self, site: str, record) -> None:
        frame = self.frame
        if frame is None or site not in self._needed or frame.choice.get(site) == RECOMPUTE:
            return
        module = self.sites[site]
        codec = module.act_codecs.get(site)
        if codec is None or record.enc.codec != codec.name:
            return  # not a value record (e.g. a ReLU's 1-bit mask)
        ref = weakref.ref(record)
        frame.values[site] = lambda: codec.decode(alive_object(ref, self.index, site).enc)

    def _capture_proj_rng(self, module, args) -> None:
        if self.frame is not None:
            self.frame.rng[LN2_INPUT] = capture_rng()

    # ---- rebuilding ---------------------------------------------------------------------------
    def rebuild(self, frame: LayerFrame, site: str) -> torch.Tensor:
        """The value `site` had in the forward of `frame`, recomputed (no graph): its producer
        (`producer`) on its inputs' values in `frame`, under the RNG state the forward drew
        it with where it draws (`ln2.input`'s hidden dropout); `attn.out` by the call the
        core-attention region recorded."""
        with torch.no_grad(), recomputing():
            if site == ATTN_OUT:
                return self._rebuild_attention(frame)
            make = self.producer(site)
            if make is None:
                raise ValueError(f"site {site!r} has no producer that llm_act can re-run")
            inputs = [frame.value(s) for s in PRODUCER_INPUTS[site]]
            rng = frame.rng.get(site)
            with replay_rng(rng) if rng is not None else contextlib.nullcontext():
                return make(*inputs)

    def _rebuild_attention(self, frame: LayerFrame) -> torch.Tensor:
        """`attn.out`: the core-attention call the region recorded in forward (its mask
        arguments bound), re-run on the region's q, k, v under the region's RNG state."""
        if frame.attention is None:
            raise RuntimeError(f"layer {self.index}: the core-attention region was not recorded")
        box, call = alive_object(frame.attention[0], self.index, ATTN_OUT), frame.attention[1]
        qkv = [box.value(i) for i in range(3)]
        with replay_rng(box.rng):
            return call(*qkv)

    # ---- regions ------------------------------------------------------------------------------
    def _make_attention_forward(self, core, stock):
        owner = self

        def forward(query, key, value, *args, **kwargs):
            if not owner._active() or not any(t.requires_grad for t in (query, key, value)):
                return stock(query, key, value, *args, **kwargs)

            def run(q, k, v):
                return stock(q, k, v, *args, **kwargs)

            def call(q, k, v):  # through __call__: hooks fire; is_recomputing() -> stock
                with recomputing():
                    return core(q, k, v, *args, **kwargs)

            box = RegionBox(list(owner._qkv_codecs), owner.index, list(QKV_SITES))
            out = RegionFunction.apply(run, lambda q, k, v: (call(q, k, v),), box, query, key, value)
            if owner.frame is not None:
                ref = weakref.ref(box)
                owner.frame.attention = (ref, call)
                owner.frame.values.update({s: (lambda i=i, s=s: alive_object(ref, owner.index, s).value(i))
                                           for i, s in enumerate(QKV_SITES)})
            return out

        return forward

    def _make_full_forward(self, stock):
        owner = self
        layer = self.layer

        def forward(*args, **kwargs):
            if not owner._active():
                return stock(*args, **kwargs)
            if args:
                hidden, rest = args[0], args[1:]
            else:
                kwargs = dict(kwargs)
                hidden, rest = kwargs.pop("hidden_states"), ()
            for k, v in kwargs.items():
                if torch.is_tensor(v) and v.requires_grad:
                    raise NotImplementedError(
                        f"full recompute of layer {owner.index}: argument {k!r} requires grad; "
                        "only the hidden states may carry gradients into a recomputed block")
            context = []

            def run(h):
                out, ctx_out = stock(h, *rest, **kwargs)
                context.append(ctx_out)
                return out

            def rerun(h):
                with recomputing():
                    return (layer(h, *rest, **kwargs)[0],)

            box = RegionBox([owner._checkpoint_codec], owner.index, [CHECKPOINT_SITE])
            out = RegionFunction.apply(run, rerun, box, hidden)
            if context and context[0] is not None:
                raise NotImplementedError(f"full recompute of layer {owner.index}: cross-attention context")
            return out, None

        return forward


def bind_with(owner: LayerRecompute, choice: Mapping[str, str], codec_of: Callable[[str, str], Codec]) -> None:
    """`owner.bind(choice, codecs)` with the codecs `codec_of(site, name)` builds (benches
    and tests that bind a layer without a Controller)."""
    owner.bind(choice, {s: codec_of(s, n) for s, n in owner.codec_names(choice).items()})


def for_sites(sites: Mapping[str, Any]) -> Optional[LayerRecompute]:
    """The LayerRecompute that owns the modules `sites` (what convert_layer returned)."""
    for module in sites.values():
        owner = binder_of(module)
        if owner is not None:
            return owner
    return None
