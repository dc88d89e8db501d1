"""`llm-act plan --output-loss`: the final norm's input, the output layer's input and the loss
counted under each output choice, both figures printed on the "outside the blocks" line,
and "auto" choosing the chunked loss at a budget only it fits (stock where memory is plentiful)."""
from __future__ import annotations

import json
import re

import pytest

from llm_act.cli.main import main
from llm_act.output import stock_logits_bytes, stored_bytes
from llm_act.planner.analytic import outer_profile
from llm_act.planner.presets import model_shape
from llm_act.planner.static_memory import loss_bytes, outer_bytes

# GPT-2 medium at micro-batch 16: the stock logits (3.1 GiB) outweigh every block's activations
BASE = ["plan", "--model", "gpt2-medium", "--seq-length", "1024", "--micro-batch-size", "16"]
_OUTSIDE = re.compile(r"output loss: (\w+) \(output layer input \+ loss state: stock ([\d.]+) GiB, "
                      r"chunked ([\d.]+) GiB\)")
_NEED = re.compile(r"smallest budget that works for every stage is (\d+) bytes")


def _run(capsys, *extra):
    code = main([*BASE, *extra])
    return code, capsys.readouterr().out


def test_outer_bytes_under_each_output_loss():
    shape = model_shape("gpt2-medium", seq_length=1024, micro_batch_size=16)
    tokens, h, v, e = 1024 * 16, shape.hidden_size, shape.padded_vocab_size, shape.elem_bytes
    stock, chunked = outer_bytes(shape, 0, "stock"), outer_bytes(shape, 0, "chunked")
    # the final norm's input is planned (a block of the last stage), not counted here
    assert "final_norm.input" not in stock and "final_norm.input" not in chunked
    final = outer_profile(shape)
    assert [s.name for s in final.sites] == ["final_norm.input"] and final.count == 1
    assert final.sites[0].nbytes == tokens * h * e + 8 * tokens  # with the LayerNorm's fp32 mean, rstd
    assert stock["output_layer.input"] == tokens * h * e
    assert stock["loss.logits"] == stock_logits_bytes(tokens, v)  # fp32 softmax + mask + target
    assert "loss.logits" not in chunked
    assert chunked["output_layer.input"] + chunked["loss.logsumexp"] - stock["output_layer.input"] \
        == stored_bytes(tokens, h, e) - tokens * h * e
    assert outer_bytes(shape, 0) == stock  # the default
    # sequence parallel: each rank keeps its half of the hidden states; the loss state covers
    # every token, and the saving is stock's logits over every token as before
    sp = model_shape("gpt2-medium", seq_length=1024, tp=2, sequence_parallel=True)
    stock_sp, chunked_sp = outer_bytes(sp, 0, "stock"), outer_bytes(sp, 0, "chunked")
    assert chunked_sp["output_layer.input"] == stock_sp["output_layer.input"] < stock["output_layer.input"]
    assert chunked_sp["loss.logsumexp"] == 4 * sp.seq_length * sp.micro_batch_size
    assert stock_sp["loss.logits"] == stock_logits_bytes(1024 * sp.micro_batch_size, sp.padded_vocab_size // 2)


def test_auto_picks_chunked_at_a_tight_budget_and_prints_both(capsys, tmp_path):
    code, out = _run(capsys, "--budget", "1GB", "--output-loss", "stock")
    assert code == 2
    stock_need = int(_NEED.search(out).group(1))
    code, out = _run(capsys, "--budget", "1GB", "--output-loss", "chunked")
    assert code == 2
    chunked_need = int(_NEED.search(out).group(1))
    m = _OUTSIDE.search(out)
    assert m and m.group(1) == "chunked"
    saving = stock_need - chunked_need
    # at the least budget the stock loss's end of forward binds: the two differ by at most
    # their loss events (the stock loss: its fp32 softmax and the 16-bit logits beside it;
    # less where a block's backward binds the chunked loss's least budget), at least by what
    # the stock loss stores
    shape = model_shape("gpt2-medium", seq_length=1024, micro_batch_size=16)
    events = loss_bytes(shape, output_loss="stock") - loss_bytes(shape, output_loss="chunked")
    stored = sum(outer_bytes(shape, 0, "stock").values()) - sum(outer_bytes(shape, 0, "chunked").values())
    assert stored < saving <= events + 2**21  # the noise budget's bisection: 1 MiB steps
    assert float(m.group(2)) - float(m.group(3)) == pytest.approx(stored / 2**30, abs=2e-3)
    assert stored > 3 * 2**30  # the fp32 logits of 16k tokens at vocab 50k
    # between the two: stock does not fit, "auto" (the default) picks the chunked loss
    budget = str((stock_need + chunked_need) // 2)
    code, out = _run(capsys, "--budget", budget, "--output-loss", "stock")
    assert code == 2
    path = tmp_path / "plan.json"
    code, out = _run(capsys, "--budget", budget, "--json", str(path))
    assert code == 0, out
    m = _OUTSIDE.search(out)
    assert m and m.group(1) == "chunked" and float(m.group(2)) > 3 > float(m.group(3))
    assert "for the chunked loss's extra logits GEMM" in out
    report = json.loads(path.read_text())
    stage = report["stages"][-1]
    assert stage["output_loss"] == "chunked" and stage["total_bytes"] <= int(budget)
    assert stage["output_bytes"]["stock"] - stage["output_bytes"]["chunked"] == stored
    assert stage["output_gemm_ms"] > 0
    # plentiful memory: stock (its plan adds nothing, the chunked loss would add a GEMM)
    code, out = _run(capsys, "--budget", "80GB")
    assert code == 0 and _OUTSIDE.search(out).group(1) == "stock"
    assert re.search(r"overhead\s+0\.000 ms", out)


def test_chunked_with_sequence_parallel_is_planned(capsys):
    code, out = _run(capsys, "--budget", "80GB", "--tp", "2", "--sequence-parallel", "--output-loss", "chunked")
    assert code == 0 and "output loss: chunked" in out


def test_the_final_norm_is_priced_and_printed(capsys, tmp_path):
    """`llm-act plan` prices the final norm's input with the last stage's blocks and prints its
    choice once; at a tight budget it is compressed, and the JSON plan carries the choice in
    the last layer's."""
    path = tmp_path / "plan.json"
    code, out = _run(capsys, "--budget", "12GB", "--json", str(path))
    assert code == 0, out
    line = next(row for row in out.splitlines() if row.strip().startswith("final_norm.input"))
    name = line.split()[1]
    assert name not in ("keep", "recompute") and "(once, after layer 23)" in line
    report = json.loads(path.read_text())
    assert report["stages"][-1]["after_blocks"] == {"final_norm.input": name}
    runs = report["plan"]["blocks"]
    assert runs[-1]["layers"][1] == 23 and runs[-1]["choice"]["final_norm.input"] == name
    assert all("final_norm.input" not in run["choice"] for run in runs[:-1])
    # a generous budget keeps it
    code, out = _run(capsys, "--budget", "40GB")
    line = next(row for row in out.splitlines() if row.strip().startswith("final_norm.input"))
    assert line.split()[1] == "keep"
