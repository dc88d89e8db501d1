"""Measuring never stops training (issue 41): a tracking point or a gradient-fidelity report
that fails on any rank is skipped on every rank, and the plan in force stays.

A measurement is local work (replayed passes, codecs, the solver) between collectives of
`llm_act.runtime.agreement`. A rank whose work raises cannot simply return: its peers would
wait in their next collective until its timeout. So while a measurement runs, every rank
exchanges one status flag before each collective of ours (`agreement.gather` and
`broadcast` call `checkpoint`) and once more at its commit point (`commit`, before anything
changes that the ranks must agree on: the plan, the schedule). The exchange runs on a process
group of its own (gloo, every rank), so it never pairs with a data collective. A rank that
fails sends "failed" once; its peers meet that flag at their next exchange and skip too:
every rank leaves the measurement at the same exchange, with no hang.

Not skipped (they end the run as before): the errors in `FATAL`, given by the adapter: a
user's budget that cannot be met, ranks that disagree, a collective that timed out (a peer
is gone or took another path). A failure inside a model collective of a replayed pass (a
tensor-parallel all-reduce) that only some ranks reach ends in that collective's timeout.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from llm_act.runtime import agreement

log = logging.getLogger("llm_act.runtime.controller")


class PeerFailed(RuntimeError):
    """Another rank's measurement failed: this rank skips it too."""


class RoundGuard:
    """Runs the adapter's measurements so that a failure skips them on every rank."""

    def __init__(self, fatal: tuple[type[BaseException], ...]):
        self.fatal = fatal
        """errors that end the run (re-raised, not skipped)"""
        self.skipped: list[dict[str, Any]] = []
        """per skipped measurement of this run: its iteration, what it was and the cause"""
        self.skipped_total = 0
        """skipped measurements, checkpointed with the adapter (a resumed run counts on)"""
        self._group: Any = None
        self._open = False
        self._committed = False

    def run(self, what: str, iteration: int, measure: Callable[[], Any]) -> bool:
        """Run `measure()` (one tracking point or report, named `what` in the warning);
        whether it completed. A failure logs one warning line with the iteration and the
        cause, is counted, and every rank skips alike."""
        self._join()
        self._open, self._committed = True, False
        try:
            measure()
            return True
        except self.fatal:
            raise
        except PeerFailed:
            cause = "another rank's measurement failed (see its log)"
        except Exception as err:  # noqa: BLE001 -- measuring must never stop training
            if not self._committed:
                self._open = False
                self._exchange(ok=False)  # meets the peers' next exchange
            cause = f"{type(err).__name__}: {err}"
        finally:
            self._open = False
            agreement.set_before_collective(None)
        self.skipped.append({"iteration": iteration, "what": what, "cause": cause})
        self.skipped_total += 1
        log.warning("llm_act: iteration %d: %s failed and is skipped on every rank (%s); the plan in "
                    "force stays and training goes on", iteration, what, cause.splitlines()[0][:400])
        return False

    @property
    def committed(self) -> bool:
        """Whether the last measurement passed its commit point (`commit`)."""
        return self._committed

    def checkpoint(self) -> None:
        """One status exchange while a measurement runs (before a collective of ours): raises
        `PeerFailed` where a rank failed."""
        if self._open and not self._committed and not self._exchange(ok=True):
            raise PeerFailed("another rank's measurement failed")

    def commit(self) -> None:
        """The last exchange of a measurement: every rank measured and decided. After it only
        local steps follow, which no peer waits for."""
        self.checkpoint()
        self._committed = True

    # ---- the exchange --------------------------------------------------------------------
    def _world(self) -> Optional[Any]:
        dist = agreement.initialized_dist()
        return dist if dist is not None and dist.get_world_size() > 1 else None

    def _join(self) -> None:
        """Make the status group (every rank calls this at the same measurement) and route
        `agreement`'s collectives through `checkpoint`."""
        dist = self._world()
        if dist is None:
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        agreement.set_before_collective(self.checkpoint)

    def _exchange(self, ok: bool) -> bool:
        """Whether every rank is still fine (a MIN of 1/0 over the status group)."""
        dist = self._world()
        if dist is None or self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        group = self._group
        agreement.timed(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True),
                        "status exchange of a measurement", group)
        return bool(flag.item())
