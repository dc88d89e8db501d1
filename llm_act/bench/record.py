"""What a bench result carries of the run that made it, and the provenance line it renders.

Why: docs claim only what was recorded (design, fourth round). A result saved as JSON holds
its command, machine, versions, wall time and date, so the line above its table in
docs/benchmarks.md is rendered from the file, not written from memory."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from typing import Optional

import torch

from llm_act.bench.timing import machine_line


def versions() -> str:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("megatron.core", "pulp", "triton", "deepspeed"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            parts.append(f"{mod.split('.')[0] if mod != 'megatron.core' else 'megatron-core'} "
                         f"{getattr(m, '__version__', '?')}")
        except Exception:
            parts.append(f"{mod}: absent")
    return ", ".join(parts)


def now_utc() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def commit() -> Optional[str]:
    """The checkout's commit, "+ uncommitted changes" when its tree differs from it; None
    outside a git checkout (an installed wheel)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" + uncommitted changes" if dirty else "")


def run_record(command: str, wall_s: Optional[float] = None, device: Optional[torch.device] = None,
               when: Optional[str] = None) -> dict:
    """{command, machine, versions, commit, wall_s, when} of a run on this machine, now (`when`:
    a result made earlier)."""
    return {"command": command, "machine": machine_line(device or torch.device("cpu")),
            "versions": versions(), "commit": commit(), "wall_s": wall_s, "when": when or now_utc()}


def provenance_line(record: dict, reused_by: Optional[str] = None) -> str:
    """The italic line above a section or table: machine, versions, commit, command, wall time,
    date (`reused_by`: the command that read the result back, when another)."""
    took = "" if record.get("wall_s") is None else f"; took {record['wall_s']:.0f} s"
    at = "" if not record.get("commit") else f" Commit: {record['commit']}."
    again = "" if not reused_by or reused_by == record["command"] else f" (read back by `{reused_by}`)"
    return (f"*Machine: {record['machine']}. Versions: {record['versions']}.{at} Command: `{record['command']}`"
            f"{took}; {record['when']}{again}.*")


def write_json(path: str, result: dict) -> str:
    """Write `result` to `path` whole or not at all (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
