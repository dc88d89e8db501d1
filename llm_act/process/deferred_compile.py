"""`torch.compile` of a plain function, built at its first call instead of at decoration.

megatron-core decorates its fusions with `torch.compile` when it is imported
(`megatron.core.jit.jit_fuser`), which imports torch._dynamo and torch._inductor: about 4 s
of CPU in every process that imports megatron-core, for functions a CPU run never calls and
a GPU run compiles at their first call anyway (`torch.compile` builds nothing before it).
Our own entry points (`llm-act`, `launch/pretrain_gpt.py`, `launch/ds_train.py`) own their
process and call `defer_torch_compile()` before megatron-core is imported; the library's
public API (`apply`, `layer_spec`) never does. Modules are compiled as before.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["defer_torch_compile"]


def defer_torch_compile() -> None:
    """Make `torch.compile(fn)` of a plain function return a wrapper that compiles `fn` on
    its first call, as `torch.compile` itself would (idempotent)."""
    real = torch.compile
    if getattr(real, "_llm_act_deferred", False):
        return

    def compile(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        built = []

        @functools.wraps(model)
        def run(*args, **kw):
            if not built:
                built.append(real(model, **kwargs))
            return built[0](*args, **kw)

        return run

    compile._llm_act_deferred = True
    torch.compile = compile
