"""`deepspeed --num_gpus 2 launch/ds_train.py --deepspeed_config launch/ds_config.json` on CPU.

The DeepSpeed launcher starts 2 CPU ranks (its CPU accelerator maps --num_gpus to local
processes). With `--compare` the script trains the megatron-core GPT twice in the same
processes, without and then with compression: the first loss is identical (compression
changes only what backward reads), every later one within `LOSS_TOL`, the saved bytes
smaller. ZeRO-2 is the quick run of the default test set; ZeRO-3 and the broken-codec
companion (a codec decoding zeros, installed in the launched ranks by a sitecustomize) are
`slow`; the companion's quick version runs the launcher's loop on one spawned rank.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

from tests.patches import broken_codec  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
#: relative tolerance on the losses of the compressed run vs the uncompressed one. Measured
#: (ZeRO-2, 3 steps, losses 5.548 -> 4.912): the real codecs 1.1e-4 (step 2) and 1.3e-4
#: (step 3); every site decoding zeros 0.012 and 0.026 (the old tolerance, 0.02, let step 2
#: through). ln1.input of layer 1 decoding zeros: 2.5e-4 and 1.9e-4, only 1.5-2x the real
#: codecs' -- too close to separate by losses without a flaky bound. The script reports no
#: gradients, so the losses are all there is to compare here (the gradient bounds that catch
#: one broken site are in test_hf_zero.py and tests/patches/megatron).
LOSS_TOL = 1e-3


def _launch(stage, folder, env=None, steps=3, extra=()):
    """Run the launcher with `--compare` for `steps` steps (`extra`: more flags of
    launch/ds_train.py); returns its JSON result, with what it printed as "log"."""
    beside = Path(sys.executable).with_name("deepspeed")  # a venv's python run without activating
    launcher = shutil.which("deepspeed") or (str(beside) if beside.exists() else None)
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    from tests.testing import free_port

    out = folder / "result.json"
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "launch/ds_train.py",
           "--deepspeed_config", "launch/ds_config.json", "--zero-stage", str(stage),
           "--steps", str(steps), "--compare", "--json", str(out), *extra]
    env = {k: v for k, v in (env or os.environ).items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"step   {steps}  loss" in proc.stdout and "saved" in proc.stdout
    return {**json.loads(out.read_text()), "log": proc.stdout + proc.stderr}


def _check_losses(off, on):
    """The compressed run's losses follow the uncompressed run's."""
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-6)
    for a, b in zip(on["losses"][1:], off["losses"][1:]):
        assert abs(a - b) <= LOSS_TOL * b, f"relative loss difference {abs(a - b) / b:.3g}"


def _launcher_run(stage, tmp_path):
    result = _launch(stage, tmp_path)
    off, on = result["off"], result["on"]
    assert off["zero_stage"] == on["zero_stage"] == stage
    assert not off["compressed"] and on["compressed"] and on["iteration"] == 3
    _check_losses(off, on)
    assert on["losses"][-1] < on["losses"][0]
    assert max(on["saved_bytes"]) < 0.7 * min(off["saved_bytes"])


@pytest.mark.dist
def test_launcher_run_zero2(tmp_path):
    _launcher_run(2, tmp_path)


@pytest.mark.dist
@pytest.mark.slow
def test_launcher_run_zero3(tmp_path):
    _launcher_run(3, tmp_path)


@pytest.mark.dist
@pytest.mark.slow
def test_launcher_loss_tolerance_fails_with_a_broken_codec(tmp_path):
    """Every codec decoding zeros, in both launched ranks."""
    env = broken_codec.env_for_subprocess(os.environ, tmp_path / "site", broken_codec.ALL)
    result = _launch(2, tmp_path, env)
    with pytest.raises(AssertionError, match="relative loss"):
        _check_losses(result["off"], result["on"])


#: the quick companion's run: launch/ds_train.py's loop on a 1-layer GPT, hidden 32, seq 32
QUICK = ("--num-layers", "1", "--hidden-size", "32", "--seq-length", "32")


def _worker_quick(rank, world, port, kind, out):
    """launch/ds_train.py's `run` (a real DeepSpeed engine, ZeRO-2, `--compare`) in a spawned
    rank, every codec broken as `kind`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from llm_act.train import ds_train as train

    if kind is not None:
        broken_codec.install(broken_codec.ALL, None, kind)
    args = train.build_parser().parse_args(
        ["--deepspeed_config", str(ROOT / "launch" / "ds_config.json"), "--zero-stage", "2",
         "--steps", "2", "--compare", "--json", out, *QUICK])
    train.run(args, log=lambda _m: None)


@pytest.mark.dist
def test_launcher_loss_tolerance_fails_with_a_broken_codec_quick(tmp_path):
    """The default run's version of the slow companion above: the launcher's training loop on
    one spawned rank, a smaller GPT, 2 steps. Measured (relative loss difference at step 2):
    healthy 4.3e-4 on this one rank (5.2e-5 through the launcher on 2), every codec decoding
    zeros 0.018 (0.013). Always rounding down (3.5e-4 on 2 ranks) stays within the
    tolerance: losses cannot see it here; the gradient bounds can (test_hf_zero.py)."""
    from tests.testing import spawn

    out = tmp_path / "result.json"
    spawn(_worker_quick, 1, broken_codec.ZEROS, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["on"]["compressed"] and not result["off"]["compressed"]
    with pytest.raises(AssertionError, match="relative loss"):
        _check_losses(result["off"], result["on"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_launcher_hf_auto_replans_within_the_budget(tmp_path, kind, stage):
    """`--model hf --hf-kind K --act-plan auto --act-budget B` at ZeRO `stage`: plan "auto"
    re-plans the decoder's blocks during the run on both ranks, within the budget, and logs
    each plan (`slow`: the default run's smoke test of the same is test_hf_auto.py's two-rank
    ZeRO-3)."""
    budget = 40_000_000
    result = _launch(stage, tmp_path, steps=4, extra=("--model", "hf", "--hf-kind", kind, "--act-plan", "auto",
                                                   "--act-budget", str(budget)))
    on = result["on"]
    assert on["model"] == "hf" and on["compressed"] and on["tracked"] == [1, 2, 4]
    assert on["plan_changes"] and on["plan_changes"][0]["reason"] == "first plan"
    assert all(h["predicted_bytes"] <= budget for h in on["plan_changes"])
    assert "iteration 1: plan changed" in result["log"]  # the plan, in the run's log
