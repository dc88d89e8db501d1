"""llm_act: keep, compress or recompute every activation a transformer block saves.

Public API: `ActConfig`, `Controller`, `Plan` (the planner's answer, `llm_act.plan`),
`llm_act.codecs`, `llm_act.ledger.SavedTensorLedger`, `llm_act.planner`, and the framework
doors `llm_act.patches.megatron` and `llm_act.patches.deepspeed`. Importing this package
needs only torch (and numpy).
"""
from __future__ import annotations

from llm_act.config import ActConfig
from llm_act.ledger import SavedTensorLedger
from llm_act.plan import Plan
from llm_act.runtime.controller import Controller

__version__ = "0.1.0"
__all__ = ["ActConfig", "Controller", "Plan", "SavedTensorLedger", "__version__"]
