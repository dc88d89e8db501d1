"""`llm_act.process.deferred_compile`: megatron-core's `torch.compile`d fusions are built at their
first call, so a process that imports megatron-core skips torch._inductor's compile stack
(about 4 s per process); what a deferred function returns is what the compiled one does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from llm_act.process.deferred_compile import defer_torch_compile

ROOT = str(Path(__file__).resolve().parents[2])


def test_a_deferred_function_compiles_at_its_first_call_and_modules_compile_as_before():
    defer_torch_compile()
    defer_torch_compile()  # idempotent: the wrapper is not wrapped again
    assert getattr(torch.compile, "_llm_act_deferred", False)

    def gelu_bias(x, b):
        return torch.nn.functional.gelu(x + b)

    fn = torch.compile(gelu_bias, backend="eager")
    assert fn.__wrapped__ is gelu_bias  # a wrapper of the function itself, built at its first call
    deco = torch.compile(backend="eager")(gelu_bias)
    x, b = torch.randn(4, 8), torch.randn(8)
    torch.testing.assert_close(fn(x, b), gelu_bias(x, b))
    torch.testing.assert_close(deco(x, b), gelu_bias(x, b))
    compiled = torch.compile(torch.nn.Linear(8, 8), backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"  # modules: torch's own compile


def test_our_entry_points_import_megatron_core_without_the_inductor_compile_stack():
    code = ("import sys\n"
            "import launch.pretrain_gpt\n"  # what torchrun runs: defers, then imports the loop
            "import llm_act.train.loop, megatron.core\n"
            "print('torch._inductor.compile_fx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
