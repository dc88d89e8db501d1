"""A build lock left by a stopped build never makes a DeepSpeed job wait (issue 29): our
DeepSpeed door removes locks older than `STALE_AFTER_S` before DeepSpeed builds its ops, and
leaves a lock a running build may hold."""
from __future__ import annotations

import logging
import os
import time

from torch.utils.file_baton import FileBaton

from llm_act.patches.deepspeed import build_locks


def _lock(path, age_s: float) -> str:
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    with open(lock, "w"):
        pass
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_stale_locks_go_and_fresh_ones_stay(tmp_path, caplog):
    stale = _lock(tmp_path / "py311_cpu" / "shm_comm", build_locks.STALE_AFTER_S + 60)
    fresh = _lock(tmp_path / "py311_cpu" / "fused_adam", 30)
    with caplog.at_level(logging.WARNING, logger="llm_act"):
        removed = build_locks.clear_stale_locks(str(tmp_path))
    assert removed == [stale] and not os.path.exists(stale) and os.path.exists(fresh)
    (line,) = [r.getMessage() for r in caplog.records]
    assert stale in line and "stale build lock" in line and "\n" not in line
    # torch's own baton, which DeepSpeed's build takes, is free there now (it waits forever otherwise)
    assert FileBaton(stale).try_acquire()
    assert not FileBaton(fresh).try_acquire()  # a running build's lock is respected
    assert build_locks.clear_stale_locks(str(tmp_path / "absent")) == []


def test_the_root_is_torchs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_locks.extensions_root() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import get_default_build_root

    assert build_locks.extensions_root() == get_default_build_root()
