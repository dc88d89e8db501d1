"""Stale build locks of torch's C++ extensions, which DeepSpeed's CPU ops (and on a GPU its
fused ops) are built with.

torch guards each extension's build folder with a lock file (`torch.utils.file_baton`) and
waits, without a limit, for it to disappear. A build that was killed leaves it behind, and
every later job then waits forever: the README's DeepSpeed command hung for 10 minutes on one
left by another job (issue 29). A build takes about two minutes here, so a lock older than
`STALE_AFTER_S` belongs to no running build: `clear_stale_locks` removes it, saying so in one
line, before DeepSpeed builds anything (`llm_act.patches.deepspeed.initialize`).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

log = logging.getLogger("llm_act.patches.deepspeed")

#: a lock this old (seconds since its file was written) is stale
STALE_AFTER_S = 15 * 60
#: extension root / [python_accelerator /] extension / lock
_MAX_DEPTH = 3


def extensions_root() -> str:
    """Where torch builds extensions: `TORCH_EXTENSIONS_DIR`, else torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()


def clear_stale_locks(root: Optional[str] = None, max_age_s: float = STALE_AFTER_S,
                      now: Optional[float] = None) -> list[str]:
    """Remove the build locks under `root` (default: `extensions_root()`) older than
    `max_age_s`; returns their paths. A lock another rank removed first is no error."""
    root = root or extensions_root()
    now = time.time() if now is None else now
    removed = []
    if not os.path.isdir(root):
        return removed
    base = root.rstrip(os.sep).count(os.sep)
    for folder, subfolders, files in os.walk(root):
        if folder.count(os.sep) - base >= _MAX_DEPTH:
            subfolders[:] = []
        if "lock" not in files:
            continue
        path = os.path.join(folder, "lock")
        try:
            age = now - os.path.getmtime(path)
            if age <= max_age_s:
                continue
            os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(path)
        log.warning("llm_act: removed a stale build lock %s (%.0f minutes old, left by a build that "
                    "was stopped; torch would wait for it forever)", path, age / 60)
    return removed
