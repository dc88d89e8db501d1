"""The rendezvous port of tests and one-rank runs: picked where the kernel does not hand out
ports on its own, and a rendezvous that loses its port anyway is started again (CI once
failed on a port the kernel gave to an outgoing connection between pick and listen)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llm_act.train import parallel
from tests import testing as T


def test_the_port_is_free_and_below_the_ephemeral_range():
    low, high = parallel._ephemeral_range()
    assert 0 < low <= high
    ports = {parallel.free_port() for _ in range(20)}
    if low - parallel.PORT_FLOOR >= 1000:
        assert all(parallel.PORT_FLOOR <= p < low for p in ports), ports
    assert len(ports) > 1  # random, so two tests do not race for one port
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def _takes_the_port_once(rank, world, port, marker):
    import torch
    import torch.distributed as dist

    first = Path(marker)
    if rank == 0 and not first.exists():
        first.write_text(str(port))
        thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        thief.bind(("127.0.0.1", port))
        thief.listen()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total)
    assert total.item() == 3.0
    Path(f"{marker}.done{rank}").write_text(str(port))


@pytest.mark.dist
def test_a_rendezvous_that_loses_its_port_starts_again(tmp_path):
    import time

    marker = str(tmp_path / "first")
    begun = time.monotonic()
    T.spawn(_takes_the_port_once, 2, marker, timeout=60)
    assert time.monotonic() - begun < 45  # the waiting rank was stopped, not left to time out
    first = int(Path(marker).read_text())
    done = {int(Path(f"{marker}.done{r}").read_text()) for r in range(2)}
    assert len(done) == 1 and done != {first}


def _always_fails(rank, world, port):
    raise RuntimeError(f"rank {rank} broke")


@pytest.mark.dist
def test_other_failures_are_not_retried():
    with pytest.raises(T.WorkerError, match="rank 0 broke") as info:
        T.spawn(_always_fails, 2, timeout=30)
    assert "rank 1 broke" in str(info.value)
