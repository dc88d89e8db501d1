"""llm_act: keep, compress or recompute every activation a transformer block saves.

Public API: `ActConfig`, `Controller`, `Plan` (the planner's answer, `llm_act.plan`), `llm_act.codecs`, `llm_act.ledger.SavedTensorLedger`,
`llm_act.planner`, and the framework doors `llm_act.patches.megatron` and
`llm_act.patches.deepspeed`. Importing this package needs only torch.
"""
from __future__ import annotations

import importlib

from llm_act.config import ActConfig
from llm_act.plan import Plan

__version__ = "0.1.0"
__all__ = ["ActConfig", "Controller", "Plan", "SavedTensorLedger", "__version__"]

_LAZY = {
    "Controller": "llm_act.runtime.controller",
    "SavedTensorLedger": "llm_act.ledger",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llm_act' has no attribute {name!r}")
