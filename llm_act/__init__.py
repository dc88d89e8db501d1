"""llm_act: keep, compress or recompute every activation a transformer block saves.

Public API: `ActConfig`, `Controller`, `Plan` (the planner's answer, `llm_act.plan`),
`llm_act.codecs`, `llm_act.ledger.SavedTensorLedger`, `llm_act.planner`, and the framework
doors `llm_act.patches.megatron` and `llm_act.patches.deepspeed`. Importing this package
needs only torch (and numpy).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llm_act.config import ActConfig
    from llm_act.ledger import SavedTensorLedger
    from llm_act.plan import Plan
    from llm_act.runtime.controller import Controller

__version__ = "0.1.0"
__all__ = ["ActConfig", "Controller", "Plan", "SavedTensorLedger", "__version__"]

#: the public names, imported on first use: importing a submodule (e.g. the block schema,
#: `llm_act.sites`) does not import the runtime
_PUBLIC = {"ActConfig": "llm_act.config", "SavedTensorLedger": "llm_act.ledger",
           "Plan": "llm_act.plan", "Controller": "llm_act.runtime.controller"}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'llm_act' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
