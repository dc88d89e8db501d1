"""An impossible `--act-compress-budget` ends `pretrain_gpt.py` (our torchrun loop) at its
first iteration with exit code 2 and one line naming the smallest budget that works, as
`llm-act plan` does; no traceback, no run over budget."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_impossible_budget_is_refused_with_exit_code_2(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "pretrain_gpt.py"), "--train-iters", "3",
         "--lr-warmup-iters", "0", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--eval-iters", "0", "--act-compress", "--act-compress-plan", "auto",
         "--act-compress-budget", "1MB"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and " iteration        2/" not in proc.stdout
    m = re.search(r"pretrain_gpt\.py: error: the activation budget of 1000000 bytes .* the smallest budget any "
                  r"plan fits is (\d+) bytes .* raise --act-compress-budget .* to at least ([\d.]+)GB", proc.stderr)
    assert m, proc.stderr[-2000:]
    assert int(m.group(1)) > 10**6 and float(m.group(2)) * 1e9 >= int(m.group(1))
