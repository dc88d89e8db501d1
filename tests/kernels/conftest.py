"""Kernel-test helpers: record how many programs each Triton launch runs.

A kernel test whose input fits one program never exercises the program-id arithmetic
(offsets, the last partial tile), so each family checks with `grids` that its larger
shapes launch several programs.
"""
import math

import pytest


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
