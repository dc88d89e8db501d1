"""Test setup shared by every test.

Without CUDA, Triton kernels run under the interpreter (`TRITON_INTERPRET=1`, set here
before anything imports triton), so kernel tests compare them on CPU with the torch
references. `gpu` tests are skipped without CUDA.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one test process per core (`pytest -n 2`, README): one torch thread each, and in what
    # they start (3 processes ran slower than 2 on the 2-core machine: 14:42 against 12:48)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import pytest  # noqa: E402

import tests.testing  # noqa: E402,F401 -- defers torch.compile before megatron-core is imported


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def megatron_one_rank():
    """megatron-core's parallel state on one gloo rank, with the CPU stand-ins installed
    (`llm_act.cpu.install()`, opt-in: `testing.init_parallel` calls it), torch on one
    thread: the test models are tiny, and one thread is several times faster on a busy
    2-core machine."""
    from tests import testing

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    testing.init_parallel(tp=1)
    yield
    testing.destroy_parallel()
    torch.set_num_threads(threads)
