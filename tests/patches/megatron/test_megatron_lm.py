"""Megatron-LM's own `pretrain_gpt.py` with the README's recipe, on CPU over gloo.

Runs only where `MEGATRON_LM_PATH` names a Megatron-LM checkout at tag core_v0.16.1 (with
Megatron-LM's own needs importable: `six`, and `pybind11` for its dataset helpers) or branch
core_r0.19.0 (where the installed megatron-core 0.19 wheel ships the checkout's
`megatron.training`, the run takes the installed megatron and the checkout's top-level scripts:
`megatron_lm_recipe.uses_installed_megatron`); skipped otherwise. For 1 rank, TP=2 and PP=2, stock and `--act-compress` (plan "auto") train 5
iterations of a 4-layer GPT on mock data: the losses agree within 0.1%, and the controller
printed its start plan (once per pipeline stage) and re-planned at an iteration > 0 with
its predicted bytes, inside `pretrain()` with no call of ours. Also: `install(megatron_lm=True)` with the checkout
importable patches every stand-in once. docs/megatron_lm.md records such a run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.patches.megatron import megatron_lm_recipe as recipe

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_PATH does not name a Megatron-LM checkout"),
]

ITERS = 5
_REPLANNED = re.compile(r"llm_act: iteration (\d+): plan changed: .* \| predicted memory [0-9.]+ MiB of the "
                        r"[0-9.]+ MiB budget")


def _train(tmp_path: Path, tag: str, **kwargs) -> str:
    out = tmp_path / tag
    out.mkdir()
    recipe.write_recipe(Path(CHECKOUT), out)
    done = recipe.run(Path(CHECKOUT), out, iters=ITERS, **kwargs)
    assert done.returncode == 0, f"{tag} failed (rc {done.returncode}):\n{done.stdout[-6000:]}"
    return done.stdout


@pytest.mark.parametrize("nproc,tp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2)], ids=["1rank", "tp2", "pp2"])
def test_pretrain_gpt_with_the_recipe(tmp_path, nproc, tp, pp):
    stock_log = _train(tmp_path, "stock", nproc=nproc, tp=tp, pp=pp)
    ours_log = _train(tmp_path, "compress", nproc=nproc, tp=tp, pp=pp, compress=True)
    stock, ours = recipe.losses(stock_log), recipe.losses(ours_log)
    assert sorted(stock) == sorted(ours) == list(range(1, ITERS + 1)), (stock, ours)
    for it in stock:
        assert abs(ours[it] - stock[it]) <= 1e-3 * abs(stock[it]), (it, stock[it], ours[it])
    assert "llm_act:" not in stock_log  # without --act-compress nothing of ours runs
    # printed once per pipeline stage (its ranks hold one agreed plan), not once per rank
    assert ours_log.count("llm_act: plan in force at the start ('auto'") == pp
    replans = [int(it) for it in _REPLANNED.findall(ours_log)]
    assert replans and min(replans) >= 1, ours_log[-4000:]


def test_install_with_megatron_lm_is_idempotent_and_patches_every_stand_in(tmp_path):
    """In a fresh process with the checkout importable (as the runs import it): the first
    install patches each stand-in the docstring of cpu_shim_megatron_lm lists, those of the
    modules only some versions have where they exist (0.16: `megatron.legacy`; 0.19:
    `megatron.training.models.dist_utils`, `megatron.training.utils.common_utils`), the
    second nothing."""
    from llm_act.cpu import megatron_lm as lm

    optional = {"megatron.legacy.fused_kernels": "megatron.legacy.fused_kernels.load"}
    optional.update((name, f"{name}.torch") for name in lm._OPTIONAL_TRAINING_MODULES)
    code = ("import llm_act.cpu\n"
            "from llm_act.patches.megatron.compat import optional_module\n"
            "first = llm_act.cpu.install(megatron_lm=True)\n"
            f"print([m for m in {sorted(optional)!r} if optional_module(m)])\n"
            "print(sorted(first)); print(llm_act.cpu.install(megatron_lm=True))\n")
    done = subprocess.run([sys.executable, "-c", code], env=recipe.environment(Path(CHECKOUT)),
                          cwd=tmp_path, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    present, first, second = done.stdout.strip().splitlines()[-3:]
    assert second == "[]"
    for name in ("megatron.training.initialize.initialize_megatron", "megatron.training.training.initialize_megatron",
                 "megatron.training.training.torch",
                 "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
                 "megatron.core.rerun_state_machine.torch", "torch.nn.Module.cuda", "torch.Tensor.cuda"):
        assert repr(name) in first, (name, first)
    for module, name in optional.items():
        assert (repr(name) in first) == (repr(module) in present), (name, present, first)
