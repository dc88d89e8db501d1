"""The contract between the runtime and the layers: what the `Controller` and measurement ask
of a layer's *binder*, the object that puts the plan's choice for one layer into its modules.

Three classes implement it, all in `llm_act.patches`: `megatron.recompute.LayerRecompute` (a
megatron-core TransformerLayer, recomputation included), its subclass
`deepspeed.megatron_recompute.DeepSpeedLayerRecompute` (whole-block recompute through
`deepspeed.checkpointing`) and `deepspeed.generic.BlockRecompute` (a block of any torch model).
The runtime and measurement sit below the patches (docs/architecture.md: imports point down),
so they import none of those classes: they find a layer's binder with `binder_of` on any module
that stores one of its sites, and call only what `LayerBinder` declares; of the modules
themselves they use only what `SiteModule` declares.

This module imports nothing of llm_act at run time, so every package may import it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from llm_act.codecs.base import Codec
    from llm_act.planner.model_shape import ModelShape


@runtime_checkable
class LayerBinder(Protocol):
    """One layer's binder: it binds the layer's {site: choice} with codecs its owner built.

    The owner of the plan (the Controller) builds every codec, so that their random streams
    are seeded and checkpointed in one place; the binder installs them and never calls back
    into the runtime (data flows one way: plan -> codecs -> layers). A binder sets itself as
    `act_binder` on every module that stores one of its sites (`binder_of` reads it).
    """

    def codec_names(self, choice: Mapping[str, str]) -> dict[str, str]:
        """{site: codec name} of the codecs `bind(choice, ...)` needs. Asked before `bind`, so
        the owner builds exactly those: a recomputed site needs none, a regenerated mask needs
        `regen`, a whole-block recompute only the block input's codec. A choice the layer
        cannot bind raises here, before anything changed."""
        ...

    def bind(self, choice: Mapping[str, str], codecs: Mapping[str, Codec]) -> None:
        """Put `choice` in force with `codecs` (site -> codec, one per site of
        `codec_names(choice)`): every module's codec and the hooks "recompute" needs. It
        refuses a choice it cannot bind before changing anything (the Controller then binds
        the plan in force back). `bind({}, {})` keeps every site and removes those hooks:
        probe passes see each site's tensor in forward."""
        ...

    def mlp_kind(self) -> Optional[str]:
        """What the MLP's activation lets backward keep: "fewbit" (its derivative depends on
        its input alone), "mask" (ReLU: a 1-bit mask, so `mlp.fc2_input` cannot be rebuilt
        from what is kept), "value" (gated or other units: a value codec only); None where the
        binder does not know the block's MLP (a generic block). Measurement asks it which
        sites the layer can recompute alone."""
        ...

    def recompute_scope(self) -> str:
        """What recomputation the layer can switch to at a tracking point: "sites" (single
        sites from what the layer keeps, those `producer` knows, and the whole block: a
        megatron-core layer, a Hugging Face family's block under plan "auto"), "whole" (the
        whole block from its input, or nothing: another generic block under plan "auto"), "fixed" (what `apply` installed, whole or nothing, stays: a generic block
        under a named plan). Measurement offers the planner only these."""
        ...

    def producer(self, site: str) -> Optional[Callable[..., torch.Tensor]]:
        """The function that makes `site` from the tensors it is recomputed from
        (`llm_act.sites.PRODUCER_INPUTS[site]`, in that order), as the layer's own forward
        makes it (`mlp.fc2_input` from `mlp.act_input`: the MLP's activation; `ln2.input`
        from `attn.out` and the block input: the output projection and the bias-dropout-add);
        None where the binder does not know it (a site the layer lacks; on a generic block every
        site but a family's norm outputs, `patches.deepspeed.hf_replay`). The
        layer's producers are written once, in the layer: measurement re-runs this one on the
        captured inputs to time recomputing `site` instead of restating the layer's forward."""
        ...

    def model_shape(self, *, count: int, seq_length: int, micro_batch: int, dtype: str,
                    position_embedding: str, attention: str) -> Optional[ModelShape]:
        """The planner's analytic `ModelShape` of `count` layers like this one at the observed
        input (`seq_length` as this rank sees it, `micro_batch`, the activations' dtype name),
        for the first step's budget check; None where the binder has no analytic model (a
        generic block). Raises ValueError for a feature the analytic model lacks."""
        ...


@runtime_checkable
class SiteModule(Protocol):
    """A module that stores sites of a layer: `patches.megatron.act_module.ActModule` and its
    subclasses (norms, linears, the MLP, the MoE experts, the core attention, the
    bias-dropout-adds) and the generic path's `patches.deepspeed.generic.BlockSites`. All the
    runtime and measurement read or call on one; they reach it through
    `ControlledModel.module(layer, site)` and never by reflection."""

    #: the MLP activation whose input the module stores, by name, where a few-bit codec can
    #: tabulate its derivative ("gelu", "relu", ...); None elsewhere (every other module, a
    #: gated unit, a generic block: a value codec only)
    act_activation: Optional[str]
    #: the core attention's mode ("stock", "unfused", "sdpa", "chunked", "auto"); None where
    #: the module holds no core attention of ours (what it stores is stock's)
    act_attention: Optional[str]

    def set_act_codec(self, site: str, codec: Optional[Codec]) -> None:
        """Store `site` through `codec` from the next forward on (None: as stock does)."""
        ...

    def set_attention_mode(self, mode: str) -> None:
        """Put the module's core attention in `mode`; nothing where it holds none."""
        ...


def binder_of(module: Any) -> Optional[LayerBinder]:
    """The binder of the layer that `module` (a module storing one of its sites) belongs to;
    None where no binder owns it (its sites are then bound one by one, `set_act_codec`)."""
    return getattr(module, "act_binder", None)
