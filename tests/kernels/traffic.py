"""Memory traffic of a codec's encode and decode on the Triton path, measured on CPU.

Under the interpreter (TRITON_INTERPRET=1, launchers forced as on CUDA) `measure(fn)`
counts what a GPU run would move:
- per Triton launch, the bytes its tl.load / tl.store (and atomics) touch: "lane" bytes
  (active mask lanes x element size: what the kernel asks for) and "unique" bytes
  (distinct addresses x element size: what DRAM must move at least);
- torch ops outside Triton (inside custom ops too: their Python body runs under the
  counter), with the bytes of their tensor arguments and results; views and empty
  allocations are no ops;
- host syncs (`tests.no_syncs.SYNC_OPS`).
The method is that of ../shared/tools/codec_traffic.py, compacted.
`python -m tests.kernels.traffic [ROWS COLS]` prints the table of `CODECS`.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field

if __name__ == "__main__":  # before anything imports triton (pytest: tests/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.no_syncs import SYNC_OPS  # noqa: E402

#: the codecs of issue 26 (fewbit3's activation: gelu; bitmask gets a 0/1 tensor)
CODECS = ("int8", "int4", "int2", "int4_asym", "int4_channel", "outlier_int4", "dual2",
          "fp8_e4m3", "fp8_e5m2", "fewbit3", "bitmask")
SHAPE = (64, 512)  # bf16; every launch runs several programs
_ALLOC = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "set_",
          "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "is_same_size"}
_GATHER = {"index", "index_select", "gather", "take", "embedding"}
_NO_READ_DEST = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_"}


@dataclass
class Launch:
    name: str
    programs: int
    lane_read: int = 0
    lane_write: int = 0
    _addr: dict = field(default_factory=lambda: {"r": {}, "w": {}})

    def note(self, kind, ptrs, mask):
        addrs = np.asarray(ptrs.data)
        addrs = addrs[np.broadcast_to(np.asarray(mask, dtype=bool), addrs.shape)]
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        if kind == "r":
            self.lane_read += addrs.size * size
        else:
            self.lane_write += addrs.size * size
        self._addr[kind].setdefault(size, []).append(addrs.astype(np.uint64).ravel())

    def unique(self, kind) -> int:
        return sum(np.unique(np.concatenate(a)).size * size
                   for size, a in self._addr[kind].items())


@dataclass
class Traffic:
    launches: list = field(default_factory=list)
    ops: list = field(default_factory=list)  # (name, read bytes, write bytes)
    syncs: list = field(default_factory=list)
    _launch: Launch | None = None

    @property
    def kernel_read(self):
        return sum(launch.unique("r") for launch in self.launches)

    @property
    def kernel_write(self):
        return sum(launch.unique("w") for launch in self.launches)

    @property
    def lane_read(self):
        return sum(launch.lane_read for launch in self.launches)

    @property
    def total(self):
        return self.kernel_read + self.kernel_write + sum(r + w for _, r, w in self.ops)

    @property
    def steps(self):
        """Kernels a GPU would run: Triton launches plus non-view torch ops."""
        return len(self.launches) + len(self.ops)


def describe(t: Traffic, numel: int) -> str:
    """Every launch and torch op with its bytes per element (for failure messages)."""
    lines = [f"triton {la.name} x{la.programs}: read {la.unique('r') / numel:.3f} "
             f"(lanes {la.lane_read / numel:.3f}), write {la.unique('w') / numel:.3f}"
             for la in t.launches]
    lines += [f"torch {op}: read {r / numel:.3f}, write {w / numel:.3f}" for op, r, w in t.ops]
    return "\n".join(lines + [f"host sync: {s}" for s in t.syncs])


def _bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of a (possibly broadcast) tensor."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st) * t.element_size() \
        if t.numel() else 0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _TorchOps(TorchDispatchMode):
    def __init__(self, sink: Traffic):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prims"):  # our custom op: count its body's ops
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(func._schema.name)
            if opdef is not None:
                with _TorchOps(self.sink):
                    return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        base = func.overloadpacket.__name__
        if self.sink._launch is not None or func.is_view or base in _ALLOC:
            return out  # the interpreter's own copies, views, allocations
        if base in SYNC_OPS or (base == "repeat_interleave" and "output_size" not in kwargs):
            self.sink.syncs.append(base)
        ins, seen = [], set()
        for t in _tensors((args, kwargs)):
            key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
            if key not in seen:  # an operand twice (x - x) is read once
                seen.add(key)
                ins.append(t)
        write = sum(map(_bytes, _tensors(out)))
        if base in _GATHER:
            read = sum(map(_bytes, ins[1:])) + write
        elif base in ("index_put", "index_put_"):
            read = sum(map(_bytes, ins[1:])) + (_bytes(ins[0]) if base == "index_put" else 0)
            write = write if base == "index_put" else _bytes(ins[-1])
        else:
            read = sum(map(_bytes, ins[1:] if base in _NO_READ_DEST else ins))
        self.sink.ops.append((str(func).replace("aten.", ""), read, write))
        return out


@contextlib.contextmanager
def _patched(sink: Traffic):
    import triton.runtime.interpreter as interp

    B, G = interp.InterpreterBuilder, interp.GridExecutor
    saved = {(B, n): getattr(B, n) for n in ("create_masked_load", "create_masked_store",
                                             "create_atomic_rmw", "create_atomic_cas")}
    saved[(G, "__call__")] = G.__call__

    def load(self, ptrs, mask, *a):
        sink._launch.note("r", ptrs, mask.data)
        return saved[(B, "create_masked_load")](self, ptrs, mask, *a)

    def store(self, ptrs, value, mask, *a):
        sink._launch.note("w", ptrs, mask.data)
        return saved[(B, "create_masked_store")](self, ptrs, value, mask, *a)

    def rmw(self, op, ptrs, val, mask, *a):
        sink._launch.note("r", ptrs, mask.data)
        sink._launch.note("w", ptrs, mask.data)
        return saved[(B, "create_atomic_rmw")](self, op, ptrs, val, mask, *a)

    def cas(self, ptrs, cmp, val, *a):
        sink._launch.note("r", ptrs, True)
        sink._launch.note("w", ptrs, True)
        return saved[(B, "create_atomic_cas")](self, ptrs, cmp, val, *a)

    def launch(self, *args, **kwargs):
        programs = -1 if callable(self.grid) else math.prod(self.grid)  # -1: not known here
        sink._launch = Launch(self.fn.__name__, programs)
        try:
            return saved[(G, "__call__")](self, *args, **kwargs)
        finally:
            sink.launches.append(sink._launch)
            sink._launch = None

    for (cls, name), fn in zip(saved, (load, store, rmw, cas, launch)):
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)


def measure(fn) -> tuple[object, Traffic]:
    """Run `fn()` and count its launches, kernel bytes, torch ops and host syncs."""
    sink = Traffic()
    with _patched(sink), _TorchOps(sink):
        result = fn()
    return result, sink


def codec_input(name: str, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "bitmask":  # a dropout mask: 0/1 values
        return (torch.rand(shape, generator=g) > 0.1).to(torch.bfloat16)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def run_codec(name: str, shape=SHAPE) -> dict:
    """{"encode": (Traffic, minimum bytes), "decode": ...} of codec `name` on `shape`.
    The minimum is one pass: read x once and write the record once (decode: reversed).
    Call with the Triton path forced (`tests.no_syncs.force_triton`)."""
    from llm_act.codecs import make_codec

    codec = make_codec(name, activation="gelu")
    x = codec_input(name, shape)
    enc, encode = measure(lambda: codec.encode(x))
    _, decode = measure(lambda: codec.decode(enc))
    minimum = x.numel() * x.element_size() + enc.nbytes
    return {"encode": (encode, minimum), "decode": (decode, minimum)}


def table(shape=SHAPE) -> str:
    """Markdown table of every codec in `CODECS` (bytes per input element)."""
    import pytest

    from tests.no_syncs import force_triton

    n = math.prod(shape)
    rows = [f"bf16 {list(shape)}, bytes per element; lane/unique: kernel reads", "",
            "| codec | phase | launches (programs) | torch ops | syncs | kernel r/w | torch r/w "
            "| total | min | total/min | lane/unique |", "|---" * 11 + "|"]
    with pytest.MonkeyPatch.context() as mp:
        force_triton(mp)
        for name in CODECS:
            for phase, (t, minimum) in run_codec(name, shape).items():
                progs = ",".join(str(launch.programs) for launch in t.launches)
                tr, tw = sum(o[1] for o in t.ops), sum(o[2] for o in t.ops)
                lane = t.lane_read / t.kernel_read if t.kernel_read else float("nan")
                rows.append(
                    f"| {name} | {phase} | {len(t.launches)} ({progs}) | {len(t.ops)} | "
                    f"{len(t.syncs)} | {t.kernel_read / n:.3f}/{t.kernel_write / n:.3f} | "
                    f"{tr / n:.3f}/{tw / n:.3f} | {t.total / n:.3f} | {minimum / n:.3f} | "
                    f"{t.total / minimum:.2f} | {lane:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(tuple(int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else SHAPE))
