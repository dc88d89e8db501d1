"""Checkpoint save + resume continues exactly as the uninterrupted run (single rank,
in-process): model, optimizer with fp32 masters, LR schedule, data position, every RNG
(dropout on) and the act Controller's state all come back."""
import os

import pytest
import torch

from llm_act.train import loop, parallel
from llm_act.train.args import parse_args

#: the tiny model and batch (--lr-decay-iters left to its default, --train-iters)
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "3e-3", "--lr-warmup-iters", "1", "--eval-iters", "1",
        "--log-interval", "1", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
SMALL = TINY + ["--lr-decay-iters", "6"]


def run(argv, lines=None, base=SMALL):
    args = parse_args(base + argv)
    parallel.init(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: bit-identical sums in every run
    try:
        return loop.train(args, log=(lines.append if lines is not None else lambda m: None))
    finally:
        torch.set_num_threads(threads)
        parallel.destroy_parallel()


@pytest.mark.parametrize("extra", [["--act-compress", "--act-compress-plan", "compress"], ["--bf16"]],
                         ids=["compress-fp32", "stock-bf16"])
def test_save_and_resume_gives_the_uninterrupted_losses(tmp_path, extra):
    full = run(["--train-iters", "6"] + extra)
    ckpt = str(tmp_path / "ckpt")
    first = run(["--train-iters", "3", "--save", ckpt] + extra)
    assert first["losses"] == full["losses"][:3]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert os.path.exists(os.path.join(ckpt, "iter_0000003", "mp_rank_00_000_000", "model_optim_rng.pt"))
    lines = []
    resumed = run(["--train-iters", "6", "--load", ckpt] + extra, lines)
    assert any("loaded checkpoint of iteration 3" in line for line in lines)
    assert resumed["losses"] == full["losses"][3:]  # exactly, not approximately
    assert resumed["valid_loss"] == full["valid_loss"]
    assert full["losses"][-1] < full["losses"][0]
    if "--act-compress" in extra:  # same flags: plan and codec streams restored, and said so
        assert resumed["trainer"].controller.iteration == 6
        assert any(line.startswith(" > act plan: restored the checkpoint's plan") for line in lines)
        restored = [line for line in lines if line.startswith(" > act codecs: restored the random streams")]
        assert len(restored) == 1 and "replaced" not in restored[0] and " of 0 codecs" not in restored[0]


def test_loading_weights_without_the_optimizer_moves_the_bf16_masters_with_them(tmp_path):
    """--no-load-optim in bf16: the loaded weights reach the optimizer's fp32 masters
    (`reload_model_params`), so the next step starts from them; without it, the step copies
    the new run's own initial weights (another seed here) back over them. (The GPU path did
    skip it: megatron-core's optimizer now gets its own `reload_model_params` call there, not
    run here without a GPU.)"""
    ckpt = str(tmp_path / "ckpt")
    saved = run(["--train-iters", "3", "--save", ckpt, "--bf16"])["trainer"]
    at_save = [p.detach().float().clone() for c in saved.chunks for p in c.parameters()]
    lines = []
    resumed = run(["--train-iters", "4", "--load", ckpt, "--no-load-optim", "--bf16", "--seed", "4321"],
                  lines)["trainer"]
    assert any("loaded checkpoint of iteration 3" in line for line in lines)
    after = [p.detach().float() for c in resumed.chunks for p in c.parameters()]
    # one AdamW step at lr <= 3e-3 moves a weight by about the lr; another initialisation
    # (std 0.02) is an order of magnitude further
    assert max(float((a - b).abs().max()) for a, b in zip(after, at_save)) < 0.012


def test_resume_with_another_model_shape_is_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run(["--train-iters", "1", "--save", ckpt])
    with pytest.raises(ValueError, match="--hidden-size saved 64, now 128"):
        run(["--train-iters", "2", "--load", ckpt, "--hidden-size", "128"])


def test_load_from_an_empty_directory_starts_from_scratch(tmp_path):
    lines = []
    out = run(["--train-iters", "1", "--load", str(tmp_path)], lines)
    assert out["iterations"] == 1
    assert any("no checkpoint there yet" in line for line in lines)
    assert any(line.startswith(" iteration        1/") and "saved activations:" in line
               and "plan: stock" in line for line in lines)
    assert any(line.startswith("summary: 1 iterations") for line in lines)


def test_text_file_and_indexed_dataset_train_with_periodic_validation(tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    text = tmp_path / "notes.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 400)
    lines = []
    out = run(["--train-iters", "2", "--eval-interval", "1", "--data-path", str(text)], lines)
    assert any(f"data: text file {text} (bytes)" in line for line in lines)
    assert any(line.startswith(" validation loss at iteration 1:") for line in lines)
    assert out["valid_loss"] is not None and out["valid_loss"] < 6

    prefix = str(tmp_path / "docs_text_document")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for i in range(30):
        builder.add_document(np.arange(20 * i, 20 * i + 200) % 700, [200])
    builder.finalize(get_idx_path(prefix))
    lines = []
    out = run(["--train-iters", "2", "--data-path", prefix], lines)
    assert any("indexed dataset" in line and "vocab 700" in line for line in lines)
    assert any("vocab 700;" in line for line in lines if line.startswith("model:"))
    emb = out["trainer"].chunks[0].embedding.word_embeddings.weight
    assert emb.shape[0] == 768  # padded to a multiple of 128, as Megatron-LM does


def test_auto_plan_measures_from_the_loops_own_steps(caplog):
    """Plan "auto" in the loop: no probe; the controller records the training step of the
    tracking iterations 1, 2, 4 and measures and plans from it (no "could not measure"
    warning); the losses fall, and the run is deterministic with the measuring passes in it."""
    import logging

    extra = ["--act-compress", "--act-compress-plan", "auto",
             "--train-iters", "4"]
    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        out = run(extra)
    ctl = out["trainer"].controller
    assert ctl._probe is None and ctl.adapter.replay.calls == {}  # nothing held after the step
    assert ctl.adapter.tracked == [1, 2, 4]
    assert ctl.adapter.history and ctl.adapter.measured.profile is not None and ctl.adapter.measured.sensitivity
    assert not any("could not measure" in r.getMessage() for r in caplog.records)
    assert all(x == x for x in out["losses"]) and out["losses"][-1] < out["losses"][0]
    again = run(extra)
    plans_a = [h["changes"] for h in ctl.history]
    plans_b = [h["changes"] for h in again["trainer"].controller.history]
    if plans_a == plans_b:  # the same decisions: the measuring passes moved nothing of the run
        assert again["losses"] == out["losses"]
    else:  # op times are measured (wall clock): near-ties between options may flip between
        # runs on a loaded machine; each run's plans then still fit the same budget
        for h in ctl.history + again["trainer"].controller.history:
            assert h["predicted_bytes"] <= ctl.adapter.budget


def test_resume_with_another_plan_takes_the_flags_plan_and_says_so(tmp_path):
    """--act-compress-* flags given now win over the checkpointed controller: the plan of
    the new flags is in force (and is what trains), the iteration still comes back."""
    from llm_act.plan import is_keep

    ckpt = str(tmp_path / "ckpt")
    run(["--train-iters", "2", "--save", ckpt, "--act-compress", "--act-compress-plan", "compress"])
    lines = []
    out = run(["--train-iters", "3", "--load", ckpt, "--act-compress", "--act-compress-plan", "keep"], lines)
    ctl = out["trainer"].controller
    assert is_keep(ctl.plan) and ctl.iteration == 3
    assert " > act plan: plan: checkpoint 'compress', now 'keep' -> the plan of the current flags; " \
           "the checkpoint's plan and adaptive-planner state are not restored" in lines
    assert " > act controller: restored iteration 2" in lines
    assert any(line.startswith(" iteration        3/") and "plan: keep" in line for line in lines)


def test_resume_with_act_compress_turned_on_starts_the_controller_at_the_iteration(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run(["--train-iters", "2", "--save", ckpt])
    lines = []
    out = run(["--train-iters", "3", "--load", ckpt, "--act-compress", "--act-compress-plan", "compress"],
              lines)
    assert out["trainer"].controller.iteration == 3
    assert any("the checkpoint has none (saved without --act-compress); starting at iteration 2" in line
               for line in lines)
