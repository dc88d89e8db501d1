"""`deepspeed --num_gpus 2 launch/ds_train.py --deepspeed_config launch/ds_config.json` on CPU.

The DeepSpeed launcher starts 2 CPU ranks (its CPU accelerator maps --num_gpus to local
processes). With `--compare` the script trains the megatron-core GPT twice in the same
processes, without and then with compression: the first loss is identical (compression
changes only what backward reads), the last within `LOSS_TOL`, the saved bytes smaller.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
LOSS_TOL = 0.02


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_launcher_run(stage, tmp_path):
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    out = tmp_path / "result.json"
    from llm_act.testing import free_port

    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "launch/ds_train.py", "--deepspeed_config",
           "launch/ds_config.json", "--zero-stage", str(stage), "--steps", "3", "--compare",
           "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step   3  loss" in proc.stdout and "saved" in proc.stdout
    result = json.loads(out.read_text())
    off, on = result["off"], result["on"]
    assert off["zero_stage"] == on["zero_stage"] == stage
    assert not off["compressed"] and on["compressed"] and on["iteration"] == 3
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-6)
    assert abs(on["losses"][-1] - off["losses"][-1]) <= LOSS_TOL * off["losses"][-1]
    assert on["losses"][-1] < on["losses"][0]
    assert max(on["saved_bytes"]) < 0.7 * min(off["saved_bytes"])
