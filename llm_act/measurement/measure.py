"""The measured profile: what each site of a converted megatron-core model really stores and
costs, on the current batch, for the planner (Adacc sec. 3.3-3.4).

`measure_profile(controller, forward)` runs the model (`forward()` = one forward over the
current batch, returning the loss) in isolated probe passes (`llm_act.measurement.probing`: RNG
streams, gradients and the real codecs untouched):

1. every site kept, under a `SavedTensorLedger`: the bytes "keep" stores per site (what
   stock megatron-core saves there, norm statistics and dropout noise included) and the
   bytes nobody plans (`other_bytes`: embeddings, logits, attention internals);
2. a capture codec at every site: the real tensor each site stores, and, from the ledger,
   the exact side tensors the compressed path keeps beside the encoding (a norm's mean
   and rstd);
3. on those tensors, every codec the site admits: its stored bytes (the size formula at the
   tensor's shape, `nbytes_for`: every codec's size depends on the shape alone), its error model (`expected_error`, relative to the tensor's
   power: S of GACT sec. 4, in the units of the analytic prior) -- errors and outlier
   channels on a sample of the tensor's token rows (`token_sample`, sparse sampling keeps
   a tracking point cheap) -- its encode and decode times; and the time of each site's
   producer op (the cost of recomputing it), from the capture forward or by re-running the
   layer's own producer (`LayerBinder.producer`) on its captured inputs.

Times: CUDA events on a GPU, wall clock on CPU, medians of a few runs; only their ratios
within one run mean anything. They are taken on the first layer of each group of
identical layers (the same ops on the same shapes), each codec once per shape on a GPU (on
the whole tensor) and once per codec on CPU (on a sample, scaled by the size: the
reference codecs' time is linear in it), and carried over from an earlier profile
(`times_from`): the controller times them once, at the first tracking point, and keeps them
with the profile; later points re-measure only the data-dependent figures (errors, outlier
rates).

`profile_from_samples(controller, samples, last)` rebuilds the profile of a later tracking
iteration with no pass of its own, from the samples its training step took
(`llm_act.measurement.step_tap`) and the last full profile's bytes and times.

`MeasuredProfile.blocks()` gives the `BlockProfile`s for `solve_plan` (identical layers
share one block with `count` = their number, bytes averaged so that the total over the
layers is exact); `predicted_bytes(plan)` the bytes a plan would hold.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Collection, Optional, Sequence

import torch

from llm_act import sites as schema  # BLOCK and its tables, as `declare` leaves them
from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.fewbit import derivative
from llm_act.codecs.registry import CODEC_NAMES, FEWBIT_CODECS, MASK_CODECS, make_codec
from llm_act.ledger import OTHER, SavedTensorLedger
from llm_act.measurement import probing
from llm_act.measurement.controlled import ControlledModel
from llm_act.measurement.measured_profile import BLOCK_TIME, MeasuredProfile, OptionStats, SiteStats
from llm_act.measurement.step_tap import CORE_ARG_NAMES, input_arg, power_tensor, submodule, token_sample
from llm_act.sites import (
    ATTN_OUT,
    ATTN_Q,
    ATTN_QKV_INPUT,
    MLP_ACT_INPUT,
)

_MEASURE_SEED = 20240611


# ---- capture ---------------------------------------------------------------------------------


class _Capture(Codec):
    """A lossless probe: 'encodes' by keeping x itself and remembers it for measurement: the
    first tensor of its site in `sink`, any further one of the same forward in `more` (a
    generic block's site can hold several: an RMSNorm's input and its normalised copy, a gated
    unit's three operands; the hooks encode each with the site's codec)."""

    lossless = True
    name = "capture"

    def __init__(self, sink: dict, key: tuple[int, str], more: Optional[dict] = None):
        super().__init__(seed=0)
        self.sink, self.key, self.more = sink, key, more

    def check_input(self, x: torch.Tensor) -> None:  # dropout masks arrive as bool
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"capture: expected a tensor, got {type(x).__name__}")

    def _encode(self, x: torch.Tensor) -> Encoded:
        if self.more is not None and self.key in self.sink:
            self.more.setdefault(self.key, []).append(x)
        else:
            self.sink[self.key] = x
        return self._record(x, value=x)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.data["value"]

    def nbytes_for(self, shape, dtype) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=None)
def _codec(name: str, activation: str) -> Codec:
    """One measuring instance per codec (never the controller's: its generators stay)."""
    return make_codec(name, seed=_MEASURE_SEED, activation=activation)


def site_codec_names(controller: ControlledModel, layer: int, site: str, x: torch.Tensor) -> list[str]:
    """The codecs `site` of `layer` admits: what the layer accepts (`controller.accepts`, the
    schema's rule: few-bit codecs only where the MLP's derivative depends on x alone), mask
    codecs on boolean masks."""
    names = []
    for name in CODEC_NAMES:
        if not controller.accepts(layer, site, name):
            continue
        if (name in MASK_CODECS) != (x.dtype == torch.bool):
            continue
        names.append(name)
    return names


def _activation_name(controller: ControlledModel, layer: int) -> str:
    try:
        name = controller.module(layer, MLP_ACT_INPUT).act_activation
    except KeyError:
        name = None
    return name if isinstance(name, str) else "gelu"


def _power(x: torch.Tensor) -> float:
    """Mean of x^2 over the finite elements (float64); 1 for an all-zero tensor."""
    return float(power_tensor(x)) or 1.0


def derivative_power(x: torch.Tensor, activation: str) -> float:
    """Mean of f'(x)^2: the power of what a few-bit codec stores."""
    return _power(derivative(activation)(x.detach().float()))


def _nbytes(codec: Codec, x: torch.Tensor) -> int:
    """Stored bytes of `codec` on `x`: its size formula at x's shape (every codec's size
    depends on the shape alone: outlier_int4 keeps a fixed number of slots), else a trial
    encode."""
    try:
        return codec.nbytes_for(x.shape, x.dtype)
    except (NotImplementedError, TypeError):
        return codec.encode(x).nbytes


def _errors(codec: Codec, name: str, xs: torch.Tensor, power: float, dpower: float) -> tuple[float, float]:
    """(expected squared error per element, relative error S) of `codec` on `xs`: the codec's
    error model, analytic (no encode), over the power of what it stores."""
    err = 0.0 if codec.lossless else float(codec.expected_error(xs))
    return err, err / (dpower if name in FEWBIT_CODECS else power)


def _option(codec: Codec, name: str, x: torch.Tensor, xs: torch.Tensor, side: int, power: float,
            dpower: float, timed: bool, repeats: int, clock: Optional[dict] = None) -> OptionStats:
    """`codec` on site tensor `x`: bytes on all of it, errors on its sample `xs` (on all of
    it for a per-channel codec, whose scales span the rows), times when
    `timed` (on a GPU on all of it; on CPU, where the reference codecs' time is linear in the
    size, on the sample, scaled up by the size ratio), each (codec, shape, dtype) once per
    profile (`clock`: the times taken so far; the same op on the same shape)."""
    if name == "regen":
        nbytes = codec.nbytes_for(x.shape, x.dtype, device=x.device)
        st = OptionStats(nbytes + side, 0.0, 0.0)
        if timed:  # backward draws the mask again
            st.decode_ms = probing.time_ms(lambda: torch.rand(x.shape, device=x.device) >= 0.5,
                                           x.device, repeats)
        return st
    if getattr(codec, "axis", None) is not None:
        # one scale per channel over every token row: a sample of the rows sees a smaller
        # range than the whole tensor holds, and so a smaller error than the codec makes
        xs = x
    err, rel = _errors(codec, name, xs, power, dpower)
    st = OptionStats(_nbytes(codec, x) + side, err, rel)
    if timed:
        gpu = x.device.type == "cuda"
        tx = x if gpu else xs
        scale = x.numel() / max(1, tx.numel())
        # a GPU kernel's time is its own at each shape; a CPU reference's is linear in the
        # size: one timing of a sample per codec, scaled to each site's size
        key = (name, tuple(x.shape) if gpu else None, x.dtype)
        if clock is not None and key in clock:
            per_elem = clock[key]
            st.encode_ms, st.decode_ms = per_elem[0] * x.numel(), per_elem[1] * x.numel()
            return st
        full = codec.encode(tx)
        st.encode_ms = scale * probing.time_ms(lambda: codec.encode(tx), x.device, repeats)
        st.decode_ms = scale * probing.time_ms(lambda: codec.decode(full), x.device, repeats)
        if clock is not None:
            clock[key] = (st.encode_ms / x.numel(), st.decode_ms / x.numel())
    return st


def measure_profile(controller: ControlledModel, forward: Callable[[], Any], *,
                    times_from: Optional[Any] = None, repeats: int = 3,
                    codecs: Optional[Sequence[str]] = None,
                    keep_from: Optional[MeasuredProfile] = None,
                    every_layer: Optional[Sequence[str]] = None,
                    all_codecs_at: Collection[tuple[int, str]] = (),
                    any_rank: Callable[[bool], bool] = bool) -> MeasuredProfile:
    """Measure every site the controller drives on the batch `forward()` runs (see the module
    docstring). `times_from`: reuse the times of that profile or of its `times()` dict
    (same model and shapes) instead of measuring them;
    `codecs`: restrict the codecs measured (default: all the registry admits);
    `every_layer`: the codecs whose errors are measured on every layer; the others on the
    first layer of each group of identical layers, their figures copied to the rest (the
    adapter refreshes them layer by layer later: `profile_from_samples`); default: every
    codec on every layer; `all_codecs_at`: (layer, site) pairs measured for every codec
    whatever `codecs` says;
    `keep_from`: an earlier profile whose keep bytes (and bytes outside the sites) are
    taken where every site has the same shape and dtype again -- they depend on nothing
    else -- so the keep-everything pass is skipped; `any_rank`: whether a rank-local finding
    holds on any rank measuring beside this one (`agreement.any_rank`): where one rank's
    shapes moved, every rank runs the keep pass, whose forward holds collectives."""
    if not callable(forward):
        raise TypeError(f"forward: expected a callable running one forward pass, got {forward!r}")
    if not controller.layers:
        raise ValueError("controller: it drives no layer; nothing to measure")
    captured: dict[tuple[int, str], torch.Tensor] = {}
    more: dict[tuple[int, str], list[torch.Tensor]] = {}
    after: dict[str, int] = {}  # the bytes outside the sites at the end of the last block's forward
    groups_first = set()
    block_ms: dict[int, float] = {}
    module_ms: dict[tuple[int, str], float] = {}
    with probing.isolated(controller) as snap, torch.enable_grad():
        probing.install(controller, {})
        # the profile describes the attention every non-keep plan runs (memory-efficient
        # unless ActConfig.attention names another backend): no softmax is stored there
        wanted = controller.config.attention
        controller.set_attention_mode("auto" if wanted == "auto" else wanted)

        def keep_pass() -> dict:
            with SavedTensorLedger() as keep_ledger:
                handle = _after_the_blocks(controller, keep_ledger, after)
                try:
                    out = forward()
                finally:
                    handle.remove()
            del out
            snap.restore()
            return keep_ledger.by_site()

        keep = None if keep_from is not None else keep_pass()
        probes = {(layer, site): _Capture(captured, (layer, site), _more_of(controller, layer, site, more))
                  for layer in controller.layers for site in controller.sites(layer)
                  if not _qkv_by_hook(controller, layer, site)}
        probing.install(controller, probes)
        handles = _block_timer(controller, block_ms) if times_from is None else []
        handles += _producer_timer(controller, module_ms) if times_from is None else []
        handles += _qkv_hooks(controller, captured)
        try:
            with SavedTensorLedger() as probe_ledger:
                out = forward()
            held = probe_ledger.by_site()
            del out
        finally:
            for h in handles:
                h.remove()
        if keep is None and any_rank(not _same_shapes(keep_from, captured)):
            snap.restore()
            probing.install(controller, {})
            keep = keep_pass()
    if keep is None:
        keep = {key: st.keep_bytes for key, st in keep_from.sites.items()}
        keep[(None, OTHER)] = keep_from.outside_bytes()
        after_blocks = keep_from.after_blocks_bytes
    else:
        after_blocks = max(0, keep.get((None, OTHER), 0) - after.get("other", 0)) if "other" in after else 0
    planned = set(captured)
    other = sum(n for key, n in keep.items() if key not in planned)
    priced = bool(getattr(controller, "backward_priced", False))
    sites: dict[tuple[int, str], SiteStats] = {}
    for key in sorted(captured, key=lambda k: (k[0], schema.SITES.index(k[1]))):
        layer, site = key
        x = captured[key]
        # q/k/v: a codec encodes the view alone (the QKV buffer behind a view is freed), so
        # what the site holds beyond its tensor's whole storage is side bytes (RoPE's tables)
        own = x.untyped_storage().nbytes() if site in schema.QKV_SITES else x.numel() * x.element_size()
        own += sum(y.numel() * y.element_size() for y in more.get(key, ()))
        side = max(0, held.get(key, 0) - own)
        sites[key] = SiteStats(layer, site, tuple(x.shape), x.dtype, keep.get(key, 0), side)
    to_loss = after_blocks if priced else 0  # freed by the loss's backward, before any block's
    profile = MeasuredProfile(sites, other - to_loss, str(probing.device_of(controller)),
                              {layer: _no_recompute(controller, layer) for layer in controller.layers},
                              loss_bytes=int(getattr(controller, "loss_event_bytes", 0)) + to_loss,
                              after_blocks_bytes=after_blocks, backward_priced=priced)
    whole = {layer for layer in controller.layers if _recomputes_whole(controller, layer)}
    profile.block_ms = {layer: ms for layer, ms in block_ms.items() if layer in whole}
    first_of: dict[int, int] = {}
    for group in profile.groups():
        groups_first.add(group[0])
        first_of.update({layer: group[0] for layer in group})
    activation = {layer: _activation_name(controller, layer) for layer in profile.layers}
    snap = probing.RngSnapshot()  # timing dropout draws must not move the real streams
    clock: dict = {}
    with torch.no_grad():
        for key, st in sites.items():
            layer, site = key
            x = captured[key]
            xs = token_sample(x)
            # a site after the blocks (the final norm's input) is a block of its own: timed itself
            timed = times_from is None and (layer in groups_first or site in schema.MODEL_SITES)
            power = _power(xs) if x.is_floating_point() else 1.0
            few = site == MLP_ACT_INPUT and any(n in FEWBIT_CODECS
                                                 for n in site_codec_names(controller, layer, site, x))
            dpower = derivative_power(xs, activation[layer]) if few else 1.0
            copied = every_layer is not None and layer not in groups_first and site not in schema.MODEL_SITES
            ref = sites.get((first_of.get(layer, layer), site))
            for name in site_codec_names(controller, layer, site, x):
                if codecs is not None and name not in codecs and key not in all_codecs_at:
                    continue
                if copied and name not in every_layer and ref is not None and name in ref.options:
                    st.options[name] = dataclasses.replace(ref.options[name])
                    continue
                codec = _codec(name, activation[layer])
                st.options[name] = _option(codec, name, x, xs, st.side_bytes, power, dpower, timed, repeats,
                                           clock)
                if key in more:
                    st.options[name] = _with_more(st.options[name], codec, name, x, power, more[key], timed,
                                                  repeats, clock)
                if name == "outlier_int4" and x.shape:
                    st.outlier_rate = codec.count_outliers(x) / max(1, x.shape[-1])
            if timed:
                st.forward_ms = _producer_ms(controller, layer, site, captured, repeats, module_ms)
        if times_from is not None:
            _copy_times(profile, times_from, whole)
    snap.restore()
    return profile


def _more_of(controller: ControlledModel, layer: int, site: str, more: dict) -> Optional[dict]:
    """`more` where the site's module can hold several tensors at one site (a generic block's
    `BlockSites`, whose hooks book every saved tensor at a site), else None: a megatron-core
    module stores one tensor per site, and a second encode is the next forward's."""
    return None if isinstance(controller.module(layer, site), torch.nn.Module) else more


def _with_more(first: OptionStats, codec: Codec, name: str, x: torch.Tensor, power: float,
               others: list[torch.Tensor], timed: bool, repeats: int, clock: dict) -> OptionStats:
    """`first` (the codec on the site's first tensor `x`) with the site's other tensors added:
    their bytes and times summed, the errors pooled over every element (the squared error per
    element, and S as the summed squared error over the summed power)."""
    n = x.numel()
    sq, pw = first.error * n, power * n
    out = dataclasses.replace(first)
    for y in others:
        ys = token_sample(y)
        p = _power(ys)
        st = _option(codec, name, y, ys, 0, p, 1.0, timed, repeats, clock)
        out.nbytes += st.nbytes
        out.encode_ms += st.encode_ms
        out.decode_ms += st.decode_ms
        sq += st.error * y.numel()
        pw += p * y.numel()
        n += y.numel()
    out.error, out.rel_error = sq / n, sq / (pw or 1.0)
    return out


def profile_from_samples(controller: ControlledModel, samples: dict, last: MeasuredProfile,
                         codecs: Optional[Sequence[str]] = None,
                         all_codecs_at: Collection[tuple[int, str]] = ()) -> Optional[MeasuredProfile]:
    """The profile of a tracking iteration from its own training step, with no pass of its
    own: `samples` are the step's site tensors (`llm_act.measurement.step_tap.StepTap`),
    `last` the last profile of the same model, whose bytes and times it keeps (they depend
    on the shapes alone). Each sampled site's codecs in `codecs` (default: those `last`
    measured; every codec at the (layer, site) pairs of `all_codecs_at`) get their errors and the
    outlier rate from the sample; the codec in force at
    a per-channel site its error on the whole tensor (`SiteSample.whole`); everything else,
    and every site the step did not hold (a site inside a block recomputed whole keeps none
    until backward; masks), is carried from `last`. None where a sampled site's shape or
    dtype differs from `last` (a new sequence length): a full `measure_profile` is due."""
    sites: dict[tuple[int, str], SiteStats] = {}
    for key, old in last.sites.items():
        smp = samples.get(key)
        if smp is None:
            sites[key] = dataclasses.replace(old, options=dict(old.options))
            continue
        if smp.shape != old.shape or smp.dtype != old.dtype:
            return None
        layer, site = key
        st = dataclasses.replace(old, options=dict(old.options))
        xs = smp.sample
        power = _power(xs)
        act = _activation_name(controller, layer)
        few = site == MLP_ACT_INPUT and any(n in FEWBIT_CODECS for n in old.options)
        dpower = derivative_power(xs, act) if few else 1.0
        whole = smp.whole
        every = codecs is None or key in all_codecs_at
        for name, opt in old.options.items():
            if (not every and name not in codecs) or name == "regen":
                continue
            codec = _codec(name, act)
            if whole is not None and whole[0] == name:
                err = float(whole[1])
                rel = err / (float(whole[2]) or 1.0)
            elif getattr(codec, "axis", None) is not None:
                continue  # a sample of the rows understates its error: the last whole figure stays
            else:
                err, rel = _errors(codec, name, xs, power, dpower)
            st.options[name] = dataclasses.replace(opt, error=err, rel_error=rel)
        if "outlier_int4" in old.options and xs.dim() > 0 and (every or "outlier_int4" in codecs):
            st.outlier_rate = _codec("outlier_int4", act).count_outliers(xs) / max(1, xs.shape[-1])
        sites[key] = st
    return MeasuredProfile(sites, last.other_bytes, last.device, dict(last.no_recompute), dict(last.block_ms),
                           last.loss_bytes, last.after_blocks_bytes, last.backward_priced)


def _same_shapes(old: Optional[MeasuredProfile], captured: dict) -> bool:
    """Whether `old` has exactly the captured sites, with the same shapes and dtypes."""
    return old is not None and set(old.sites) == set(captured) and all(
        old.sites[k].shape == tuple(x.shape) and old.sites[k].dtype == x.dtype for k, x in captured.items())


def _copy_times(profile: MeasuredProfile, old: Any, whole: Collection[int]) -> None:
    """Times of `old` (a profile or its `times()`), by site type; the whole block's for the
    layers of `whole` (those that can be recomputed whole)."""
    ref = old.times() if isinstance(old, MeasuredProfile) else old
    block = (ref.get(BLOCK_TIME) or {}).get("forward_ms")
    if block is not None:
        profile.block_ms = {layer: float(block) for layer in profile.layers if layer in whole}
    for (_, site), st in profile.sites.items():
        src = ref.get(site)
        if src is None:
            continue
        st.forward_ms = src.get("forward_ms")
        for name, opt in st.options.items():
            if name in src.get("codecs", {}):
                opt.encode_ms, opt.decode_ms = src["codecs"][name]


# ---- producer times ----------------------------------------------------------------------------


def _layer_of(controller: ControlledModel, layer: int):
    """The TransformerLayer holding `layer`'s modules (None when not found)."""
    return controller.layer_modules.get(layer)


def _qkv_by_hook(controller: ControlledModel, layer: int, site: str) -> bool:
    """Whether `site` is captured by `_qkv_hooks`: q, k, v stored by a core-attention module
    (the generic path's saved-tensor hooks see them as any other site)."""
    return site in schema.QKV_SITES and isinstance(controller.module(layer, site), torch.nn.Module)


def _qkv_hooks(controller: ControlledModel, sink: dict) -> list:
    """Forward pre-hooks that capture the core attention's q, k, v (after rotary; GQA K/V
    un-expanded) into `sink[(layer, ATTN_Q)]` etc. for the layers that plan those sites."""
    handles = []
    for layer in controller.layers:
        planned = [s for s in schema.QKV_SITES
                   if s in controller.sites(layer) and _qkv_by_hook(controller, layer, s)]
        if not planned:
            continue
        core = controller.module(layer, planned[0])
        args_of = {site: input_arg(site) for site in planned}

        def pre(module, args, kwargs, layer=layer, args_of=args_of):
            for site, i in args_of.items():
                x = args[i] if i < len(args) else kwargs.get(CORE_ARG_NAMES[i])
                if torch.is_tensor(x) and x.requires_grad:
                    sink.setdefault((layer, site), x)

        handles.append(core.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def _recomputes_whole(controller: ControlledModel, layer: int) -> bool:
    """Whether `layer` can be switched to whole-block recompute (a binder over the layer's
    module that switches: `LayerBinder.recompute_scope`)."""
    owner = controller.binder(layer)
    return owner is not None and _layer_of(controller, layer) is not None and owner.recompute_scope() != "fixed"


def _after_the_blocks(controller: ControlledModel, ledger: SavedTensorLedger, sink: dict[str, int]) -> Any:
    """A forward hook on the last layer noting the ledger's bytes outside the sites when its
    forward ends (sink["other"]): what is saved outside them after that -- the output layer's
    input, the logits, the loss's log-probabilities -- is freed before any block backpropagates
    (`MeasuredProfile.after_blocks_bytes`)."""
    last = controller.layer_modules.get(max(controller.layers))
    if last is None:  # no module known for it: nothing is counted as after the blocks
        return torch.utils.hooks.RemovableHandle({})

    def note(*_):
        sink["other"] = ledger.by_site().get((None, OTHER), 0)

    return last.register_forward_hook(note, always_call=True)


def _block_timer(controller: ControlledModel, sink: dict[int, float]) -> list:
    """Forward hooks timing each layer's forward (synchronised on a GPU): the cost of
    recomputing it whole."""
    return _module_timer(dict(controller.layer_modules), sink)


def _made_of(site: str) -> tuple[str, ...]:
    """The layer submodules whose forward times, summed, are the time of `site`'s producer
    (`_producer_ms`): the schema's `made_by`; for `attn.out` the QKV projection and the core
    attention (what its recomputation re-runs to the planner: `Site.rebuild_reads`); none
    for a producer that is no module call (an activation, a bias-dropout-add)."""
    spec = schema.SITE_OF.get(site)
    if spec is not None and spec.made_by:
        return (spec.made_by,)
    if site == ATTN_OUT:
        return schema.SITE_OF[ATTN_QKV_INPUT].slot, schema.SITE_OF[ATTN_Q].slot
    return ()


def _timed_paths() -> tuple[str, ...]:
    """The layer submodules the capture forward times (`_producer_timer`): every `_made_of`."""
    return tuple(dict.fromkeys(path for site in schema.SITES for path in _made_of(site)))


def _producer_timer(controller: ControlledModel, sink: dict) -> list:
    """Forward hooks timing, in the forward that runs anyway, every producer module of each
    layer (`_timed_paths`): sink[(layer, path)] = ms of its first call."""
    modules = {}
    for layer, tl in controller.layer_modules.items():
        for path in _timed_paths():
            module = submodule(tl, path)
            if module is not None:
                modules[(layer, path)] = module
    return _module_timer(modules, sink)


def _module_timer(modules: dict, sink: dict) -> list:
    """Forward pre/post hooks timing each of `modules` ({key: module}) on its first call
    (synchronised on a GPU): sink[key] = ms."""
    handles = []
    for key, module in modules.items():
        start: list[float] = []

        def pre(m, args, start=start):
            _sync(m)
            start.append(time.perf_counter())

        def post(m, args, out, start=start, key=key):
            _sync(m)
            sink.setdefault(key, 1e3 * (time.perf_counter() - start.pop()))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def _sync(module: torch.nn.Module) -> None:
    p = next(module.parameters(), None)
    if p is not None and p.is_cuda:
        torch.cuda.synchronize(p.device)


def _rebuilt_from(sites) -> tuple[str, ...]:
    """Sites of `RECOMPUTABLE` whose rebuild reads one of `sites`."""
    return tuple(s.name for s in schema.BLOCK
                 if s.alone and set(s.recomputed_from + s.rebuild_reads) & set(sites))


def _no_recompute(controller: ControlledModel, layer: int) -> tuple[str, ...]:
    """Sites of `RECOMPUTABLE` the layer cannot recompute alone: every one where its binder
    cannot switch single sites (`LayerBinder.recompute_scope`, "sites": a megatron-core layer,
    a Hugging Face family's block under plan "auto") or knows no producer (a family's block
    replays only its norms, `patches.deepspeed.hf_replay`); those rebuilt from the MLP's
    activation input (`mlp.fc2_input`) when the MLP keeps only a mask of it (ReLU); those whose
    rebuild replays a dropout mask (`ln2.input`) when megatron's fused bias-dropout-add would
    need the hidden-dropout mask kept."""
    owner, tl = controller.binder(layer), _layer_of(controller, layer)
    if owner is None or tl is None or owner.recompute_scope() != "sites":
        return tuple(sorted(schema.RECOMPUTABLE))
    out = [s for s in sorted(schema.RECOMPUTABLE) if owner.producer(s) is None]
    try:
        if owner.mlp_kind() == "mask":
            out += _rebuilt_from((MLP_ACT_INPUT,))
    except Exception:
        out += _rebuilt_from((MLP_ACT_INPUT,))
    if (getattr(getattr(tl, "config", None), "bias_dropout_fusion", False)
            and float(getattr(tl, "hidden_dropout", 0) or 0) > 0):
        out += _rebuilt_from(schema.MASK_SITES)
    return tuple(dict.fromkeys(out))


def _producer_ms(controller: ControlledModel, layer: int, site: str, captured: dict, repeats: int,
                 module_ms: Optional[dict] = None) -> Optional[float]:
    """Forward time of the op that produces `site` (the cost of recomputing it): its modules'
    times in the capture forward (`_made_of`, `_producer_timer`) where that timed them all,
    else the layer's own producer (`LayerBinder.producer`) re-run on the captured tensors it
    is made from, as the producers that are no module are (an activation, a bias-dropout-add);
    a dropout mask's is a fresh draw. None where the layer's binder knows no producer."""
    dev = probing.device_of(controller)
    if site in schema.MASK_SITES:
        m = captured.get((layer, site))
        return probing.time_ms(lambda: torch.rand(m.shape, device=m.device) >= 0.5, dev, repeats)
    times = [(module_ms or {}).get((layer, path)) for path in _made_of(site)]
    if times and None not in times:
        return sum(times)
    owner = controller.binder(layer)
    make = owner.producer(site) if owner is not None else None
    inputs = [captured.get((layer, s)) for s in schema.PRODUCER_INPUTS.get(site, ())]
    if make is None or not inputs or any(x is None for x in inputs):
        return None
    return probing.time_ms(lambda: make(*inputs), dev, repeats)
