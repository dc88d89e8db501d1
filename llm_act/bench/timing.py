"""Timing that is honest on both devices: CUDA events on a GPU, a synchronised wall clock on CPU.

Every figure a benchmark reports is a median over repeats after warm-up; time is only ever
compared as a ratio between runs measured side by side in one process.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeat: int = 5) -> float:
    """Median milliseconds of `fn()` on `device`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def machine_line(device: torch.device) -> str:
    """One line naming the machine and versions, printed above every table."""
    import platform

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    parts = [name, f"torch {torch.__version__}", f"python {platform.python_version()}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)
