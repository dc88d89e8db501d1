"""`LiveStorageTracker`: the peak of live tensor storage over a region (forward and backward),
measured independently of the planner's model.

Where it lives and who may use it: an oracle, not part of training. `llm-act bench peak`
(`llm_act.bench.peak`) measures the planner's predicted-against-measured peak table with it,
and the test suite checks the planner's memory model against it, so it ships in the wheel
beside the bench that needs it. The runtime, measurement and planner never import it: the
planner's model is what it checks.

Why: the planner predicts a step's peak as static memory + the saved activations (what the
`SavedTensorLedger` counts, what `block_profile` prices) + a backward transient
(`planner.transient`). The ledger sees only what autograd *saves*; it does not see the
transients -- recomputed tensors, decoded copies, gradients in flight, the logits and the
loss's temporaries, a large temporary of one op. This tracker counts every tensor storage
the region's ops create, saved or not, so its peak is what the model must reproduce.

How: a `TorchDispatchMode` sees every aten op run in the region, backward ops included (the
autograd engine carries the mode to the ops it runs), and factory functions (torch.empty,
zeros, randn, ...). Each op output's *untyped storage* is counted once when first seen
(views share it; an in-place op's output is its input's storage: nothing new) and uncounted
when that storage is freed (a weak reference to the Python `UntypedStorage`, which torch
keeps alive exactly as long as the C++ storage, calls back when it dies). A storage whose
size changes (`Tensor.resize_`, `out=` ops, `UntypedStorage.resize_`, which is patched
while a tracker is active) is re-counted at its new size.

What is reported (`peak_bytes`) is the peak ABOVE THE ENTRY STATE: the maximum over the
region of (bytes of storages created in the region and still alive, plus growth of older
storages) minus (bytes of storages that existed at entry and were freed in the region).
Storages that exist at entry are "pre-existing": those given as `baseline` (tensors,
modules: parameters, buffers, .grad and main_grad; "all": every tensor the garbage
collector tracks), and, with `adopt_inputs` (default), any storage an op reads or writes
that the tracker did not see created. Their frees are credited; their bytes form
`baseline_bytes`, and `peak_total_bytes = baseline_bytes + peak_bytes` is the peak of the
whole process's tensor storage when every storage alive at entry is known.

Limits (what a dispatch mode cannot see):
- memory a kernel allocates and frees inside one aten op (a matmul workspace, the
  temporaries of a fused kernel, SDPA's CPU flash buffers): the peak is taken between ops,
  at op granularity. A `torch.library.custom_op` with a Python body (llm_act's codec
  kernels) is run body and all under the mode by default (`inside_custom_ops`), so its
  temporaries are seen;
- tensors created without an aten op: `torch.from_numpy`, `Generator.get_state()` (the
  CPU generator's 5 KB state a "regen" codec stores), C++ code allocating with
  `at::detail::empty_*`. Such a storage is not counted; if an op later reads it, it is
  taken for a pre-existing one (`adopt_inputs`) and its free is credited, which lowers the
  figure by its size from then on;
- allocator effects: caching-allocator blocks, fragmentation, rounding, CUDA context,
  pinned host buffers -- this is tensor storage, not `torch.cuda.max_memory_allocated`;
- another thread's ops are seen only if the mode is active there (the autograd engine's
  threads are).
"""
from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveStorageTracker", "StorageRecord", "track_peak", "module_tensors"]


@dataclass
class StorageRecord:
    """One storage's share of the state at the peak."""

    nbytes: int
    """its contribution: bytes alive above its size at entry (negative: a pre-existing
    storage freed or shrunk)"""
    op: str
    """the op that created it ("pre-existing" for a baseline or adopted storage); inside a
    custom op's body, "<custom op> > <op>"
    """
    phase: str
    """"forward" or "backward" (inside the autograd engine), when it was created"""
    node: str
    """the autograd node running when it was created (backward), else ''"""
    label: str
    """`label()` at its creation, '' without a label function"""
    shape: tuple
    dtype: str
    key: int = 0
    """id() of the UntypedStorage object: unique among live storages only (an id is reused
    after a free), so match it with `seq` too"""
    seq: int = 0
    """the number of storages the tracker had counted before this one (unique per region)"""


class _Entry:
    __slots__ = ("nbytes", "entry", "ref", "op", "phase", "node", "label", "shape", "dtype", "key", "seq")

    def __init__(self, nbytes, entry, ref, op, phase, node, label, shape, dtype, key, seq):
        self.nbytes, self.entry, self.ref = nbytes, entry, ref
        self.op, self.phase, self.node, self.label = op, phase, node, label
        self.shape, self.dtype, self.key, self.seq = shape, dtype, key, seq

    def record(self, contribution: int) -> StorageRecord:
        return StorageRecord(contribution, self.op, self.phase, self.node, self.label, self.shape,
                             self.dtype, self.key, self.seq)


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _node_name() -> str:
    """The autograd node the engine is running ('' outside one)."""
    node = getattr(torch._C, "_current_autograd_node", lambda: None)()
    return "" if node is None else node.name()


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:  # tensor subclasses without a storage
        return None


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters, buffers, and the parameters' .grad / .main_grad tensors."""
    out: list[torch.Tensor] = []
    for p in module.parameters():
        out.append(p)
        for attr in ("grad", "main_grad"):
            g = getattr(p, attr, None)
            if isinstance(g, torch.Tensor):
                out.append(g)
    out.extend(module.buffers())
    return out


def _gc_tensors() -> list[torch.Tensor]:
    out = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookup on proxies
            out.append(obj)
    return out


# ---- UntypedStorage.resize_ does not pass through the dispatcher: patched while active ------

_active: list["LiveStorageTracker"] = []
_patch_lock = threading.Lock()
_orig_resize = None


def _patched_resize(self, size):
    result = _orig_resize(self, size)
    for tracker in list(_active):
        tracker._resized(self)
    return result


def _install_patch() -> None:
    global _orig_resize
    with _patch_lock:
        if _orig_resize is None:
            _orig_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _patched_resize


def _remove_patch() -> None:
    global _orig_resize
    with _patch_lock:
        if _orig_resize is not None and not _active:
            torch.UntypedStorage.resize_ = _orig_resize
            _orig_resize = None


#: ops whose input is a tensor just made outside the dispatcher (torch.tensor(...)): new, not
#: pre-existing
_FRESH = (torch.ops.aten.lift_fresh.default,)


def _custom_impl(func, inputs: list) -> Optional[Callable]:
    """The Python implementation of a `torch.library.custom_op` (its kernel for the inputs'
    device, else the function it was defined with); None for aten/prims and other ops."""
    if func.namespace in ("aten", "prims"):
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - torch without torch.library.custom_op
        return None
    opdef = OPDEFS.get(func._schema.name)
    if opdef is None:
        return None
    device = inputs[0].device.type if inputs else "cpu"
    return getattr(opdef, "_backend_fns", {}).get(device) or getattr(opdef, "_init_fn", None)


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: "LiveStorageTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracker = self.tracker
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tracker.adopt_inputs and func not in _FRESH:
            for t in inputs:  # storages that exist before the op and that we never saw made
                tracker._adopt(t)
        impl = _custom_impl(func, inputs) if tracker.inside_custom_ops else None
        if impl is not None:  # the op's Python body, its own ops seen by this mode
            tracker._custom.append(str(func))
            try:
                with self:
                    out = impl(*args, **kwargs)
            finally:
                tracker._custom.pop()
        else:
            out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        tracker._after_op(func, inputs, outputs, fresh=func in _FRESH)
        return out


class LiveStorageTracker:
    """Context manager: the peak of live tensor storage bytes in its region, above the entry
    state (see the module docstring for what is counted and what is not).

    `baseline`: tensors, modules (`module_tensors`), storages, or "all" (every tensor the
    garbage collector tracks) that exist at entry: their frees in the region are credited and
    their bytes are `baseline_bytes`. It is read at entry and dropped (the tracker keeps only
    weak references, so it never keeps a storage alive; a second `with` starts without it).
    `adopt_inputs`: a storage an op reads or writes that was not seen created counts as
    pre-existing too (False: such storages are ignored, their frees not credited).
    `inside_custom_ops` (default): a `torch.library.custom_op` (llm_act's codec kernels) runs
    its Python body under the mode, so its temporaries are seen (on CPU the codecs' torch
    references upcast whole tensors to fp32); False: the op is opaque, only its outputs count
    (closer to a GPU, where the op is one Triton kernel). `device`: count only storages on
    this device type ("cpu", "cuda"); None: all but "meta". `record_peak`: keep the
    composition at the peak (`peak_records`), one copy of the live table per new maximum.
    `label`: a function called when a storage is created; its string is kept with the
    storage (e.g. the module running). `ignore_ops`: ops (as `str(func)`, e.g.
    "aten.rand.generator") whose outputs count 0 bytes all their life -- what a CPU reference
    allocates that its GPU kernel does not (the codecs' rounding noise, drawn in registers).

    Results: `peak_bytes` (above entry), `live_bytes` (now, above entry), `baseline_bytes`,
    `peak_total_bytes`, `peak_phase` / `peak_op` (where the peak was reached), `marks`
    (`mark(name)`: the live and peak bytes at a point, e.g. the end of forward).
    """

    def __init__(self, baseline: Union[Iterable[Any], str, None] = None, *, adopt_inputs: bool = True,
                 inside_custom_ops: bool = True, device: Optional[str] = None,
                 record_peak: bool = False, label: Optional[Callable[[], str]] = None,
                 ignore_ops: Iterable[str] = ()):
        self.adopt_inputs = bool(adopt_inputs)
        self.ignore_ops = frozenset(ignore_ops)
        self.inside_custom_ops = bool(inside_custom_ops)
        self.device = device
        self.record_peak = bool(record_peak)
        self.label = label
        self._baseline = baseline
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._freed_pre: list[StorageRecord] = []
        self._mode: Optional[_Mode] = None
        self._custom: list[str] = []  # the custom ops whose body is running
        self._reset()

    def _reset(self) -> None:
        self._entries.clear()
        self._freed_pre = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.peak_phase = "entry"
        self.peak_op = ""
        self.peak_records: list[StorageRecord] = []
        self.marks: list[tuple[str, int, int]] = []
        self.num_ops = 0
        self._seq = 0

    # ---- context -------------------------------------------------------------------------
    def __enter__(self) -> "LiveStorageTracker":
        if self._mode is not None:
            raise RuntimeError("LiveStorageTracker is not reentrant")
        self._reset()
        base, self._baseline = self._baseline, None  # consumed: the tracker holds no tensor
        if isinstance(base, str):
            if base != "all":
                raise ValueError(f"baseline: expected 'all', tensors or modules, got {base!r}")
            base = _gc_tensors()
        elif isinstance(base, (torch.Tensor, torch.nn.Module, torch.UntypedStorage)):
            base = [base]
        for item in base or ():
            self.add_baseline(item)
        _active.append(self)
        _install_patch()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(*exc)
        finally:
            _active.remove(self)
            _remove_patch()
            with self._lock:
                for e in list(self._entries.values()):  # drop the weak references: no callbacks
                    e.ref = None
                self._entries = {}

    # ---- results -------------------------------------------------------------------------
    @property
    def peak_total_bytes(self) -> int:
        """`baseline_bytes + peak_bytes`: the peak of all tensor storage, when every storage
        alive at entry is known (seeded, or touched in the region)."""
        return self.baseline_bytes + self.peak_bytes

    def live_records(self) -> list[StorageRecord]:
        """Every storage counted and alive now (contribution = current minus entry size)."""
        with self._lock:
            return [e.record(e.nbytes - e.entry) for e in list(self._entries.values())]

    def mark(self, name: str) -> None:
        """Note (name, live bytes, peak so far) in `marks`."""
        with self._lock:
            self.marks.append((name, self.live_bytes, self.peak_bytes))

    def reset_peak(self) -> None:
        """Start a new peak from the current level (e.g. to measure backward alone)."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.peak_phase, self.peak_op = "reset", ""
            if self.record_peak:
                self._snapshot()

    def summary(self, top: int = 15, unit: int = 1) -> str:
        """The largest shares of the state at the peak (with `record_peak`), grouped by
        (phase, label, op, shape, dtype)."""
        groups: dict[tuple, list[int]] = {}
        for r in self.peak_records:
            key = (r.phase, r.label, r.node or r.op, r.shape, r.dtype)
            g = groups.setdefault(key, [0, 0])
            g[0] += r.nbytes
            g[1] += 1
        rows = sorted(groups.items(), key=lambda kv: -abs(kv[1][0]))[:top]
        lines = [f"peak {self.peak_bytes / unit:.3f} above entry ({self.peak_phase}, at {self.peak_op})"]
        for (phase, label, what, shape, dtype), (n, count) in rows:
            lines.append(f"  {n / unit:12.3f}  x{count:<3} {phase:<8} {label:<40} {what:<28} "
                         f"{list(shape)} {dtype}")
        return "\n".join(lines)

    # ---- bookkeeping ---------------------------------------------------------------------
    def add_baseline(self, item: Any) -> None:
        """Count `item` (a tensor, a module's tensors, an UntypedStorage) as pre-existing."""
        if isinstance(item, torch.nn.Module):
            for t in module_tensors(item):
                self.add_baseline(t)
            return
        if isinstance(item, torch.Tensor):
            st = _storage(item)
            shape, dtype = tuple(item.shape), str(item.dtype).replace("torch.", "")
        elif isinstance(item, torch.UntypedStorage):
            st, shape, dtype = item, (item.nbytes(),), "bytes"
        else:
            raise TypeError(f"baseline: expected tensors, modules or storages, got {type(item).__name__}")
        if st is not None and self._counted(st):
            self._track(st, new=False, op="pre-existing", shape=shape, dtype=dtype)

    def _counted(self, st) -> bool:
        try:
            dev = st.device.type
        except Exception:
            return False
        return dev != "meta" and (self.device is None or dev == self.device)

    def _track(self, st, new: bool, op: str, shape: tuple, dtype: str) -> None:
        key = id(st)
        with self._lock:
            if key in self._entries:
                return
            n = 0 if self._ignored(op) else st.nbytes()
            bw = _in_backward()
            lab = ""
            if new and self.label is not None:
                try:
                    lab = str(self.label())
                except Exception as err:  # a label must never break the run
                    lab = f"<label failed: {type(err).__name__}>"
            tracker_ref = weakref.ref(self)

            def freed(_ref, key=key):
                tracker = tracker_ref()
                if tracker is not None:
                    tracker._freed(key)

            entry = _Entry(n, 0 if new else n, weakref.ref(st, freed), op,
                           "backward" if bw else "forward", _node_name() if bw else "", lab, shape, dtype,
                           key, self._seq)
            self._seq += 1
            self._entries[key] = entry
            if new:
                self._change(n, op)
            else:
                self.baseline_bytes += n

    def _ignored(self, op: str) -> bool:
        return bool(self.ignore_ops) and op.rsplit(" > ", 1)[-1] in self.ignore_ops

    def _adopt(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is not None and id(st) not in self._entries and self._counted(st):
            self._track(st, new=False, op="pre-existing", shape=tuple(t.shape),
                        dtype=str(t.dtype).replace("torch.", ""))

    def _after_op(self, func, inputs: list, outputs: list, fresh: bool = False) -> None:
        with self._lock:
            self.num_ops += 1
            op = " > ".join(self._custom + [str(func)])
            # an output on an input's storage (in-place, out=, a view) is not new; with
            # adopt_inputs the input was adopted already, without it stays unknown (ignored)
            read = set() if fresh else {id(st) for st in map(_storage, inputs) if st is not None}
            for t in outputs:
                st = _storage(t)
                if st is None or not self._counted(st):
                    continue
                entry = self._entries.get(id(st))
                if entry is None and id(st) in read:
                    continue
                if entry is None:
                    self._track(st, new=True, op=op, shape=tuple(t.shape),
                                dtype=str(t.dtype).replace("torch.", ""))
                elif entry.ref is not None and st.nbytes() != entry.nbytes and not self._ignored(entry.op):
                    self._resized(st, op)
            if func._schema.is_mutable:  # resize_, out= variants: an input storage may change size
                for t in inputs:
                    st = _storage(t)
                    if st is not None and id(st) in self._entries:
                        self._resized(st, op)

    def _resized(self, st, op: str = "UntypedStorage.resize_") -> None:
        with self._lock:
            entry = self._entries.get(id(st))
            if entry is None or self._ignored(entry.op):
                return
            n = st.nbytes()
            if n != entry.nbytes:
                delta, entry.nbytes = n - entry.nbytes, n
                self._change(delta, op)

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            if entry.entry and self.record_peak:
                self._freed_pre.append(entry.record(-entry.entry))
            # its share was (nbytes - entry size); freed, it is -entry size
            self._change(-entry.nbytes, "free")

    def _change(self, delta: int, op: str) -> None:
        self.live_bytes += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_phase = "backward" if _in_backward() else "forward"
            self.peak_op = op
            if self.record_peak:
                self._snapshot()

    def _snapshot(self) -> None:
        # list(): a free (weakref callback, e.g. from a gc pass) may change the table meanwhile
        recs = [e.record(e.nbytes - e.entry) for e in list(self._entries.values()) if e.nbytes != e.entry]
        self.peak_records = recs + list(self._freed_pre)


def track_peak(baseline: Union[Iterable[Any], str, None] = None, **kwargs: Any) -> LiveStorageTracker:
    """`LiveStorageTracker(baseline, **kwargs)`: `with track_peak(model) as t: ...; t.peak_bytes`."""
    return LiveStorageTracker(baseline, **kwargs)
