"""Kernel-test helpers: record how many programs each Triton launch runs.

A kernel test whose input fits one program never exercises the program-id arithmetic
(offsets, the last partial tile), so each family checks with `grids` that its larger
shapes launch several programs.
"""
import math

import pytest


class _Recording:
    """Stands in for a @triton.jit kernel: `kernel[grid]` logs the program count."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.setdefault(self.name, []).append(math.prod(grid))
        return self.kernel[grid]


class GridLog:
    def __init__(self, monkeypatch):
        self._mp = monkeypatch
        self.programs: dict[str, list[int]] = {}

    def watch(self, module, *names):
        """Log the launches of kernels `names` of `module` (launchers look them up by name)."""
        for name in names:
            self._mp.setattr(module, name, _Recording(getattr(module, name), name, self.programs))
        return self

    def most(self, name) -> int:
        """The largest program count of any launch of `name` (0 when never launched)."""
        return max(self.programs.get(name, [0]))


@pytest.fixture
def grids(monkeypatch):
    return GridLog(monkeypatch)
