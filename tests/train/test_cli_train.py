"""`llm-act train`: stock and compressed side by side; the table, the losses, the plot."""
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def llm_act(*argv, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "llm_act.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _row(out, label):
    m = re.search(rf"^{re.escape(label)} +(\S+) +(\S+)", out, re.M)
    assert m, f"no row {label!r} in\n{out}"
    return m.group(1), m.group(2)


def test_llm_act_train_prints_the_table_and_writes_the_plot(tmp_path):
    proc = llm_act("train", "--train-iters", "12", "--hidden-size", "64", "--seq-length", "64",
                   "--log-interval", "4", "--eval-iters", "1", "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "saved activations per micro-batch" in out and "plan='compress'" in out
    assert re.search(r"sha256 [0-9a-f]{64}", out)
    layers = {}
    for label in ("layer 0", "layer 1", "total"):
        stock, comp = map(float, _row(out, label)[:2])
        layers[label] = (stock, comp)
        assert 0 < comp < stock  # the compressed layers store less
    assert math.isclose(layers["layer 0"][0] + layers["layer 1"][0], layers["total"][0], rel_tol=0.2)
    first = tuple(map(float, _row(out, "first train loss")))
    final = tuple(map(float, _row(out, "final train loss")))
    # same seed, data and initial weights; the compressed run's memory-efficient attention
    # draws its attention-dropout masks in chunks (not stock's masks): close, not equal
    assert abs(first[0] - first[1]) < 0.02
    for a, b in zip(first, final):
        assert math.isfinite(b) and b < a - 0.5
    assert abs(final[0] - final[1]) < 0.1
    ratio = float(re.search(r"tokens/s ratio compressed/stock: (\S+)", out).group(1))
    assert 0 < ratio < 10
    plot = tmp_path / "train_memory_per_site.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {plot}" in out


def test_llm_act_train_rejects_bad_flags():
    proc = llm_act("train", "--fp16")
    assert proc.returncode == 2 and "--fp16: not supported" in proc.stderr
    proc = llm_act("train", "--act-compress-budget", "ten")
    assert proc.returncode == 2 and "argument --act-compress-budget" in proc.stderr
    proc = llm_act("train", "--tensor-model-parallel-size", "2")
    assert proc.returncode == 2 and "torchrun" in proc.stderr
