"""Where llm_act's own log lines go in a loop we do not own.

The re-planning lines (the plan at the start, every change with its predicted bytes
against the budget, its noise against the noise budget and why) are INFO records of the
"llm_act" logger. DeepSpeed's engine, Megatron-LM's `pretrain()` and a plain loop leave
Python logging unconfigured, where INFO is dropped; so the doors call `default_handler()`:
when neither the "llm_act" logger nor the root logger has a handler, one is added that
prints INFO on the first rank and warnings on every rank, to stderr. A user's own logging
setup (any handler) wins, and our training loop swaps it for its run log (`loop.py`).
"""
from __future__ import annotations

import logging
import sys

#: the attribute that marks the handler `default_handler` added
MARK = "_llm_act_default"


class _FirstRank(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        try:
            import torch.distributed as dist

            return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        except Exception:  # torch.distributed unusable: a single process
            return True


def default_handler() -> None:
    """Install the default handler (see the module docstring); idempotent."""
    logger = logging.getLogger("llm_act")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_FirstRank())
    setattr(handler, MARK, True)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def default_handlers() -> list[logging.Handler]:
    """The handlers `default_handler` added."""
    return [h for h in logging.getLogger("llm_act").handlers if getattr(h, MARK, False)]
