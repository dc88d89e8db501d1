"""Timing that is honest on both devices: CUDA events on a GPU, a synchronised wall clock on CPU.

Every figure a benchmark reports is a median over repeats after warm-up; time is only ever
compared as a ratio between runs measured side by side in one process.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeat: int = 5,
              min_total_ms: float = 0.0, max_repeat: Optional[int] = None) -> float:
    """Median milliseconds of `fn()` on `device`: `repeat` timed calls, and more (up to
    `max_repeat`) until they add up to `min_total_ms` (short steps: an H200 run's three-step
    medians at micro-batch 1-2 swung by +-50% between runs)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    cap = max(repeat, max_repeat if max_repeat is not None else repeat)
    while len(times) < repeat or (sum(times) < min_total_ms and len(times) < cap):
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
