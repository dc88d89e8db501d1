"""The Megatron-LM CPU stand-ins across Megatron-LM versions (`megatron_lm`), each in
a fresh process where `megatron.training` is importable (megatron-core 0.19's wheel ships it):
the modules only some versions have (0.16: `megatron.legacy`; 0.19:
`megatron.training.models.dist_utils`, `megatron.training.utils.common_utils`) get their stand-in
where they exist; one that exists but fails to import stops the install before anything is
patched; and Megatron-LM's script run as `__main__` (0.19's `pretrain_gpt.py` moves its batch
with `.cuda()` itself) keeps its tensors on the CPU, while any other script's `.cuda()` still
refuses. The full run is tests/patches/megatron/test_megatron_lm.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only torch"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                       or importlib.util.find_spec("megatron.training") is None,
                       reason="no megatron.training here (megatron-core 0.16's wheel ships none)"),
]

ROOT = Path(__file__).resolve().parents[3]


def _fresh(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=300,
                          cwd=str(ROOT), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()


def test_the_optional_modules_get_their_stand_ins_where_they_exist():
    from llm_act.patches.megatron import compat
    from llm_act.cpu import megatron_lm as lm

    names = sorted(lm._OPTIONAL_TRAINING_MODULES)
    present, first, second, device = _fresh(
        "import importlib, llm_act.cpu\n"
        "from llm_act.patches.megatron.compat import optional_module\n"
        "first = llm_act.cpu.install(megatron_lm=True)\n"
        f"present = [m for m in {names!r} if optional_module(m)]\n"
        "print(present); print(sorted(first)); print(llm_act.cpu.install(megatron_lm=True))\n"
        "print([str(importlib.import_module(m).torch.cuda.current_device()) for m in present])\n")[-4:]
    assert second == "[]"
    for name in names:
        assert (repr(f"{name}.torch") in first) == (repr(name) in present), (name, present, first)
    assert ("megatron.legacy" in first) == (compat.optional_module("megatron.legacy") is not None)
    assert device == repr(["cpu"] * len(eval(present)))


def test_an_optional_module_that_fails_to_import_stops_the_install_before_any_patch():
    """`megatron.legacy.fused_kernels` exists here (a finder says so) but raises on import: the
    error comes out of `install`, and megatron-core, Module.cuda and the flag are as before."""
    lines = _fresh(
        "import sys, importlib.abc, importlib.machinery\n"
        "class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in ('megatron.legacy', 'megatron.legacy.fused_kernels'):\n"
        "            return importlib.machinery.ModuleSpec(name, self, is_package=True)\n"
        "    def create_module(self, spec):\n"
        "        return None\n"
        "    def exec_module(self, module):\n"
        "        if module.__name__.endswith('fused_kernels'):\n"
        "            raise RuntimeError('broken inside')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "import torch, llm_act.cpu\n"
        "import megatron.core.timers as timers\n"
        "cuda = torch.nn.Module.cuda\n"
        "try:\n"
        "    llm_act.cpu.install(megatron_lm=True)\n"
        "except RuntimeError as err:\n"
        "    print('raised:', err)\n"
        "print(timers.torch is torch, torch.nn.Module.cuda is cuda, llm_act.cpu.installed())\n")
    assert lines[-2:] == ["raised: broken inside", "True True False"]


def test_megatron_lms_script_as_main_keeps_its_batch_on_the_cpu():
    install = "import torch, llm_act.cpu\nllm_act.cpu.install(megatron_lm=True)\n"
    assert _fresh(install + "from megatron.training import get_args\n"
                  "print(torch.ones(2).cuda().device)\n")[-1] == "cpu"
    assert _fresh(install + "try:\n    torch.ones(2).cuda()\nexcept (RuntimeError, AssertionError):\n"
                  "    print('refused')\n")[-1] == "refused"
