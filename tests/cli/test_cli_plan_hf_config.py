"""`llm-act plan --hf-config PATH`: a published config.json is planned like a preset (the header
names its model_type and path, the per-layer rows follow, the JSON report names both); one the planner cannot plan, or a
file that is not one, is refused in one line with exit code 2; --model and --hf-config are
one or the other."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from llm_act.cli.main import main
from tests.cli.hf_configs import GPT2, LLAMA3_8B, MISTRAL_7B, MIXTRAL, QWEN2_05B, QWEN3_06B, QWEN3_8B, write

ROW = re.compile(r"^  (ln1\.input|attn\.q|mlp\.fc1_input)\s+(keep|recompute|\S+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$", re.M)


@pytest.mark.parametrize("config, argv", [
    (GPT2, []),
    (LLAMA3_8B, ["--tp", "8"]),
    (QWEN2_05B, ["--seq-length", "4096"]),
    (QWEN3_8B, ["--seq-length", "4096", "--tp", "4"]),
    (MISTRAL_7B, ["--seq-length", "4096", "--tp", "4"]),
])
def test_published_configs_plan_within_80gb(capsys, tmp_path, config, argv):
    path = write(tmp_path, config)
    report = tmp_path / "plan.json"
    code = main(["plan", "--hf-config", str(path), "--budget", "80GB", "--json", str(report), *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith(f'# llm-act plan model="{config["model_type"]}" hf_config={json.dumps(str(path))} ')
    assert len(ROW.findall(out)) == 3 and "predicted activation memory" in out and "overhead" in out
    saved = json.loads(report.read_text())
    assert (saved["model"], saved["hf_config"], saved["feasible"]) == (config["model_type"], str(path), True)


@pytest.mark.parametrize("name, text, argv, message", [
    ("missing", None, [], "cannot read it (No such file or directory)"),
    ("not json", "model_type: llama", [], "not a JSON file"),
    ("a list", "[1, 2]", [], "not a config.json (a JSON list, not an object)"),
    ("mixtral", json.dumps(MIXTRAL), [], "model_type 'mixtral' is not planned from a config.json; supported: "
                                         "gpt2, llama, mistral, qwen2, qwen3"),
    ("qwen2_moe", json.dumps({**QWEN2_05B, "model_type": "qwen2_moe"}), [], "model_type 'qwen2_moe'"),
    ("deepseek_v3", json.dumps({"model_type": "deepseek_v3"}), [], "model_type 'deepseek_v3'"),
    ("qwen3-0.6b", json.dumps(QWEN3_06B), [], "head_dim=128 is not hidden_size / num_attention_heads"),
    ("mistral window", json.dumps(MISTRAL_7B), [], "sliding_window=4096 is shorter than the 32768-token"),
    ("mistral window vs flag", json.dumps(MISTRAL_7B), ["--seq-length", "4097"], "sliding_window=4096 is "
                                                                                  "shorter than the 4097-token"),
    ("experts", json.dumps({**LLAMA3_8B, "num_experts": 8}), [], "num_experts is set: a mixture of experts"),
    ("activation", json.dumps({**LLAMA3_8B, "hidden_act": "relu2"}), [], 'hidden_act="relu2": '),
])
def test_a_config_that_cannot_be_planned_is_one_line(capsys, tmp_path, name, text, argv, message):
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as err:
        main(["plan", "--hf-config", str(path), "--budget", "80GB", *argv])
    captured = capsys.readouterr()
    assert err.value.code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"llm-act plan: error: argument --hf-config {path}: {message}"), captured.err


def test_a_refusal_from_the_command_line_has_no_traceback(tmp_path):
    """The real command (megatron-core's import-time warnings silenced): stderr is the one line."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "llm_act.cli", "plan", "--hf-config",
                           str(write(tmp_path, QWEN3_06B)), "--budget", "80GB"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"llm-act plan: error: argument --hf-config {tmp_path / 'config.json'}: "
                                        f"head_dim=128 is not hidden_size / num_attention_heads = 1024 / 16 = 64: "
                                        f"the planner derives the head width from those two, so this model's "
                                        f"attention cannot be planned"]


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --model --hf-config is required"),
    (["--model", "llama-8b", "--hf-config", "config.json"], "argument --hf-config: not allowed with argument --model"),
])
def test_model_or_hf_config(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        main(["plan", "--budget", "80GB", *argv])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_a_flag_the_config_cannot_take_names_the_flag(capsys, tmp_path):
    path = write(tmp_path, LLAMA3_8B)
    with pytest.raises(SystemExit):
        main(["plan", "--hf-config", str(path), "--budget", "80GB", "--tp", "3"])
    assert f"argument --tp: tp=3 does not divide num_attention_heads=32 (--hf-config {path})" in capsys.readouterr().err
