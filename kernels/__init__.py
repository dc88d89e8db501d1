"""Triton kernels for the codecs, each family beside its pure-torch reference.

Layout: `<family>_ref.py` is the readable specification in plain torch (runs anywhere);
`<family>_triton.py` holds the `@triton.jit` kernels and their launchers with the same
signatures. Codecs call `use_triton(x)` to pick: the kernel on CUDA tensors, the
reference on CPU. Tests run the kernels on CPU under `TRITON_INTERPRET=1`.
"""
from __future__ import annotations

import os

import torch

from llm_act._imports import HAVE_TRITON

#: values of `LLM_ACT_KERNELS`: "auto" (or unset/empty) picks by device, "torch" forces
#: the references
KERNEL_CHOICES = ("auto", "torch")


def kernel_choice() -> str:
    """The validated `LLM_ACT_KERNELS` setting; an unknown value raises ValueError.

    Checked at every dispatch (cheap), so a typo fails at the first encode instead of
    silently running the default.
    """
    value = os.environ.get("LLM_ACT_KERNELS", "").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(
            f"LLM_ACT_KERNELS={os.environ['LLM_ACT_KERNELS']!r} is not a known setting; "
            f"allowed values: {', '.join(KERNEL_CHOICES)} (or unset)")
    return value


def use_triton(x: torch.Tensor) -> bool:
    """True when `x`'s codec work should run in a Triton kernel (CUDA and triton present).

    `LLM_ACT_KERNELS=torch` forces the references (for debugging and A/B timing).
    """
    if kernel_choice() == "torch":
        return False
    return HAVE_TRITON and x.is_cuda
