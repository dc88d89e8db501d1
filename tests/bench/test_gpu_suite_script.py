"""The GPU script, prepared (issue 43 item 7): on a machine without a GPU `tools/gpu_suite.sh`
stops at once with its no-GPU message (exit 3, NO_GPU.txt under $OUT, nothing measured), and
the GPU bench it runs imports and answers --help on this megatron-core (0.19 in the 3.12 venv)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_suite_stops_with_its_no_gpu_message(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would measure")
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_suite.sh")], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "gpu_suite.sh: no GPU here" in done.stderr
    assert "to a GPU host with Python 3.12" in done.stderr
    assert (tmp_path / "NO_GPU.txt").read_text().startswith("gpu_suite.sh: no GPU here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["NO_GPU.txt"]  # nothing measured


def test_the_gpu_bench_imports_and_answers_help():
    pytest.importorskip("megatron.core")  # the bench builds megatron-core models
    code = "import llm_act.bench.gpu; from llm_act.cli.main import main; main(['bench', 'gpu', '--help'])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: llm-act bench gpu" in done.stdout
