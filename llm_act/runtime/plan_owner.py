"""`PlanOwner`: what plan "auto" reads and drives of the controller that owns it.

The `Controller` (`llm_act.runtime.controller`) builds an `Adapter` and calls it at every
step boundary; the adapter, its measurements and its budget checks see the controller only
through this Protocol, so nothing below the controller imports it (no import circle, type-only
ones included). It extends what measurement reads (`ControlledModel`) with the plan in force,
the iteration and the switches a decision throws.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from llm_act.measurement.controlled import ControlledModel
from llm_act.plan import LayerPlans


class PlanOwner(ControlledModel, Protocol):
    """The controller as the adapter sees it."""

    #: iterations completed (the step boundary just passed counts)
    iteration: int
    #: the model's total layer count (JSON plans cover all layers)
    num_layers: int
    #: the output layer and loss switch, or None (`output_choice.switch_of`)
    output: Any
    #: what advances the controller besides `step()` ("optimizer.step()", "engine.step()"), or None
    boundary: Optional[str]

    @property
    def in_step(self) -> bool:
        """Whether `step()` is running."""

    @property
    def enabled(self) -> bool:
        """False when there is nothing to control."""

    @property
    def plan(self) -> LayerPlans:
        """The plan in force now (a copy)."""

    @property
    def pending_plan(self) -> Optional[LayerPlans]:
        """A plan waiting for the next step boundary."""

    @property
    def probe_given(self) -> bool:
        """Whether the loop gave a probe (`step(probe=...)`, `set_probe`): then tracking points
        measure with it instead of the recorded training step."""

    def set_plan(self, plan: Any) -> None:
        """Ask for `plan` at the next step boundary."""

    def set_output_loss(self, mode: Optional[str]) -> str:
        """Switch the output loss; the change in words, empty when none."""

    def check_accepted(self, plan: LayerPlans) -> None:
        """Refuse a plan some layer cannot bind, before anything changes."""

    def describe(self, plan: LayerPlans) -> str:
        """The plan per block, in words."""

    def nonfinite_overflow(self) -> int:
        """Non-finite values past the codecs' side lists (a sync)."""

    def probe_params(self) -> list:
        """The parameters measuring counts."""
