"""What the torchrun loop's log says about llm_act: the plan in force at the start, every
re-plan with its predicted bytes against the budget and its reason, and that the codecs run
their pure-torch references on CPU (so a CPU tokens/s figure is not a GPU's)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *flags: str) -> str:
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--train-iters", "3",
           "--log-interval", "1", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_auto_prints_its_plan_and_every_re_plan(tmp_path):
    out = _run(tmp_path, "--act-compress")
    lines = out.splitlines()
    start = [ln for ln in lines if ln.startswith("plan in force")]
    assert len(start) == 1 and "'auto' starts from 'compress'" in start[0]
    assert "mlp.act_input=fewbit3" in start[0]
    changed = [ln for ln in lines if "plan changed" in ln]
    assert changed and all("MiB budget" in ln and "why: " in ln for ln in changed)
    assert lines.index(start[0]) < lines.index(changed[0])  # the start plan comes first
    summary = [ln for ln in lines if ln.startswith("summary:")]
    assert "pure-torch references on cpu" in summary[0]
    assert "re-planning:" in summary[1] and "solver failures" in summary[1]
    # the run's last iteration reports the gradient fidelity and the gradient-noise ratio
    assert "gradient fidelity at iteration 3" in summary[1]
    assert "gradient-noise ratio (compression / sampling variance)" in summary[1]


def test_a_fixed_plan_summary_gives_the_gradient_noise_ratio(tmp_path):
    out = _run(tmp_path, "--act-compress", "--act-compress-plan", "compress")
    summary = [ln for ln in out.splitlines() if ln.startswith("summary:")]
    assert len(summary) == 2 and "gradient fidelity at iteration 3" in summary[1]
    assert "gradient-noise ratio (compression / sampling variance)" in summary[1]
    assert "re-planning:" not in out


def test_a_fixed_plan_is_printed_and_never_re_planned(tmp_path):
    out = _run(tmp_path, "--act-compress", "--act-compress-plan", "keep")
    assert "plan in force ('keep'): layers [0, 1]: *=keep" in out
    assert "plan changed" not in out and "re-planning:" not in out


def test_stock_prints_no_plan_and_no_codec_note(tmp_path):
    out = _run(tmp_path)
    assert "plan in force" not in out and "pure-torch" not in out


def test_a_rank_error_line_is_one_write(monkeypatch):
    """Ranks share the stderr pipe; under PYTHONUNBUFFERED `print` writes a line's text and
    its newline apart, and CI once saw two ranks' error lines run together. A pipe write
    under PIPE_BUF is atomic, so one write per line keeps them apart."""
    import io

    from llm_act.train.loop import stderr_line

    calls: list[str] = []

    class Writes(io.StringIO):
        def write(self, s):
            calls.append(s)
            return super().write(s)

    monkeypatch.setattr(sys, "stderr", Writes())
    stderr_line("pretrain_gpt.py: error: the budget is too small")
    assert calls == ["pretrain_gpt.py: error: the budget is too small\n"]
