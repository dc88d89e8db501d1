"""`NoSyncs`: a TorchDispatchMode that fails on the first op reading a device value on the
host. On a CPU such a read costs nothing, on a GPU it stalls the stream; a CPU run that never
asks for one shows the GPU run will not either (issue 26)."""
from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: `.item()` / `bool(t)` / `int(t)` are `_local_scalar_dense`; the others have shapes that
#: depend on the data
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
                      "_unique2", "unique_dim", "unique_consecutive", "is_nonzero",
                      "equal", "allclose"})


class NoSyncs(TorchDispatchMode):
    """Fails on the first op that reads a device value on the host (`repeat_interleave` with
    tensor repeats counts unless `output_size` is given)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = func.overloadpacket.__name__
        if base in SYNC_OPS or (base == "repeat_interleave" and kwargs.get("output_size") is None
                                and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            raise AssertionError(f"host sync: aten.{base}")
        return func(*args, **kwargs)


def force_triton(monkeypatch) -> None:
    """Every `use_triton(x)` in the package answers True, so CPU tensors take the Triton
    launchers (under TRITON_INTERPRET=1, set by tests/conftest.py) as CUDA tensors would."""
    import llm_act.codecs  # noqa: F401
    import llm_act.kernels as K
    import llm_act.kernels.custom_ops  # noqa: F401

    original = K.use_triton
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "use_triton", None) is original:
            monkeypatch.setattr(module, "use_triton", lambda x: True)
