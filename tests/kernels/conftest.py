"""Kernel-test helpers: record how many programs each Triton launch runs.

A kernel test whose input fits one program never exercises the program-id arithmetic
(offsets, the last partial tile), so each family checks with `grids` that its larger
shapes launch several programs.
"""
import math
import os

import pytest

#: tests that read what an older Triton interpreter does differently from the one they were
#: written against (triton 3.9's, the 3.11 venv's; on a GPU the kernels are compiled, not
#: interpreted). torch 2.13's CUDA build pins triton 3.7.1 (the 3.12 venv), whose interpreter
#: (`InterpreterBuilder`) has no `get_bf16`, so no kernel that makes a bf16 constant runs in it
#: (the outlier kernels on bf16 input), decodes some FP8 codes to other float bits, and lets a
#: group's max over NaNs come out 0 instead of NaN. Gated by what the interpreter has, not by
#: its version: the day it has `get_bf16` these run again.
_NO_BF16 = "it has no bf16 constants (`InterpreterBuilder.get_bf16`), which the outlier kernels make on bf16 input (these tests give them bf16)"
#: (test id prefix, the words its id must hold as well, why)
INTERPRETER_GAPS = (
    ("test_fp8.py::test_every_code_decodes_as_the_format_says", "", "its FP8 decode gives other float bits "
                                                                    "for some codes"),
    ("test_int_quant.py::test_zero_range_and_all_nonfinite_groups", "", "its max over an all-NaN group "
                                                                        "is 0, not NaN"),
    ("test_outlier.py::", "bfloat16", _NO_BF16),
    ("test_outlier.py::test_tiles_pick_their_own_outlier_channels", "", _NO_BF16),
    ("test_sync_free_triton.py::test_triton_encode_and_decode_issue_no_host_sync", "outlier_int4", _NO_BF16),
    ("test_traffic.py::test_one_pass", "outlier_int4", _NO_BF16),
)


def _old_interpreter() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:  # no triton: the kernel tests skip themselves
        return False
    return not hasattr(InterpreterBuilder, "get_bf16")


def pytest_collection_modifyitems(config, items):
    if not _old_interpreter():
        return
    import triton

    for item in items:
        name = item.nodeid.split("tests/kernels/", 1)[-1]
        why = next((w for prefix, words, w in INTERPRETER_GAPS if name.startswith(prefix) and words in name),
                   None)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"triton {triton.__version__}'s interpreter: {why}; "
                                                    "runs on triton >= 3.9 and compiled on a GPU"))


class _Recording:
    """Stands in for a @triton.jit kernel: `kernel[grid]` logs the program count, the grid
    and the launch's `enable_fp_fusion` option."""

    def __init__(self, kernel, name, owner):
        self.kernel, self.name, self.owner = kernel, name, owner

    def __getitem__(self, grid):
        grid = tuple(grid)
        self.owner.programs.setdefault(self.name, []).append(math.prod(grid))
        self.owner.grids.setdefault(self.name, []).append(grid)
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.owner.fusion.setdefault(self.name, []).append(
                kwargs.get("enable_fp_fusion", "unset"))
            return launch(*args, **kwargs)

        return run


class GridLog:
    def __init__(self, monkeypatch):
        self._mp = monkeypatch
        self.programs: dict[str, list[int]] = {}
        self.grids: dict[str, list[tuple]] = {}
        self.fusion: dict[str, list] = {}

    def watch(self, module, *names):
        """Log the launches of kernels `names` of `module` (launchers look them up by name)."""
        for name in names:
            self._mp.setattr(module, name, _Recording(getattr(module, name), name, self))
        return self

    def most_along(self, name, axis) -> int:
        """The largest extent of grid axis `axis` in any launch of `name` (0: never)."""
        return max([g[axis] if len(g) > axis else 1 for g in self.grids.get(name, [])] or [0])

    def exact(self, name) -> bool:
        """Every launch of `name` so far passed enable_fp_fusion=False (no FMA contraction)."""
        return bool(self.fusion.get(name)) and all(f is False for f in self.fusion[name])

    def most(self, name) -> int:
        """The largest program count of any launch of `name` (0 when never launched)."""
        return max(self.programs.get(name, [0]))


@pytest.fixture
def grids(monkeypatch):
    return GridLog(monkeypatch)
