"""Optional dependencies, detected without importing them.

`import llm_act` needs only torch. Triton, megatron-core and DeepSpeed are imported
where they are used, through `require`, which names the extra to install.
"""
from __future__ import annotations

import importlib
import importlib.util

_EXTRA = {
    "triton": "triton",
    "megatron.core": "megatron",
    "deepspeed": "deepspeed",
    "pulp": "all",
    "matplotlib": "bench",
}


def available(module: str) -> bool:
    """True when `module` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, why: str):
    """Import `module` or raise ModuleNotFoundError saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = _EXTRA.get(module, "all")
        raise ModuleNotFoundError(
            f"{why} needs the package {module!r}, which is not importable ({err}). "
            f"Install it with: pip install 'llm-act[{extra}]'"
        ) from err


HAVE_TRITON = available("triton")
