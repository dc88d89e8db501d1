"""`ControlledModel`: what measurement reads from the model the runtime drives.

Measurement never imports the runtime: it takes any object with these members (the
`Controller` is one) and hands the planner `BlockProfile`s (`llm_act.planner.profile`),
never a controller. The planner in turn reads only profiles.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from llm_act.codecs.base import Codec
from llm_act.config import ActConfig
from llm_act.layer_contract import LayerBinder, SiteModule


class ControlledModel(Protocol):
    """The layers whose saved tensors are planned, and the handles measurement needs."""

    config: ActConfig
    #: global layer index -> its megatron-core TransformerLayer (empty on the generic path)
    layer_modules: dict[int, Any]
    #: what the loss's backward holds on top of every stored byte (0: not priced)
    loss_event_bytes: int

    @property
    def layers(self) -> tuple[int, ...]:
        """The global indices of the layers this rank holds."""

    def sites(self, layer: int) -> tuple[str, ...]:
        """The sites `layer` stores."""

    def module(self, layer: int, site: str) -> SiteModule:
        """The compressed module that stores `site` of `layer` (`layer_contract.SiteModule`)."""

    def binder(self, layer: int) -> Optional[LayerBinder]:
        """The binder of `layer` (`llm_act.layer_contract`: all measurement may ask of the
        layer itself), None where none owns its modules."""

    def all_modules(self) -> list[Any]:
        """Every compressed module (each once)."""

    def reinstall(self) -> None:
        """Give every module back the codec of the plan in force (after a probe swapped them)."""

    def set_attention_mode(self, mode: str) -> None:
        """Put every core attention in `mode` ("stock", "sdpa", "chunked", "auto")."""

    def new_codec(self, layer: int, site: str, name: str, seed: int) -> Codec:
        """A fresh codec `name` for (layer, site) with its own generator seeded `seed`."""

    def accepts(self, layer: int, site: str, name: str) -> bool:
        """Whether `layer` can take choice `name` at `site` (the schema's rule for the layer's
        MLP kind, `llm_act.codecs.registry.refusal`): measurement offers and probes nothing else."""

    def no_fewbit_layers(self) -> set[int]:
        """Layers whose MLP activation takes no few-bit codec (gated units)."""
