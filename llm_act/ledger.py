"""`SavedTensorLedger`: how many bytes a forward pass leaves behind for backward, per site.

The planner trades memory for time per site, so it needs the bytes each site really
holds, not the bytes of process memory. The ledger counts them while a forward runs:

- a `torch.autograd.graph.saved_tensors_hooks` pack hook sees every tensor autograd
  saves and records its *storage* (views share one; a tensor saved twice, or Q, K, V
  views of one QKV buffer, count once) with its byte size and the current site, and
  keeps only a weak reference to the storage, so a storage freed before backward stops
  counting;
- global module forward pre/post hooks track where the forward is: which
  `TransformerLayer` (layer index = megatron's 1-based `layer_number` - 1, which already
  includes the pipeline offset; modules without one get an index in order of first
  call) and which of its submodules (the final norm of a `TransformerBlock`, whose input is
  the site after the blocks, `llm_act.sites.MODEL_SITES`, counts as the last layer's), and
  they tag the storages of known module inputs
  and outputs with the site they *are* (the input of `linear_fc2` is `mlp.fc2_input`
  whichever op saves it). A copy of a tagged input made inside its module by re-views,
  expands and clones alone (the K/V heads stock attention repeats under GQA) belongs to
  the input's site: the autograd graph links it to the tagged tensor;
- parameters are excluded by storage: a storage of a `Parameter` (views, dtype copies
  made by autograd-tracked casts, and ZeRO-3 gathered buffers of the running module
  included; `register_parameter_storage` adds others, e.g. flat buffers).

Where a saved tensor's site comes from, first match wins: a storage reported by a
compressed layer (`report`), the storage tags above, an explicit `scope(layer, site)`, a
copy of a tagged module input, then the innermost known submodule (see `_ROLE_SITES`);
what none of these owns is `(None, "other")`: only what is saved outside the blocks (token
ids, the loss's bookkeeping).
Inside a block every saved tensor has a site.

Only the innermost `saved_tensors_hooks` context fires. A compressed layer that installs
its own hooks hides the raw tensors from the ledger, so it must `report` what it stores:
`report(layer, site, encoded, encoded.nbytes)` counts the encoded record (alive as long
as `encoded` is) and claims the storages of its tensors, so they are not counted twice
if autograd saves them too. Reports go to every active ledger.

`total_bytes` is the live total at the end of forward: the state just before the first
backward event (an unpack, or a storage freed by the autograd engine) or at the exit of
the `with` block, whichever comes first. Tensors saved while backward runs (activation
recomputation) are not counted, nor is anything under `torch.no_grad()` (autograd saves
nothing there).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.nn.modules import module as _nn_module

from llm_act.sites import (
    BLOCK,
    COUNTED_SITES,
    EMBEDDING_DROPOUT_MASK,
    EMBEDDING_OUTPUT,
    LOSS_LOGITS,
    MODEL_SITES,
    OUTER_SITES,
    SITE_OF,
    SITES,
    SLOTS_WITHOUT_SITE,
)

OTHER = "other"
SiteKey = tuple[Optional[int], str]

# The ledger's tables, derived from the schema's tags (`llm_act.sites.Tag`). Roles are
# paths relative to the layer; an MoE layer's modules get "moe" roles (`_moe_role`; local
# experts share one role "*").

#: role -> the site that owns what is saved inside it by default. None: nothing by default
#: (goes to "other").
_ROLE_SITES: dict[str, Optional[str]] = {
    **{tag.slot: site.name for site in BLOCK for tag in site.tags if tag.how == "owns"},
    **dict.fromkeys(SLOTS_WITHOUT_SITE),
}
#: Roles whose first positional input(s) are tagged with a site (pre-hook), in argument order.
_INPUT_TAGS: dict[str, tuple[str, ...]] = {
    role: tuple(name for _, name in sorted((tag.arg, site.name) for site in BLOCK for tag in site.tags
                                           if tag.how == "input" and tag.slot == role))
    for role in dict.fromkeys(tag.slot for site in BLOCK for tag in site.tags if tag.how == "input")}
#: Roles whose output is tagged (post-hook): the attention probabilities, before and
#: after dropout, are what the probs @ V product saves.
_OUTPUT_TAGS: dict[str, str] = {tag.slot: site.name for site in BLOCK for tag in site.tags
                                if tag.how == "output"}
#: Saved directly in the layer (the bias-dropout-add): the dropout mask after the last
#: finished sublayer (the later sublayer first).
_AFTER_SUBLAYER: tuple[tuple[str, str], ...] = tuple(
    (tag.slot, site.name) for site in reversed(BLOCK) for tag in site.tags if tag.how == "after")
_SITE_RANK = {s: i for i, s in enumerate(SITES)}
#: Slots of a TransformerBlock holding a site after the blocks (`Site.scope` "model"): their
#: role is the slot, their layer the block's last.
_BLOCK_SLOTS: tuple[str, ...] = tuple(SITE_OF[name].slot for name in MODEL_SITES)

#: autograd nodes that only re-view, copy or cast their input (used to see that a saved
#: tensor is a parameter in another shape or dtype).
_PASS_NODES = (
    "ViewBackward", "TransposeBackward", "TBackward", "PermuteBackward", "ExpandBackward",
    "UnsafeViewBackward", "ReshapeAliasBackward", "CloneBackward", "ToCopyBackward",
    "SliceBackward", "SelectBackward", "SplitBackward", "SqueezeBackward", "UnsqueezeBackward",
    "AliasBackward", "AsStridedBackward",
)
#: the subset that keeps every element of its input (no slicing): a tensor made from a
#: tagged input through these alone is a copy of that input (`_source`)
_COPY_NODES = (
    "ViewBackward", "TransposeBackward", "TBackward", "PermuteBackward", "ExpandBackward",
    "UnsafeViewBackward", "ReshapeAliasBackward", "CloneBackward", "ToCopyBackward",
    "SqueezeBackward", "UnsqueezeBackward", "AliasBackward",
)


def _check_site_key(layer: Optional[int], site: str) -> SiteKey:
    if site != OTHER and site not in SITES + COUNTED_SITES + OUTER_SITES:
        raise ValueError(f"site: unknown site {site!r}; expected one of "
                         f"{', '.join(SITES + COUNTED_SITES + OUTER_SITES)} or 'other'"
        )
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise ValueError(f"layer: expected a non-negative int or None, got {layer!r}")
    return (layer, site)


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:  # tensor subclasses without a storage (e.g. some wrappers)
        return None


# ---- parameter storages ------------------------------------------------------------------

_extra_param_storages: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register_parameter_storage(t: Any) -> None:
    """Exclude the storage of `t` (a tensor or an UntypedStorage) from every ledger.

    For parameter memory the ledger cannot see as a `Parameter`: flat parameter buffers,
    ZeRO-3 gathered copies held outside the running module. Held weakly.
    """
    st = t if isinstance(t, torch.UntypedStorage) else _storage(t) if isinstance(t, torch.Tensor) else None
    if st is None:
        raise TypeError(f"register_parameter_storage: expected a tensor or storage, got {type(t).__name__}")
    _extra_param_storages[id(st)] = st


def _source(t: torch.Tensor, passes: tuple[str, ...], depth: int = 8) -> Optional[tuple[Any, int]]:
    """(autograd node, output index) that made `t`, looking through up to `depth` nodes whose
    names start with `passes` (single-input re-views and copies); None without one."""
    node, index = t.grad_fn, t.output_nr
    for _ in range(depth):
        if node is None:
            return None
        if not type(node).__name__.startswith(passes):
            return node, index
        nexts = [edge for edge in node.next_functions if edge[0] is not None]
        if len(nexts) != 1:
            return None
        node, index = nexts[0]
    return None


def param_derived(t: torch.Tensor) -> bool:
    """`t` is a Parameter, a view of one, or a re-view/copy/cast of one tracked by autograd."""
    if isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter):
        return True
    src = _source(t, _PASS_NODES)
    return (src is not None and type(src[0]).__name__ == "AccumulateGrad"
            and isinstance(src[0].variable, torch.nn.Parameter))


# ---- where the forward is ----------------------------------------------------------------


class _Frame:
    __slots__ = ("module", "layer", "role", "done", "sources")

    def __init__(self, module, layer, role):
        self.module, self.layer, self.role = module, layer, role
        self.done: set[str] = set()
        #: (id(node), output index) of the tagged inputs -> (site key, node): the nodes stay
        #: alive (and their ids unique) while the module runs
        self.sources: Optional[dict[tuple[int, int], tuple[SiteKey, Any]]] = None


def _is_layer(m: torch.nn.Module) -> bool:
    return hasattr(m, "self_attention") and hasattr(m, "mlp") and hasattr(m, "input_layernorm")


def _moe_role(path: str) -> str:
    """The role of a submodule of an MoE layer's `mlp` (`path` relative to the layer):
    "moe..." with the local expert's index replaced by "*"; a shared expert is the block's
    dense MLP ("mlp...": its tensors go to the `mlp.*` sites)."""
    rest = path[len("mlp"):]
    if rest == ".shared_experts" or rest.startswith(".shared_experts."):
        return "mlp" + rest[len(".shared_experts"):]
    parts = rest.split(".")
    if len(parts) > 3 and parts[1:3] == ["experts", "local_experts"]:
        parts = ["", "experts", "*"] + parts[4:]
    return "moe" + ".".join(parts)


def _is_moe_layer(layer: torch.nn.Module) -> bool:
    mlp = getattr(layer, "mlp", None)
    return hasattr(mlp, "router") and hasattr(mlp, "experts")


def _is_lm(m: torch.nn.Module) -> bool:
    return hasattr(m, "embedding") and hasattr(m, "output_layer") and hasattr(m, "decoder")


def _is_block(m: torch.nn.Module) -> bool:
    """A TransformerBlock: its layers, and a slot of a site after them (the final norm)."""
    return isinstance(getattr(m, "layers", None), torch.nn.ModuleList) and any(
        isinstance(getattr(m, slot, None), torch.nn.Module) for slot in _BLOCK_SLOTS)


@dataclass
class _Entry:
    key: SiteKey
    nbytes: int
    ref: Any  # weakref to the storage (or the reported record); None: manual release
    info: str = ""


class SavedTensorLedger:
    """Bytes held for backward at the end of forward, per (layer, site). A context manager.

    `with SavedTensorLedger() as ledger: out = model(x)` then `ledger.total_bytes`,
    `ledger.by_site()`. Entering again starts a fresh count. See the module docstring for
    what is counted and how sites are found.
    """

    def __init__(self, trace: bool = False):
        self.trace = bool(trace)
        self._lock = threading.RLock()
        self._reset()

    # ---- public ----------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(self.by_site().values())

    def by_site(self) -> dict[SiteKey, int]:
        """{(layer, site): bytes}; (None, "other") for what no site owns. Zero entries dropped."""
        with self._lock:
            table = self._snapshot if self._snapshot is not None else self._live
            return {k: v for k, v in table.items() if v}

    def live_bytes(self) -> int:
        """Bytes held right now (differs from `total_bytes` once backward has started)."""
        with self._lock:
            return sum(self._live.values())

    def per_layer(self) -> dict[Optional[int], int]:
        out: dict[Optional[int], int] = {}
        for (layer, _), n in self.by_site().items():
            out[layer] = out.get(layer, 0) + n
        return out

    def events(self) -> list[dict[str, Any]]:
        """With `trace=True`: every packed tensor (role, shape, dtype, storage bytes, site, counted)."""
        return list(self._events)

    def report(self, layer: Optional[int], site: str, key: Any, nbytes: int,
               replaces: Optional[torch.Tensor] = None) -> None:
        """Count `nbytes` at (layer, site) while `key` lives; see the module-level `report`."""
        site_key = _check_site_key(layer, site)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
        with self._lock:
            if not self._active or _in_backward():
                self._freeze_if_backward()
                return
            tensors = _tensors_of(key)
            claimed = [st for st in (_storage(t) for t in tensors) if st is not None]
            if replaces is not None and _storage(replaces) is not None:
                claimed.append(_storage(replaces))
            for st in claimed:
                self._drop(id(st))
                self._claimed[id(st)] = self._watch(st)
            entry_id, ref = _anchor(key, self._released)
            self._drop(entry_id)
            self._add(entry_id, _Entry(site_key, nbytes, ref, f"report {type(key).__name__}"))

    def release(self, key: Any) -> None:
        """Stop counting a record reported with a plain id (not a weakly referenceable object)."""
        with self._lock:
            self._drop(("id", key))

    @contextlib.contextmanager
    def scope(self, layer: Optional[int], site: str) -> Iterator[None]:
        with scope(layer, site):
            yield

    # ---- context manager -------------------------------------------------------------
    def __enter__(self) -> "SavedTensorLedger":
        if self._active:
            raise RuntimeError("this SavedTensorLedger is already active")
        self._reset()
        self._active = True
        _ACTIVE.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._handles = [
            _nn_module.register_module_forward_pre_hook(self._pre),
            _nn_module.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._hooks.__exit__(*exc)
        with self._lock:
            if self._snapshot is None:
                self._snapshot = dict(self._live)
            self._active = False
        _ACTIVE.remove(self)

    # ---- internals -------------------------------------------------------------------
    def _reset(self) -> None:
        self._active = False
        self._live: dict[SiteKey, int] = {}
        self._snapshot: Optional[dict[SiteKey, int]] = None
        self._entries: dict[Any, _Entry] = {}
        self._claimed: dict[int, Any] = {}
        self._tags: dict[int, tuple[SiteKey, Any]] = {}  # id(storage) -> (site, weakref)
        self._params: dict[int, Any] = {}
        self._frames: list[_Frame] = []
        self._roles: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[Optional[int], str]]" = (
            weakref.WeakKeyDictionary()
        )
        self._next_layer = 0
        self._events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._released = weakref.WeakMethod(self._on_free)

    def _freeze_if_backward(self) -> None:
        if self._snapshot is None and _in_backward():
            self._snapshot = dict(self._live)

    def _add(self, entry_id: Any, entry: _Entry) -> None:
        self._entries[entry_id] = entry
        self._live[entry.key] = self._live.get(entry.key, 0) + entry.nbytes

    def _drop(self, entry_id: Any) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is not None:
            self._live[entry.key] -= entry.nbytes

    def _on_free(self, entry_id: Any) -> None:
        with self._lock:
            self._freeze_if_backward()
            self._drop(entry_id)
            self._claimed.pop(entry_id, None)
            self._tags.pop(entry_id, None)
            self._params.pop(entry_id, None)

    def _watch(self, st) -> Any:
        cb = self._released

        def freed(_ref, sid=id(st)):
            method = cb()
            if method is not None:
                method(sid)

        return weakref.ref(st, freed)

    # where the forward is
    def _layer_index(self, layer: torch.nn.Module) -> int:
        number = getattr(layer, "layer_number", None)
        if isinstance(number, int) and not isinstance(number, bool) and number >= 1:
            return number - 1
        idx = self._next_layer
        self._next_layer += 1
        return idx

    def _learn(self, root: torch.nn.Module) -> None:
        """Assign roles to the submodules of a layer or a language model when first seen."""
        if _is_layer(root):
            layer = self._layer_index(root)
            moe = _is_moe_layer(root)
            for path, sub in root.named_modules():
                if moe and (path == "mlp" or path.startswith("mlp.")):
                    path = _moe_role(path)
                self._roles.setdefault(sub, (layer, path))
        elif _is_block(root):
            self._roles.setdefault(root, (None, None))  # learnt once; what it saves itself: "other"
            last = getattr(root.layers[-1], "layer_number", None) if len(root.layers) else None
            if isinstance(last, int) and not isinstance(last, bool) and last >= 1:
                for slot in _BLOCK_SLOTS:
                    sub = getattr(root, slot, None)
                    if isinstance(sub, torch.nn.Module):
                        self._roles.setdefault(sub, (last - 1, slot))
        elif _is_lm(root):
            for path, sub in root.named_modules():
                if path == "" or path.startswith("embedding"):
                    self._roles.setdefault(sub, (None, "lm." + path if path else "lm"))
                elif path.startswith("output_layer"):
                    self._roles.setdefault(sub, (None, "lm.head"))

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        if _is_layer(module) or _is_lm(module) or _is_block(module):
            if module not in self._roles:
                self._learn(module)
        layer, role = self._roles.get(module, (None, None))
        frame = _Frame(module, layer, role)
        self._frames.append(frame)
        for p in module.parameters(recurse=False):
            st = _storage(p)
            if st is not None:
                self._note_param(st)
        if role in _INPUT_TAGS and torch.is_grad_enabled():
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            for site, t in zip(_INPUT_TAGS[role], tensors):
                self._tag(t, (layer, site))
                src = _source(t, _COPY_NODES)
                if src is not None:
                    frame.sources = frame.sources if frame.sources is not None else {}
                    frame.sources.setdefault((id(src[0]), src[1]), ((layer, site), src[0]))

    def _post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        while self._frames:
            frame = self._frames.pop()
            if frame.module is module:
                break
        if self._frames and frame.role is not None:
            parent = self._frames[-1]
            parent.done.add(frame.role.rsplit(".", 1)[-1])
            if parent.role == "lm" and frame.role.startswith("lm.head"):
                parent.done.add("head")
        role = self._roles.get(module, (None, None))[1]
        if role in _OUTPUT_TAGS and torch.is_grad_enabled():
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor):
                self._tag(out, (self._roles[module][0], _OUTPUT_TAGS[role]))

    def _note_param(self, st) -> None:
        if id(st) not in self._params:
            self._params[id(st)] = self._watch(st)

    def _tag(self, t: torch.Tensor, key: SiteKey) -> None:
        st = _storage(t)
        if st is None or st.nbytes() == 0:
            return
        with self._lock:
            old = self._tags.get(id(st))
            if old is not None and old[0][0] == key[0] and _SITE_RANK[old[0][1]] <= _SITE_RANK[key[1]]:
                return  # Q, K, V views of one buffer: the first site (attn.q) keeps it
            self._tags[id(st)] = (key, self._watch(st))
            entry = self._entries.get(id(st))
            if entry is not None and entry.key != key and id(st) not in self._claimed:
                self._drop(id(st))
                self._add(id(st), _Entry(key, entry.nbytes, entry.ref, entry.info))

    def _scope_site(self, t: torch.Tensor) -> SiteKey:
        explicit = _SCOPE.get()
        if explicit is not None:
            return explicit
        copied = self._copied_site(t)
        if copied is not None:
            return copied
        for frame in reversed(self._frames):
            role = frame.role
            if role is None:
                continue
            if role == "lm":  # the language model itself: the loss after the output layer
                if "head" in frame.done and t.is_floating_point():
                    return (None, LOSS_LOGITS)
                return (None, OTHER)
            if role == "lm.head":
                return (None, LOSS_LOGITS) if t.is_floating_point() else (None, OTHER)
            if role.startswith("lm.embedding"):
                if role.endswith("dropout"):
                    return (None, EMBEDDING_DROPOUT_MASK)
                return (None, EMBEDDING_OUTPUT) if t.is_floating_point() else (None, OTHER)
            if role == "":  # directly in the layer: the bias-dropout-add
                for sub, site in _AFTER_SUBLAYER:
                    if sub in frame.done:
                        return (frame.layer, site)
                return (None, OTHER)
            site = _ROLE_SITES.get(role, "unknown")
            if site == "unknown":
                continue  # a deeper submodule: its nearest known ancestor decides
            if site is None:
                return (None, OTHER)
            return (frame.layer, site)
        return (None, OTHER)

    def _copied_site(self, t: torch.Tensor) -> Optional[SiteKey]:
        """The site of the tagged module input `t` copies (re-views, expands, clones), if any
        running module has such an input."""
        frames = [f for f in reversed(self._frames) if f.sources]
        src = _source(t, _COPY_NODES) if frames else None
        if src is None:
            return None
        for frame in frames:
            hit = frame.sources.get((id(src[0]), src[1]))
            if hit is not None:
                return hit[0]
        return None

    def _is_param(self, t: torch.Tensor, st) -> bool:
        sid = id(st)
        if sid in self._params or sid in _extra_param_storages or param_derived(t):
            return True
        for frame in reversed(self._frames[-4:]):  # ZeRO-3: gathered after our pre-hook
            for p in frame.module.parameters(recurse=False):
                if _storage(p) is st:
                    self._note_param(st)
                    return True
        return False

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self._record(t)
        except Exception as err:  # counting must never break training; kept for diagnosis
            if len(self.errors) < 16:
                self.errors.append(repr(err))
        # detached: the packed object of a saved *output* would otherwise hold its own grad_fn
        # (graph -> packed tensor -> graph), a cycle the collector cannot see, which keeps the
        # whole graph alive for good when the step fails before its backward
        return t.detach()

    def _record(self, t: torch.Tensor) -> None:
        with self._lock:
            if _in_backward():
                self._freeze_if_backward()
                return
            st = _storage(t)
            if st is None:
                return
            sid = id(st)
            counted = not (sid in self._entries or sid in self._claimed or self._is_param(t, st))
            tag = self._tags.get(sid)
            key = tag[0] if tag is not None else self._scope_site(t)
            if counted and st.nbytes() > 0:
                self._add(sid, _Entry(key, st.nbytes(), self._watch(st), str(tuple(t.shape))))
            if self.trace:
                frame = next((f for f in reversed(self._frames) if f.role is not None), None)
                self._events.append(dict(
                    layer=key[0], site=key[1], role=frame.role if frame else None,
                    shape=tuple(t.shape), dtype=t.dtype, storage_bytes=st.nbytes(),
                    counted=counted and st.nbytes() > 0,
                ))

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self._snapshot is None and _in_backward():
            with self._lock:
                self._freeze_if_backward()
        return t

    def table(self, unit: int = 1, title: str = "") -> str:
        """The per-site bytes as text, divided by `unit` (e.g. s*b*h)."""
        rows = sorted(self.by_site().items(), key=lambda kv: (
            -1 if kv[0][0] is None else kv[0][0], _SITE_RANK.get(kv[0][1], 99), kv[0][1]))
        lines = [title] if title else []
        for (layer, site), n in rows:
            lines.append(f"{'-' if layer is None else layer:>5} {site:26s} {n / unit:12.4f}")
        lines.append(f"{'':5} {'total':26s} {self.total_bytes / unit:12.4f}")
        return "\n".join(lines)


def _tensors_of(key: Any) -> list[torch.Tensor]:
    if isinstance(key, torch.Tensor):
        return [key]
    data = getattr(key, "data", None)
    if isinstance(data, dict):
        return [t for t in data.values() if isinstance(t, torch.Tensor)]
    if isinstance(key, (list, tuple)):
        return [t for t in key if isinstance(t, torch.Tensor)]
    return []


def _anchor(key: Any, released: weakref.WeakMethod) -> tuple[Any, Any]:
    """(entry id, weak reference that ends the count) for a reported record.

    A tensor is followed through its storage; a list or tuple of tensors through the
    storage of its first tensor (the payload); other objects through a weak reference to
    themselves, or, when they cannot be weakly referenced (an int, a string), until
    `release(key)`.
    """
    if isinstance(key, (list, tuple)) and key and isinstance(key[0], torch.Tensor):
        key = key[0]
    if isinstance(key, torch.Tensor) and _storage(key) is not None:
        key = _storage(key)
    try:
        kid = id(key)

        def freed(_ref, kid=kid):
            method = released()
            if method is not None:
                method(kid)

        return kid, weakref.ref(key, freed)
    except TypeError:  # not weakly referenceable (an int, a string, a tuple): release() ends it
        return ("id", key), None


# ---- the active ledgers and the API for compressed layers ----------------------------------

_ACTIVE: list[SavedTensorLedger] = []


class _ScopeVar(threading.local):
    value: Optional[SiteKey] = None

    def get(self) -> Optional[SiteKey]:
        return self.value


_SCOPE = _ScopeVar()


def current_ledger() -> Optional[SavedTensorLedger]:
    """The innermost active ledger, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def report(layer: Optional[int], site: str, key: Any, nbytes: int,
           replaces: Optional[torch.Tensor] = None) -> None:
    """Count a record a compressed layer stores for backward, in every active ledger.

    `key` keeps the count alive: an object the layer holds until backward (the `Encoded`
    record; a tensor: its storage; a list of tensors: the first one's storage), weakly
    referenced, or a plain id (an int, a string) ended with `ledger.release(id)`. The storages of the tensors in `key` (a tensor, a list of
    tensors, or an `Encoded`'s `.data`) are claimed: autograd saving them too does not
    count again. `replaces`: the raw tensor this record stands for, if the ledger may
    already have counted it. A no-op without an active ledger, and during backward.
    """
    _check_site_key(layer, site)
    for ledger in list(_ACTIVE):
        ledger.report(layer, site, key, nbytes, replaces=replaces)


@contextlib.contextmanager
def scope(layer: Optional[int], site: str) -> Iterator[None]:
    """Attribute what autograd saves inside the block to (layer, site) (unless tagged)."""
    key = _check_site_key(layer, site)
    outer = _SCOPE.value
    _SCOPE.value = key
    try:
        yield
    finally:
        _SCOPE.value = outer
