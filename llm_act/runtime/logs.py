"""Where llm_act's own log lines go in a loop we do not own.

The re-planning lines (the plan at the start, every change with its predicted bytes
against the budget, its noise against the noise budget and why) are INFO records of the
"llm_act" logger. DeepSpeed's engine and a plain loop leave Python logging unconfigured,
where INFO is dropped; so the doors call `default_handler()`: when neither the "llm_act"
logger nor the root logger has a handler, one is added that prints INFO where
`speaks_for_stage()` (rank 0 outside megatron-core) and warnings on every rank, to stderr.
A user's own logging setup (any handler: Megatron-LM's `pretrain()` logs to the root
logger on every rank) wins, and our training loop swaps it for its run log (`loop.py`).
The plan lines themselves are emitted only where `speaks_for_stage()`: the ranks of a
pipeline stage hold one agreed plan, so a log every rank writes to (Megatron-LM's) gets
one line per stage, not one per rank.
"""
from __future__ import annotations

import logging
import sys

from llm_act.runtime import agreement

#: the attribute that marks the handler `default_handler` added
MARK = "_llm_act_default"


def stderr_line(msg: str) -> None:
    """One line on stderr in one write: every rank shares the pipe, and `print` writes the
    text and its newline apart under PYTHONUNBUFFERED, so two ranks' lines could run together.
    How our launchers report a user's error: one line per rank, no traceback."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def speaks_for_stage() -> bool:
    """True on the rank that prints its pipeline stage's plan: under megatron-core's
    parallel state the last of the stage's tensor- and data-parallel ranks (Megatron-LM and
    our loop print from the last rank), else rank 0; and a process running alone."""
    try:
        import torch.distributed as dist

        g = agreement.groups()
        if g is None:
            return True
        if g.stage is None:
            return dist.get_rank() == 0
        return dist.get_rank() == max(dist.get_process_group_ranks(g.stage))
    except Exception:  # torch.distributed unusable: a single process
        return True


class _StageSpeaker(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or speaks_for_stage()


def default_handler() -> None:
    """Install the default handler (see the module docstring); idempotent."""
    logger = logging.getLogger("llm_act")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_StageSpeaker())
    setattr(handler, MARK, True)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def default_handlers() -> list[logging.Handler]:
    """The handlers `default_handler` added."""
    return [h for h in logging.getLogger("llm_act").handlers if getattr(h, MARK, False)]
