"""`MeasuredProfile`: what each site of the model stores and costs, as measured (per-site and
per-codec statistics), and its conversion into the planner's `BlockProfile`s (`blocks()`:
identical layers share one block) and back (`plan_from`). `llm_act.measurement.measure`
fills it from probe passes over the real model; the planner reads only the blocks. A site
after the blocks (`MODEL_SITES`: the final norm's input, measured as a site of the last
layer) is a block of its own, after the layers' blocks (`units`): whole-block recompute of
the last layer never covers it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch

from llm_act.codecs.registry import CODEC_NAMES, KEEP, RECOMPUTE, UNBIASED_CODECS, has_bits, unbiased_at
from llm_act.plan import recomputes_whole
from llm_act.planner.classes import checkpoint_stored
from llm_act.planner.profile import BlockProfile, CodecOption, SiteProfile
from llm_act.planner.transient import transient_bytes, whole_block_bytes
from llm_act.sites import (
    ATTN_OUT,
    BLOCK,
    MLP_FC2_INPUT,
    RECOMPUTABLE,
    CHECKPOINT_SITE,
    MASK_SITES,
    MODEL_SITES,
    SITES,
)

if TYPE_CHECKING:
    from llm_act.plan import Plan

#: site -> the sites its producer reads, as the planner's `SiteProfile.inputs` states it (what a
#: recomputation needs available: `Site.recomputed_from` and `Site.rebuild_reads`). MoE sites
#: have none here: a measured profile recomputes them only with the whole block.
PROFILE_INPUTS: dict[str, tuple[str, ...]] = {
    s.name: s.recomputed_from + s.rebuild_reads for s in BLOCK if s.recomputed_from and s.family != "moe"}

def runtime_block(block: BlockProfile) -> BlockProfile:
    """`block` (e.g. an analytic one, which prices every producer) with "recompute" offered
    only where the layers recompute a site alone (`RECOMPUTABLE`), as a measured profile
    offers it; the whole-block option stays."""
    return block.recomputing_only(RECOMPUTABLE)


#: the key of the whole block's forward time in `MeasuredProfile.times()` (not a site)
BLOCK_TIME = "block"


@dataclass
class OptionStats:
    """One codec on one site's real tensor."""

    nbytes: int
    """stored bytes: the encoding plus the exact side tensors the compressed path keeps"""
    error: float
    """expected squared error per element (`expected_error`; bias^2 for nearest rounding)"""
    rel_error: float
    """`error` over the tensor's power: S(option), the noise per unit of sensitivity"""
    encode_ms: float = 0.0
    decode_ms: float = 0.0


@dataclass
class SiteStats:
    """One site of one layer, measured."""

    layer: int
    site: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    keep_bytes: int
    side_bytes: int
    options: dict[str, OptionStats] = field(default_factory=dict)
    forward_ms: Optional[float] = None
    outlier_rate: float = 0.0
    """share of channels outlier_int4 keeps exactly"""

    def stored(self, choice: str) -> int:
        if choice == KEEP:
            return self.keep_bytes
        if choice == RECOMPUTE:
            return 0
        return self.options[choice].nbytes

    def ratio(self, choice: str) -> float:
        """keep bytes / stored bytes under `choice` (the compression ratio reached)."""
        stored = self.stored(choice)
        return self.keep_bytes / stored if stored else math.inf


@dataclass
class MeasuredProfile:
    """Per (layer, site) measurements of one run of `measure_profile`."""

    sites: dict[tuple[int, str], SiteStats]
    other_bytes: int
    """bytes the keep-everything forward holds outside the planned sites"""
    device: str = "cpu"
    no_recompute: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """layer -> sites of `RECOMPUTABLE` that its configuration cannot recompute alone"""
    block_ms: dict[int, float] = field(default_factory=dict)
    """layer -> the forward time of the whole block, for the layers that can be recomputed
    whole from their input (the planner's whole-block option; absent: not offered)"""
    loss_bytes: int = 0
    """what the loss's backward holds on top of every stored byte (the controller's
    `loss_event_bytes`, and `after_blocks_bytes` where the door prices the loss): the peak is
    the larger of it and a block's transient, the planner's `solve_plan(loss_bytes=)`"""
    after_blocks_bytes: int = 0
    """what the forward saves after the blocks outside any site (the output layer's input,
    the logits, the log-probabilities), freed by the loss's and output layer's backward before
    any block backpropagates. Where the door prices the loss it is part of `loss_bytes`, not
    of `other_bytes`; kept apart so that a profile measured again from this one splits the same"""
    backward_priced: bool = False
    """the door prices the backward (`Controller.backward_priced`, the generic door, whose
    blocks' backward is plain autograd): each block's gradients in flight while it
    backpropagates (`grad_stages`), and what the forward saves after the blocks as the loss's
    (`after_blocks_bytes`); False: neither (megatron-core's measured path)"""

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.sites}))

    def layer_sites(self, layer: int) -> tuple[str, ...]:
        """The block sites of `layer` (those after the blocks excluded: `outer_sites`)."""
        return tuple(s for s in SITES if (layer, s) in self.sites and s not in MODEL_SITES)

    def outer_sites(self) -> list[tuple[int, str]]:
        """(layer, site) of the sites after the blocks (`MODEL_SITES`), in layer order."""
        return sorted(key for key in self.sites if key[1] in MODEL_SITES)

    def units(self, per_layer: bool = False, exclude: Sequence[str] = ()
              ) -> list[tuple[list[int], tuple[str, ...]]]:
        """What each entry of `blocks(per_layer=..., exclude=...)` covers, in the same order:
        (layers, sites) per group of identical layers (per layer with `per_layer`), then one
        entry per site after the blocks ([the last layer], (site,)) not in `exclude`."""
        groups = [[layer] for layer in self.layers] if per_layer else self.groups()
        return ([(group, tuple(s for s in self.layer_sites(group[0]) if s not in exclude)) for group in groups]
                + [([layer], (site,)) for layer, site in self.outer_sites() if site not in exclude])

    def groups(self) -> list[list[int]]:
        """Layers with the same planned sites and shapes (identical blocks), in order."""
        out: dict[tuple, list[int]] = {}
        for layer in self.layers:
            key = tuple((s, self.sites[(layer, s)].shape, self.sites[(layer, s)].dtype,
                         tuple(sorted(self.sites[(layer, s)].options)))
                        for s in self.layer_sites(layer))
            out.setdefault(key, []).append(layer)
        return list(out.values())

    def recomputable(self, layer: int, site: str) -> bool:
        """Whether the planner may offer "recompute" at `site` of `layer` (`RECOMPUTABLE`,
        minus what the layer's configuration rules out)."""
        return site in RECOMPUTABLE and site not in self.no_recompute.get(layer, ())

    def carry_options(self, old: "MeasuredProfile") -> None:
        """Codec figures this profile did not measure, taken from `old` (an earlier
        profile of the same model) for the same layer and site."""
        for key, st in self.sites.items():
            before = old.sites.get(key)
            if before is None or before.shape != st.shape:
                continue
            for name, opt in before.options.items():
                st.options.setdefault(name, opt)
            st.options = {n: st.options[n] for n in CODEC_NAMES if n in st.options}  # registry order

    # ---- checkpoints ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (for the controller's checkpoint: a resumed run carries the figures the
        run carried, and re-plans as it would have)."""
        return {
            "sites": [{"layer": st.layer, "site": st.site, "shape": list(st.shape), "dtype": str(st.dtype),
                       "keep_bytes": st.keep_bytes, "side_bytes": st.side_bytes, "forward_ms": st.forward_ms,
                       "outlier_rate": st.outlier_rate,
                       "options": {n: [o.nbytes, o.error, o.rel_error, o.encode_ms, o.decode_ms]
                                   for n, o in st.options.items()}}
                      for st in self.sites.values()],
            "other_bytes": self.other_bytes, "device": self.device,
            "no_recompute": {str(k): list(v) for k, v in self.no_recompute.items()},
            "block_ms": {str(k): v for k, v in self.block_ms.items()},
            "loss_bytes": self.loss_bytes, "after_blocks_bytes": self.after_blocks_bytes,
            "backward_priced": self.backward_priced,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MeasuredProfile":
        sites = {}
        for e in d["sites"]:
            st = SiteStats(int(e["layer"]), e["site"], tuple(int(x) for x in e["shape"]),
                           getattr(torch, e["dtype"].replace("torch.", "")), int(e["keep_bytes"]),
                           int(e["side_bytes"]), {n: OptionStats(int(o[0]), *map(float, o[1:]))
                                                  for n, o in e["options"].items()},
                           e["forward_ms"], float(e["outlier_rate"]))
            sites[(st.layer, st.site)] = st
        return cls(sites, int(d["other_bytes"]), d.get("device", "cpu"),
                   {int(k): tuple(v) for k, v in d.get("no_recompute", {}).items()},
                   {int(k): float(v) for k, v in d.get("block_ms", {}).items()},
                   int(d.get("loss_bytes", 0)), int(d.get("after_blocks_bytes", 0)),
                   bool(d.get("backward_priced", False)))

    # ---- statistics the controller tracks ----------------------------------------------
    def outlier_rates(self) -> dict[str, float]:
        """Mean share of outlier channels per site type (sites with an outlier_int4 option)."""
        acc: dict[str, list[float]] = {}
        for (_, site), st in self.sites.items():
            if "outlier_int4" in st.options:
                acc.setdefault(site, []).append(st.outlier_rate)
        return {s: sum(v) / len(v) for s, v in acc.items()}

    def predicted_bytes(self, plan: Mapping[int, Mapping[str, str]], include_other: bool = True) -> int:
        """Bytes held at the end of forward under `plan` ({layer: {site: choice}})."""
        total = self.other_bytes if include_other else 0
        whole = {layer for layer in self.layers if self.recomputed_whole(layer, plan.get(layer, {}))}
        for (layer, site), st in self.sites.items():
            stored = st.stored(plan.get(layer, {}).get(site, KEEP))
            if layer in whole and site == CHECKPOINT_SITE:
                stored = checkpoint_stored(stored, st.keep_bytes, self.checkpoint_bytes(layer))
            total += stored
        return total

    def outside_bytes(self) -> int:
        """Every byte the keep-everything forward saves outside the planned sites: `other_bytes`,
        with `after_blocks_bytes` where the loss holds it (`backward_priced`: the door prices the
        backward)."""
        return self.other_bytes + (self.after_blocks_bytes if self.backward_priced else 0)

    def recomputed_whole(self, layer: int, choice: Mapping[str, str]) -> bool:
        """Whether `choice` ({site: choice} of `layer`) recomputes the block whole: every
        block site but the checkpoint recomputed."""
        return recomputes_whole(choice, self.layer_sites(layer))

    def checkpoint_bytes(self, layer: int) -> Optional[int]:
        """What whole-block recompute of `layer` keeps of its checkpoint site: the block's input
        alone (the tensor the site was captured as), at most the site's bytes; None without the
        site (`BlockProfile.checkpoint_bytes`)."""
        st = self.sites.get((layer, CHECKPOINT_SITE))
        if st is None:
            return None
        return min(st.keep_bytes, math.prod(st.shape) * st.dtype.itemsize)

    def grad_stages(self, layer: int) -> tuple[tuple[str, int], ...]:
        """The gradients in flight while `layer` backpropagates, per backward stage
        (`BlockProfile.stage_bytes`), from its sites' shapes; () unless `backward_priced`. With T*h
        the block input's elements (the residual stream's gradient, live through both stages):
        - "mlp": 2*T*f + T*h, f the width of fc2's input: at the activation's backward its
          output's gradient and its input's (T*f each). A gated unit holds one T*f more of
          gradients there (both operands') and one fewer decoded operand than its site is
          priced at (SiLU's input decodes after the product's backward), so the sum holds;
        - "attention": 4*T*a*d + T*h, a*d the width of the attention's output: the context's
          gradient and q's, k's and v's (an upper bound under grouped-query attention), as the
          analytic model prices the memory-efficient attention (`analytic.stage_bytes`).
        In the dtype the sites hold (the activations' gradients are theirs)."""
        if not self.backward_priced:
            return ()

        def size(site: str) -> int:
            st = self.sites.get((layer, site))
            return math.prod(st.shape) * st.dtype.itemsize if st is not None else 0

        hidden = size(CHECKPOINT_SITE)
        return (("mlp", 2 * size(MLP_FC2_INPUT) + hidden), ("attention", 4 * size(ATTN_OUT) + hidden))

    def transient_bytes(self, plan: Mapping[int, Mapping[str, str]]) -> int:
        """The largest layer's backward transient under `plan`, as the planner prices it on
        `blocks()` (`llm_act.planner.transient`): its recomputed sites and largest decode
        group; a layer recomputed whole holds every other site rebuilt (and its decoded
        input when encoded). With `predicted_bytes`, a fixed plan's need is counted as an
        "auto" plan's is: one definition of the peak (what lies outside the blocks is held
        through the step; the loss's backward, `loss_bytes`, is the peak where no block's
        transient is larger, as the planner prices it)."""
        peak = self.loss_bytes
        for layers, names in self.units(per_layer=True):
            layer = layers[0]
            choice = plan.get(layer, {})
            picks = [choice.get(s, KEEP) for s in names]
            nbytes = [self.sites[layer, s].keep_bytes for s in names]
            stages = self.grad_stages(layer) if CHECKPOINT_SITE in names else ()
            if CHECKPOINT_SITE in names and self.recomputed_whole(layer, choice):
                layer_peak = max((g for _, g in stages), default=0) + whole_block_bytes(
                    nbytes, names, choice.get(CHECKPOINT_SITE, KEEP), self.checkpoint_bytes(layer))
            else:
                inputs = [tuple(d for d in PROFILE_INPUTS.get(s, ()) if d in names) for s in names]
                layer_peak = transient_bytes(nbytes, picks, names, inputs, stages)
            peak = max(peak, layer_peak)
        return peak

    def noise(self, plan: Mapping[int, Mapping[str, str]], sensitivity: Mapping[str, float],
              coherence: Optional[Mapping[str, float]] = None) -> float:
        """Predicted compression noise of `plan`: sum over layers and sites of c_i * S."""
        return sum(self.noise_by_site(plan, sensitivity, coherence).values())

    def noise_by_site(self, plan: Mapping[int, Mapping[str, str]], sensitivity: Mapping[str, float],
                      coherence: Optional[Mapping[str, float]] = None) -> dict[str, float]:
        """Per site type: sum over layers of c_i * S(choice) under `plan` (a biased codec's
        S times the site's measured `coherence`)."""
        out: dict[str, float] = {}
        for (layer, site), st in self.sites.items():
            choice = plan.get(layer, {}).get(site, KEEP)
            if choice in st.options:
                out[site] = out.get(site, 0.0) + float(sensitivity.get(site, 0.0)) * charged_error(
                    st.options[choice].rel_error, site, choice, coherence)
        return out

    def times(self) -> dict[str, dict[str, Any]]:
        """{site: {"forward_ms": ..., "codecs": {name: (encode_ms, decode_ms)}}} from the
        first layer holding each site type (plain data, for checkpoints)."""
        out: dict[str, dict[str, Any]] = {}
        for (_, site), st in sorted(self.sites.items(), key=lambda kv: (kv[0][0], SITES.index(kv[0][1]))):
            if site not in out:
                out[site] = {"forward_ms": st.forward_ms,
                             "codecs": {n: (o.encode_ms, o.decode_ms) for n, o in st.options.items()}}
        if self.block_ms:
            out[BLOCK_TIME] = {"forward_ms": self.block_ms[min(self.block_ms)]}
        return out

    # ---- for the planner ---------------------------------------------------------------
    def blocks(self, sensitivity: Optional[Mapping[str, float]] = None, inflight: int = 1,
               per_layer: bool = False, recompute: bool = False,
               candidates: Optional[Mapping[str, Sequence[str]]] = None,
               exclude: Sequence[str] = (), coherence: Optional[Mapping[str, float]] = None,
               unbiased_only: bool = False, min_bits: int = 1) -> list[BlockProfile]:
        """`BlockProfile`s in layer order: one per group of identical layers (`count` = its
        size; bytes the mean over the group, rounded up, so totals are exact for the uniform
        plan a group gets), or one per layer with `per_layer` (timed as its group's first
        layer was). `recompute`: offer "recompute" (the producer's measured forward time);
        `candidates`: site -> the codec names to offer (default: all measured); `exclude`:
        sites left out (fixed choices);
        `coherence`: site -> the factor a biased codec's noise is charged at (issue 28);
        `unbiased_only`: offer only unbiased roundings and exact codecs (`UNBIASED_CODECS`);
        `min_bits`: offer only codecs storing at least that many bits per value (`has_bits`)."""
        sens = dict(sensitivity or {})
        first = {layer: g[0] for g in self.groups() for layer in g}
        out = []
        for group, sites in self.units(per_layer, exclude):
            profiles = []
            for site in sites:
                stats = [self.sites[(layer, site)] for layer in group]
                names = [n for n in stats[0].options
                         if (candidates is None or site not in candidates or n in candidates[site])
                         and (not unbiased_only or n in UNBIASED_CODECS) and has_bits(n, min_bits)]
                options = tuple(
                    CodecOption(
                        name,
                        _mean_up([s.options[name].nbytes for s in stats]),
                        stats[0].options[name].encode_ms,
                        stats[0].options[name].decode_ms,
                        charged_error(sum(s.options[name].rel_error for s in stats) / len(stats),
                                      site, name, coherence),
                    )
                    for name in names
                )
                # a group's times were measured on its first layer
                timed = self.sites.get((first.get(group[0], group[0]), site), stats[0])
                fwd = (timed.forward_ms if recompute and all(self.recomputable(layer, site) for layer in group)
                       else None)
                inputs = tuple(d for d in PROFILE_INPUTS.get(site, ()) if d in sites)
                default_c = 0.0 if site in MASK_SITES else 1.0
                profiles.append(SiteProfile(site, _mean_up([s.keep_bytes for s in stats]), fwd,
                                            inputs, options, float(sens.get(site, default_c))))
            whole = (recompute and not exclude and CHECKPOINT_SITE in sites
                     and all(layer in self.block_ms for layer in group))
            stages = self.grad_stages(group[0]) if CHECKPOINT_SITE in sites else ()
            held = _mean_up([self.checkpoint_bytes(layer) for layer in group]) if CHECKPOINT_SITE in sites else None
            out.append(BlockProfile(tuple(profiles), count=len(group), inflight=inflight,
                                    full_ms=self.block_ms[group[0]] if whole else None,
                                    grad_bytes=max((g for _, g in stages), default=0), stage_bytes=stages,
                                    checkpoint_bytes=held))
        return out

    def block_layers(self, per_layer: bool = False, exclude: Sequence[str] = ()) -> list[list[int]]:
        """The layers behind each entry of `blocks(per_layer=..., exclude=...)`, in the same order."""
        return [layers for layers, _ in self.units(per_layer, exclude)]

    def plan_from(self, plan: "Plan", per_layer: bool = False,
                  exclude: Sequence[str] = ()) -> dict[int, dict[str, str]]:
        """{layer: {site: choice}} from a `solve_plan` answer over `blocks(per_layer,
        exclude=...)`: a group whose layers the plan splits (some recomputed whole) gives them
        in layer order; a site after the blocks joins its layer's choice."""
        out: dict[int, dict[str, str]] = {}
        for i, layers in enumerate(self.block_layers(per_layer, exclude)):
            for layer, ch in zip(layers, plan.layer_choices(i)):
                out.setdefault(layer, {}).update(ch)
        return out

    def choice_for(self, plan: Mapping[int, Mapping[str, str]], per_layer: bool = False,
                   exclude: Sequence[str] = ()) -> list[dict[str, str]]:
        """The per-block choice list of `plan` for `evaluate_plan` over `blocks(per_layer,
        exclude=...)` (a group takes its first layer's choice)."""
        return [{s: plan.get(layers[0], {}).get(s, KEEP) for s in names}
                for layers, names in self.units(per_layer, exclude)]


def charged_error(rel_error: float, site: str, name: str, coherence: Optional[Mapping[str, float]]) -> float:
    """The S the noise model charges `name` at `site`: its relative error, times the site's
    measured coherence when the codec biases the gradient there (`unbiased_at`: its error
    does not average out over tokens)."""
    if not coherence or unbiased_at(name, site):
        return rel_error
    return rel_error * float(coherence.get(site, 1.0))


def _mean_up(values: Sequence[int]) -> int:
    return -(-sum(values) // len(values))
