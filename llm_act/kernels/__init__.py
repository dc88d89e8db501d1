"""Triton kernels for the codecs, each family beside its pure-torch reference.

Layout: `<family>_ref.py` is the readable specification in plain torch (runs anywhere);
`<family>_triton.py` holds the `@triton.jit` kernels and their launchers with the same
signatures. `custom_ops.py` registers each launcher/reference pair as a torch custom op
(`torch.ops.llm_act.*`, with a fake implementation for torch.compile), which the codecs
call; the op picks with `use_triton(x)`: the kernel on CUDA tensors, the reference on
CPU. Tests run the kernels on CPU under `TRITON_INTERPRET=1`.

No GPU-only semantics (every kernel and its reference agree bit for bit by construction,
not only under the interpreter, whose numpy arithmetic is always correctly rounded):
- Division is `tl.math.div_rn` (IEEE, correctly rounded, as torch's `/` on CPU and CUDA),
  never `/` on floats, which compiles to `div.full.f32` (approximate, up to 2 ulp) on a GPU.
  Operands and order are those of the reference (`(0.5 * x - 0.5 * zero) / scale` in both).
- No FMA contraction: every launch passes `**EXACT_LAUNCH` (`enable_fp_fusion=False`: LLVM
  does not contract and ptxas runs with `--fmad=false`), so `a * b + c` rounds twice, as
  the reference's separate torch ops do. `tl.math.fma` is not used (torch has no fused
  counterpart on CPU).
- Float reductions whose order changes the rounding are spelled out as sequential loops in
  kernel and reference alike (dual's pooled sums); `tl.sum` is used on integers and on
  tiles where one term is nonzero (exact in any order), and `tl.min`/`tl.max`
  (order-free) on floats. The one exception is outlier_int4's per-tile z-scores, float64
  sums that only pick outlier channels (see `outlier_triton`).
- References divide tensor by tensor: torch's CUDA `/` by a Python scalar multiplies by
  the reciprocal (not correctly rounded), so a scalar divisor is `torch.full_like(...)`;
  launchers that compute parameters in torch call the reference's own function
  (`quant_params`, `dual_ref.channel_params`).
- No NaN reaches a `tl.minimum`/`tl.maximum` whose result is kept (non-finite lanes are
  replaced by `tl.where` first): a GPU's min/max return the non-NaN operand, numpy's NaN.
- Float8 and bfloat16 conversions use the hardware's casts (round to nearest even,
  `hardware_casts`) on a GPU, and integer bit operations with the same rounding under the
  interpreter, whose casts round ties wrongly.
- Non-finite values are found by the encode kernels in their one pass and kept in a
  fixed-capacity side list (`nonfinite_ref`, `nonfinite_triton`): no scan, no host sync.
- Stochastic rounding draws 8 random bits per element, 16 elements per Philox call
  (`random_triton`), keyed by the codec's seed and call count; the references take their
  noise as an input, so kernel and reference agree bit for bit given the same noise.
- Integer indexing avoids per-element division: tiles are 2-D [groups or rows, elements],
  and divisions by powers of two are shifts.
"""
from __future__ import annotations

import os

import torch

from llm_act._imports import HAVE_TRITON

#: values of `LLM_ACT_KERNELS`: "auto" (or unset/empty) picks by device, "torch" forces
#: the references
KERNEL_CHOICES = ("auto", "torch")

#: keyword arguments of every Triton launch in llm_act: no FMA contraction (see above)
EXACT_LAUNCH = {"enable_fp_fusion": False}


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


def hardware_casts() -> bool:
    """Whether kernels convert with the hardware's float8 and bfloat16 casts (`cvt` on a
    GPU): everywhere but under the interpreter, whose casts round ties wrongly; there they
    convert by integer bit operations (the variable triton's `jit` itself reads)."""
    import triton

    return not triton.knobs.runtime.interpret


def use_triton(x: torch.Tensor) -> bool:
    """True when `x`'s codec work should run in a Triton kernel (CUDA and triton present).

    `LLM_ACT_KERNELS=torch` forces the references (for debugging and A/B timing).
    """
    if kernel_choice() == "torch":
        return False
    return HAVE_TRITON and x.is_cuda


def codec_backend(device: torch.device) -> str:
    """What runs the codecs on `device`, said where a time figure is printed: on CPU (or
    without triton, or with LLM_ACT_KERNELS=torch) they run their pure-torch references,
    several times slower than the fused kernels, so a CPU tokens/s ratio says nothing about
    a GPU's."""
    if kernel_choice() == "torch":
        return "the codecs run their pure-torch references (LLM_ACT_KERNELS=torch)"
    if torch.device(device).type != "cuda":
        return (f"the codecs run their pure-torch references on {torch.device(device).type} "
                "(the Triton kernels need CUDA), so these timings are not a GPU's")
    if not HAVE_TRITON:
        return "the codecs run their pure-torch references (triton is not installed)"
    return "the codecs run their Triton kernels"
