"""The Megatron-LM stand-ins of the CPU shim (`shim.install(megatron_lm=True)`), tested
without a Megatron-LM checkout: the request is refused with the fix named, before anything
changes; nothing happens where CUDA is available; the megatron-core part
(`shim.install_core`) is idempotent and leaves someone else's patch alone; clip_grads' CUDA-type
assert gives way for CPU fp32 gradients only; and plan "auto" advances and re-plans at the
step of megatron-core's own `MegatronOptimizer` over its DDP, with no call of ours.
The run through Megatron-LM's `pretrain()` is tests/patches/megatron/test_megatron_lm.py.
"""
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only torch")

from llm_act import ActConfig  # noqa: E402
from llm_act.runtime.controller import ANY_OPTIMIZER  # noqa: E402
from llm_act.cpu import shim  # noqa: E402
from llm_act.cpu import megatron_lm as lm  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

NO_MEGATRON_LM = importlib.util.find_spec("megatron.training") is None


@pytest.mark.skipif(not NO_MEGATRON_LM, reason="Megatron-LM is importable here")
def test_without_megatron_lm_the_request_names_the_fix_and_changes_nothing():
    module_cuda, tensor_cuda = torch.nn.Module.cuda, torch.Tensor.cuda
    with pytest.raises(ModuleNotFoundError, match=r"megatron\.training.*core_v0\.16\.1.*PYTHONPATH"):
        shim.install(megatron_lm=True)
    assert torch.nn.Module.cuda is module_cuda and torch.Tensor.cuda is tensor_cuda
    assert not lm.installed()


def test_nothing_happens_where_cuda_is_available(monkeypatch):
    import megatron.core.timers as timers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = timers.torch
    assert shim.install(megatron_lm=True) == []
    assert shim.install_core() == []
    assert timers.torch is before and not getattr(torch.nn.Module.cuda, shim.MARK, False)


def test_install_core_is_idempotent_and_leaves_others_patches_alone(monkeypatch):
    import megatron.core.optimizer.clip_grads as clip
    import megatron.core.rerun_state_machine as rerun
    import megatron.core.timers as timers

    shim.install_core()
    assert shim.install_core() == []  # second call: nothing left
    for module in (timers, rerun, clip):
        assert getattr(module.torch, shim.MARK, False) and module.torch.__wrapped__ is torch
    cuda = timers.torch.cuda
    assert cuda.device_count() == 1 and cuda.current_device() == torch.device("cpu")
    assert cuda.get_device_properties(0).total_memory > 0
    state = torch.get_rng_state()
    assert torch.equal(rerun.torch.cuda.get_rng_state(), state)  # CUDA's RNG played by the CPU's
    theirs = object()
    monkeypatch.setattr(timers, "torch", torch)  # as stock again ...
    monkeypatch.setattr(clip, "clip_grad_by_total_norm_fp32", theirs)  # ... but this one is someone's
    assert shim.install_core() == ["megatron.core.timers.torch"]
    assert clip.clip_grad_by_total_norm_fp32 is theirs


def _params(*grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_clip_grads_scales_cpu_fp32_gradients_as_the_cuda_path_does():
    import megatron.core.optimizer.clip_grads as clip

    shim.install_core()
    ours = clip.clip_grad_by_total_norm_fp32
    assert getattr(ours, shim.MARK, False)
    with pytest.raises(AssertionError):  # the stock assert: CUDA float gradients only
        ours.__wrapped__(_params(torch.ones(3)), 1.0, 10.0)
    a, b = torch.arange(4.0), torch.full((2, 3), -2.0)
    params = _params(a, b)
    params[1].decoupled_grad = "someone's"
    ours(params, max_norm=1.0, total_norm=4.0)
    coeff = 1.0 / (4.0 + 1e-6)
    torch.testing.assert_close(params[0].grad, a * coeff)
    torch.testing.assert_close(params[1].grad, b * coeff)
    assert not hasattr(params[0], "decoupled_grad") and params[1].decoupled_grad == "someone's"
    with pytest.raises(AssertionError, match="fp32"):
        ours(_params(torch.ones(2, dtype=torch.bfloat16)), 1.0, 10.0)


@pytest.mark.usefixtures("megatron_one_rank")
def test_auto_replans_at_the_step_of_megatron_cores_own_optimizer():
    """megatron-core's DDP and `get_megatron_optimizer` (a MegatronOptimizer whose torch
    AdamW steps the grad buffers' copies), driven as Megatron-LM's `train_step` drives them:
    the controller advances at each step and measures from the recorded training step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from llm_act.patches.megatron import apply
    from tests import gpt_runs as R

    shim.install_core()
    model = R.build(num_layers=2, dropout=0.0)
    controller = apply(model, ActConfig(plan="auto"))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [ddp])

    def forward_step(data_iterator, model):
        ids, pos, labels = next(data_iterator)
        return model(ids, pos, None, labels=labels), lambda out: (out.float().mean(), {})

    for step in range(4):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([R.batch(seed=10 * step + m) for m in range(2)]),
            model=[ddp], num_microbatches=2, seq_length=R.SEQ, micro_batch_size=R.BATCH, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
    assert controller.iteration == 4 and controller.boundary == ANY_OPTIMIZER
    assert controller.adapter.tracked == [1, 2, 4]  # measured at 1, 2, 4 without a probe
    assert controller.history and controller.history[0]["reason"] == "first plan"


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parents[2]))


_HIDE_LEGACY = "import sys; sys.modules['megatron.legacy'] = None\n"


@pytest.mark.skipif(NO_MEGATRON_LM, reason="no megatron.training here (megatron-core 0.16's wheel "
                    "ships none; the checkout run is tests/patches/megatron/test_megatron_lm.py)")
def test_without_megatron_legacy_every_other_stand_in_goes_in_once():
    """megatron-core 0.19's wheel ships `megatron.training` but no `megatron.legacy`: in a fresh
    process (legacy hidden, wherever it might exist) the Megatron-LM stand-ins go in without
    the fused-kernel one, and a second install changes nothing."""
    done = _fresh(_HIDE_LEGACY + (
        "import llm_act.cpu\n"
        "first = llm_act.cpu.install(megatron_lm=True)\n"
        "print(sorted(first)); print(llm_act.cpu.install(megatron_lm=True))\n"))
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    assert second == "[]"
    assert "megatron.legacy" not in first
    for name in ("megatron.training.initialize.initialize_megatron", "megatron.training.training.torch",
                 "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
                 "torch.nn.Module.cuda", "torch.Tensor.cuda"):
        assert repr(name) in first, (name, first)


@pytest.mark.skipif(NO_MEGATRON_LM, reason="no megatron.training here: "
                    "test_without_megatron_lm_the_request_names_the_fix_and_changes_nothing")
def test_a_missing_module_of_megatron_lm_leaves_nothing_patched():
    """One module the stand-ins patch is missing: install raises naming the fix before it
    patches anything (megatron-core's part included), so no process is left half patched."""
    done = _fresh(
        "import sys; sys.modules['megatron.training.utils'] = None\n"
        "import torch, llm_act.cpu\n"
        "import megatron.core.timers as timers\n"
        "cuda = torch.nn.Module.cuda\n"
        "try:\n"
        "    llm_act.cpu.install(megatron_lm=True)\n"
        "except ModuleNotFoundError as err:\n"
        "    print('refused:', err)\n"
        "print(timers.torch is torch, torch.nn.Module.cuda is cuda, llm_act.cpu.installed())\n")
    assert done.returncode == 0, done.stderr[-4000:]
    refused, state = done.stdout.strip().splitlines()[-2:]
    assert refused.startswith("refused:") and "megatron.training" in refused and "PYTHONPATH" in refused
    assert state == "True True False"
