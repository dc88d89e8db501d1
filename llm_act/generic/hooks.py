"""GACT's generic path: encode every activation autograd saves, through saved-tensor hooks.

Models with no compressed layer (plain torch, Hugging Face-style decoders) still save
their activations through autograd, so one pair of `saved_tensors_hooks` can compress
all of them (GACT sec. 5.2-5.3): the pack hook encodes a saved tensor with a codec and
hands autograd a small handle; the unpack hook decodes it in backward.

What the pack hook does with a saved tensor `t`:
- parameters are kept as they are and not counted: a `Parameter`, a view of one (same
  storage as a parameter of `module` or of any module that runs inside the context), or
  an autograd-tracked cast of one (autocast weight copies);
- floating tensors that require grad are encoded with the codec `codec_for` picks (a
  fixed name, or a callable deciding by shape/dtype; None or "keep" keeps it); floating
  tensors that do not require grad (softmax logsumexp, norm statistics, float dropout
  masks, running stats: GACT's "training states") are kept, unless `require_grad=False`;
- bool tensors (masks) are bit-packed with `BitMask` (lossless) when `pack_masks`;
  integer tensors (indices) are kept;
- tensors with fewer than `min_numel` elements (default 1024) are kept: their scales
  and bookkeeping would cost about as much as they save;
- never more than stock: a tensor is encoded only where the codec's size formula
  (`Codec.within_raw`, no trial encode) stores no more bytes than the raw tensor; otherwise
  it is kept and its raw bytes are booked at its site (`HookStats.declined`).

A storage is encoded once however many ops save it (GACT sec. 5.3), with the codec of
the first site that saves it, and counted there, as the ledger counts it; a storage
already held raw (kept at an earlier save) is kept at later saves too, since an encoded
copy would only add bytes. Records are keyed by the storage (its data pointer, checked
alive through a weak reference, and its version counter, so an in-place change
re-encodes). A saved tensor that covers its whole storage (contiguous, transposed or
permuted) is encoded in its logical shape, its dimensions permuted into storage order (a
contiguous view: a transposed K of shape [b, h, s, d] is encoded as [b, s, h, d]; never
as a flat buffer, so per-channel codecs see channels), and every later view of it is
served by re-viewing the decoded storage; a partial view (Q, K, V of one QKV buffer) is
encoded on its own in its own shape, keyed by (offset, shape, stride). A small view kept
raw whose storage is more than twice its size is cloned, so it does not pin the storage.

Where a saved tensor is booked (its ledger site, and in a subclass the codec of that site)
is `site_of(t)`: the context's `site` here; a subclass that knows more about the tensors
(the generic door's blocks: the submodule that saves it, and q, k and v inside an attention
call, `llm_act.patches.deepspeed.hf_attention`) overrides it.

In backward a record is decoded lazily, once per storage per backward pass (the decoded
copy is shared by all its views and dropped when the pass ends). Encoded bytes, and the
bytes of what is kept raw, are reported to the active `SavedTensorLedger`s, since only the
innermost `saved_tensors_hooks` fires and the ledger's own hook sees nothing here.

`checkpoint_blocks` (GACT's CB1, Megatron's "full" recompute) lives in
`llm_act.generic.checkpoint`, which builds on this module.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch.nn.modules import module as _nn_module

from llm_act import ledger as _ledger
from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.registry import CODEC_NAMES, FEWBIT_CODECS, KEEP, make_codec
from llm_act.sites import OUTER_SITES, SITES

#: Tensors with fewer elements are kept as they are.
DEFAULT_MIN_NUMEL = 1024
#: Codecs that do not reconstruct an arbitrary float tensor (few-bit stores f'(x), regen
#: draws its own mask) or apply only to masks.
_NOT_GENERIC = FEWBIT_CODECS | {"regen", "bitmask"}

#: a codec name for every tensor, or a callable giving each tensor a codec name or a `Codec`
#: instance of the caller's own (its random stream and name stay the caller's: the generic
#: path's controller hands out its codecs, and measurement its capture probe)
CodecChoice = Union[str, Callable[[torch.Tensor], Union[None, str, Codec]]]

def _task_id() -> int:
    return torch._C._current_graph_task_id()


def _check_codec_name(name: Any, what: str) -> Optional[str]:
    """None for "keep"/None, else a codec name valid for the generic path."""
    if name is None or name == KEEP:
        return None
    if not isinstance(name, str) or name not in CODEC_NAMES:
        raise ValueError(f"{what}: unknown codec {name!r}; choose 'keep' or one of "
                         f"{', '.join(n for n in CODEC_NAMES if n not in _NOT_GENERIC)}")
    if name in _NOT_GENERIC:
        raise ValueError(f"{what}: codec {name!r} cannot stand for an arbitrary saved tensor "
                         f"(few-bit and mask codecs apply only to their sites)")
    return name


def _check_codec(codec: Codec) -> Codec:
    """`codec` (an instance `codec_for` returned) where it can stand for any saved tensor."""
    if codec.name in _NOT_GENERIC:
        raise ValueError(f"codec_for(tensor) returned codec {codec.name!r}, which cannot stand for an "
                         f"arbitrary saved tensor (few-bit and mask codecs apply only to their sites)")
    return codec


def _dense_cover(t: torch.Tensor, storage_numel: int) -> bool:
    """`t` is non-overlapping and dense and spans its whole storage from offset 0."""
    if t.storage_offset() != 0 or t.numel() != storage_numel or t.numel() == 0:
        return False
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t` with its dimensions (of size > 1) permuted into storage order: for a dense
    tensor a contiguous view of its storage in the tensor's own dims (a transposed K stays
    [b, s, h, d], never a flat buffer), so per-channel codecs see its channels."""
    dims = [d for d in range(t.dim()) if t.shape[d] != 1]
    order = list(range(t.dim()))
    for slot, d in zip(dims, sorted(dims, key=lambda d: -t.stride(d))):
        order[slot] = d
    return t.permute(order)


@dataclass
class HookStats:
    """What one context (one `with`) did. Bytes are counted when saved, not live."""

    encoded: int = 0        #: records encoded
    encoded_bytes: int = 0  #: their stored bytes (`Encoded.nbytes`)
    raw_bytes: int = 0      #: bytes of the storages or views they stand for
    reused: int = 0         #: saves served by an existing record (shared storages)
    decoded: int = 0        #: decodes in backward (once per record per backward pass)
    kept: int = 0           #: non-parameter tensors kept as they are
    kept_bytes: int = 0     #: bytes they hold (their storages, or clones)
    parameters: int = 0     #: saves of parameters (kept, not counted)
    declined: int = 0       #: saves kept because the codec would store more than the raw tensor
    declined_bytes: int = 0  #: their raw bytes (also in `kept_bytes`)
    by_codec: dict = field(default_factory=dict)  #: codec name -> encoded bytes


class OncePerPass:
    """A saved value made at most once per backward pass (`value()`, made by `_make`): the
    copy is shared by every view autograd unpacks in that pass and dropped when it ends, so
    it never outlives the pass that needed it."""

    __slots__ = ("_cache", "__weakref__")

    def __init__(self) -> None:
        self._cache: Optional[tuple[int, torch.Tensor]] = None

    def _make(self) -> torch.Tensor:
        raise NotImplementedError

    def value(self) -> torch.Tensor:
        task = _task_id()
        cache = self._cache
        if cache is not None and cache[0] == task:
            return cache[1]
        x = self._make()
        if task != -1:  # in backward: share with the other views, drop when the pass ends
            ref = weakref.ref(self)

            def clear() -> None:
                held = ref()
                if held is not None:
                    held._cache = None

            try:
                torch.autograd.Variable._execution_engine.queue_callback(clear)
                self._cache = (task, x)
            except RuntimeError:  # not on the engine's thread: make it again next time
                pass
        return x


class _Record(OncePerPass):
    """One encoded storage (flat) or view, decoded at most once per backward pass."""

    __slots__ = ("codec", "enc", "stats")

    def __init__(self, codec: Codec, enc: Encoded, stats: HookStats):
        super().__init__()
        self.codec, self.enc, self.stats = codec, enc, stats

    def _make(self) -> torch.Tensor:
        self.stats.decoded += 1
        return self.codec.decode(self.enc)


class Packed:
    """What autograd holds for a saved tensor made again in backward: a `OncePerPass` value
    (a record decoded, a rebuilt tensor) and how to view it (None: as it is)."""

    __slots__ = ("source", "view")

    def __init__(self, source: OncePerPass, view: Optional[tuple]):
        self.source, self.view = source, view

    def unpack(self) -> torch.Tensor:
        x = self.source.value()
        if self.view is None:
            return x
        shape, stride, offset = self.view
        return x.as_strided(shape, stride, offset)


class _StorageEntry:
    __slots__ = ("ref", "version", "flat", "views", "kept")

    def __init__(self, ref, version: int):
        self.ref, self.version = ref, version
        self.kept = False  # held raw by autograd already (counted at the first site)
        self.flat: dict[tuple, _Record] = {}   # (dtype, codec) -> record of the whole storage
        self.views: dict[tuple, _Record] = {}  # (offset, shape, stride, dtype) -> record


class SavedTensorCompression:
    """The context manager behind `compress_saved_tensors`; reusable (not re-entrant).

    Codecs (and their private random streams) persist across `with` blocks; the shared-
    storage table and `stats` start afresh at each entry.
    """

    def __init__(self, module: Optional[torch.nn.Module], codec_for: CodecChoice = "int4", *,
                 min_numel: int = DEFAULT_MIN_NUMEL, require_grad: bool = True,
                 pack_masks: bool = True, seed: int = 1234, layer: Optional[int] = None,
                 site: str = _ledger.OTHER):
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module or None, "
                            f"got {type(module).__name__}")
        if isinstance(codec_for, str):
            self._fixed: Optional[str] = _check_codec_name(codec_for, "codec_for")
            self._choose: Optional[Callable] = None
        elif callable(codec_for):
            self._fixed, self._choose = None, codec_for
        else:
            raise TypeError(f"codec_for: expected a codec name or a callable, "
                            f"got {type(codec_for).__name__}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel: expected a non-negative int, got {min_numel!r}")
        if site != _ledger.OTHER and site not in SITES and site not in OUTER_SITES:
            raise ValueError(f"site: unknown site {site!r}")
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)
                                  or layer < 0):
            raise ValueError(f"layer: expected a non-negative int or None, got {layer!r}")
        self.module = module
        self.min_numel = min_numel
        self.require_grad = bool(require_grad)
        self.pack_masks = bool(pack_masks)
        self.seed = int(seed)
        self.layer, self.site = layer, site
        self.stats = HookStats()
        self._codecs: dict[str, Codec] = {}
        self._active = False
        self._storages: dict[tuple, _StorageEntry] = {}
        #: (data pointer, device) -> weak reference to the parameter storage seen there: a
        #: ZeRO-3 parameter's gathered storage is freed after its module runs, and an
        #: activation may then be allocated at the same address
        self._params: dict[tuple, weakref.ref] = {}

    @property
    def active(self) -> bool:
        return self._active

    def codec(self, name: str, site: Optional[str] = None) -> Codec:
        """The codec `name` that encodes a tensor booked at `site` (here one instance per
        name, whatever the site; a subclass may hand out a site's own instance)."""
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = make_codec(name, seed=self.seed)
        return codec

    # ---- context manager -------------------------------------------------------------
    def __enter__(self) -> "SavedTensorCompression":
        if self._active:
            raise RuntimeError("this SavedTensorCompression is already active")
        self._active = True
        self.stats = HookStats()
        self._storages = {}
        self._params = {}
        if self.module is not None:
            for p in self.module.parameters():
                self._note_param(p)
        self._pre = _nn_module.register_module_forward_pre_hook(self._module_pre)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._pre.remove()
        self._storages = {}
        self._params = {}
        self._active = False

    # ---- parameters ------------------------------------------------------------------
    def _note_param(self, p: torch.Tensor) -> None:
        try:
            st = p.untyped_storage()
        except Exception:  # parameters without a storage (meta, some wrappers)
            return
        if st.nbytes():
            self._params[(st.data_ptr(), p.device)] = weakref.ref(st)

    def _module_pre(self, module: torch.nn.Module, args: tuple) -> None:
        for p in module.parameters(recurse=False):
            self._note_param(p)

    def _is_param(self, t: torch.Tensor, st) -> bool:
        seen = self._params.get((st.data_ptr(), t.device))
        if seen is not None and seen() is st:  # the parameter's storage itself, still alive
            return True
        return _ledger.param_derived(t)  # a Parameter, a view, or a tracked cast of one

    # ---- pack / unpack ---------------------------------------------------------------
    def site_of(self, t: torch.Tensor) -> str:
        """The site the saved tensor `t` is booked at: the context's `site` (a subclass that
        tells a context's tensors apart overrides it)."""
        return self.site

    def _codec_for(self, t: torch.Tensor, site: str) -> Optional[Codec]:
        if t.dtype == torch.bool:
            return self.codec("bitmask", site) if self.pack_masks else None
        if not t.is_floating_point() or (self.require_grad and not t.requires_grad):
            return None
        if self._choose is None:
            name = self._fixed
        else:
            choice = self._choose(t)
            if isinstance(choice, Codec):
                return _check_codec(choice)
            name = _check_codec_name(choice, "codec_for(tensor) returned")
        return None if name is None else self.codec(name, site)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            st = t.untyped_storage()
        except Exception:  # tensor subclasses without a storage: leave them alone
            return t
        if self._is_param(t, st):
            self.stats.parameters += 1
            return t
        site = self.site_of(t)
        codec = self._codec_for(t, site) if t.numel() >= max(self.min_numel, 1) else None
        if codec is None:
            return self._keep(t, st, site)
        return self._encode(t, st, codec, site)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, Packed) else packed

    def _keep(self, t: torch.Tensor, st, site: str) -> torch.Tensor:
        own = t.numel() * t.element_size()
        if st.nbytes() > 2 * max(own, 1):  # do not pin a large (maybe encoded) storage
            t = t.detach().clone()
            nbytes = own
        else:
            # detached (same storage): a saved *output* packed as itself holds its own grad_fn,
            # a cycle through the graph that keeps it alive for good if the step fails
            t = t.detach()
            entry = self._entry(t, st)
            if entry.kept:  # the storage is held raw already: counted once, at its first site
                self.stats.reused += 1
                return t
            entry.kept = True
            nbytes = st.nbytes()
        self.stats.kept += 1
        self.stats.kept_bytes += nbytes
        if nbytes:
            _ledger.report(self.layer, site, t, nbytes)
        return t

    def _entry(self, t: torch.Tensor, st) -> _StorageEntry:
        key = (st.data_ptr(), t.device)
        entry = self._storages.get(key)
        if entry is not None and entry.ref() is st and entry.version == t._version:
            return entry

        storages = self._storages

        def freed(_ref, key=key):
            current = storages.get(key)
            if current is not None and current.ref is _ref:
                del storages[key]

        entry = self._storages[key] = _StorageEntry(weakref.ref(st, freed), t._version)
        return entry

    def _encode(self, t: torch.Tensor, st, codec: Codec, site: str) -> Any:
        entry = self._entry(t, st)
        if entry.kept:  # autograd holds the raw storage anyway: an encoded copy adds bytes
            return self._keep(t, st, site)
        shape, stride, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
        # one record per storage, whatever codec a later site names (counted once)
        flat = next((r for (dtype, _), r in entry.flat.items() if dtype == t.dtype), None)
        if flat is not None:
            self.stats.reused += 1
            return Packed(flat, (shape, stride, offset))
        vkey = (offset, shape, stride, t.dtype)
        record = entry.views.get(vkey)
        if record is not None:
            self.stats.reused += 1
            return Packed(record, None)

        name = codec.name
        size = t.element_size()
        whole = st.nbytes() % size == 0 and _dense_cover(t, st.nbytes() // size)
        source = t.detach()
        if whole:
            source = _memory_order(source)
            whole = source.is_contiguous()
            if not whole:
                source = t.detach()
        if not codec.within_raw(source.shape, t.dtype):  # never more than stock: keep it
            self.stats.declined += 1
            self.stats.declined_bytes += t.numel() * size
            return self._keep(t, st, site)
        with torch.no_grad():
            enc = codec.encode(source)
        record = _Record(codec, enc, self.stats)
        if whole:
            entry.flat[(t.dtype, name)] = record
            packed = Packed(record, (shape, stride, offset))
        else:
            entry.views[vkey] = record
            packed = Packed(record, None)
        s = self.stats
        s.encoded += 1
        s.encoded_bytes += enc.nbytes
        s.raw_bytes += t.numel() * size
        s.by_codec[name] = s.by_codec.get(name, 0) + enc.nbytes
        _ledger.report(self.layer, site, enc, enc.nbytes, replaces=t)
        return packed


def compress_saved_tensors(module: Optional[torch.nn.Module] = None,
                           codec_for: CodecChoice = "int4", **kwargs) -> SavedTensorCompression:
    """A context manager that encodes every activation autograd saves inside it.

    `module` (or None): its parameters are never encoded (those of any module that runs
    inside the context are recognised too). `codec_for`: a codec name ("int8", "int4",
    "fp8_e4m3", ...; "keep" encodes nothing) or a callable `tensor -> name | None`.
    Keyword options: `min_numel` (default `DEFAULT_MIN_NUMEL`), `require_grad` (keep
    floating tensors that do not require grad; default True), `pack_masks` (bit-pack bool
    tensors; default True), `seed` (stochastic rounding), and `layer`/`site` (where the
    ledger counts the bytes; default (None, "other")). See the module docstring.
    """
    return SavedTensorCompression(module, codec_for, **kwargs)


class GenericCompression(torch.nn.Module):
    """`module` whose forward runs inside `compress_saved_tensors(module, codec_for, ...)`.

    Under `torch.no_grad()` no hooks are installed. `.hooks.stats` tells what the last
    forward encoded. The wrapped module is `.module` (state-dict keys gain "module.").
    """

    def __init__(self, module: torch.nn.Module, codec_for: CodecChoice = "int4", **kwargs):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.hooks = SavedTensorCompression(module, codec_for, **kwargs)

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled() or self.hooks.active:
            return self.module(*args, **kwargs)
        with self.hooks:
            return self.module(*args, **kwargs)


__all__ = ["DEFAULT_MIN_NUMEL", "GenericCompression", "HookStats", "OncePerPass", "Packed",
           "SavedTensorCompression", "compress_saved_tensors"]
