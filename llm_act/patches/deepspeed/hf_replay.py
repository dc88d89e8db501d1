"""Per-site recompute on a Hugging Face family's blocks: a norm's output, rebuilt in backward by
replaying the norm on what its input site stores.

Which sites, and how (the family's table, `hf_families`, names the norm):

    attn.qkv_input <- the input norm (input_layernorm, gpt2's ln_1) replayed on ln1.input
    mlp.fc1_input  <- the post-attention norm (post_attention_layernorm, ln_2) on ln2.input

Why only these: a generic block's ops are its own code, so a site can be rebuilt alone only
where one submodule made it from one site's value. These two are made so, and they are the
block's largest replayable tensors (each the size of the block input) at the price of a norm.
The others need the block's own code (`ln2.input`: the residual add; `mlp.fc2_input`:
the gated product) or a projection (`mlp.act_input`: gate_proj and up_proj): those sites are
recomputed only with the whole block.

How, in the block's saved-tensor hooks (`generic._BlockHooks`): while the norm runs, the first
floating tensor of its input's shape that it saves is noted (the input itself; under bf16
Llama's RMSNorm the float32 copy it upcasts to), packed as the input site's codec packs it.
The norm's output is noted when it returns. A projection that then saves that output (any
view of its storage) gets a `Packed` whose value is the norm re-run, under no_grad, on the
noted input (decoded where encoded, cast back to the input's dtype: exact where the input is
kept), made once per backward pass for every projection that reads it. Nothing else is held:
the noted input is what the norm's own backward holds anyway.

A saved tensor at a replayed site that is not the norm's output (an adapter's dropout in
front of a projection) is kept raw and booked there, as any kept tensor: never corrupted.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional

import torch

from llm_act.generic.hooks import OncePerPass, Packed, SavedTensorCompression
from llm_act.sites import ATTN_QKV_INPUT, MLP_FC1_INPUT, PRODUCER_INPUTS

#: the sites a family's block rebuilds alone, each from the one site its norm reads
REPLAYED: tuple[str, ...] = (ATTN_QKV_INPUT, MLP_FC1_INPUT)


def producers(table: Mapping[str, Optional[str]]) -> dict[str, str]:
    """{site of `REPLAYED`: the path of the norm that makes it} in a family's site table
    (`hf_families.DecoderFamily.sites`): the one submodule booked at the site it is made from."""
    out = {}
    for site in REPLAYED:
        (source,) = PRODUCER_INPUTS[site]
        paths = [path for path, booked in table.items() if booked == source]
        if len(paths) == 1:
            out[site] = paths[0]
    return out


class _Rebuilt(OncePerPass):
    """A norm's output, made again from its noted input."""

    __slots__ = ("module", "source", "dtype")

    def __init__(self, module: torch.nn.Module, source: Any, dtype: torch.dtype):
        super().__init__()
        self.module, self.source, self.dtype = module, source, dtype

    def _make(self) -> torch.Tensor:
        x = SavedTensorCompression._unpack(self.source).to(self.dtype)
        with torch.no_grad():
            return self.module(x)


class _Made:
    """One forward's output of a norm: its storage (weakly), version and layout, and how to
    rebuild it."""

    __slots__ = ("storage", "version", "layout", "rebuilt")

    def __init__(self, out: torch.Tensor, rebuilt: _Rebuilt):
        self.storage = weakref.ref(out.untyped_storage())
        self.version, self.layout = out._version, (tuple(out.shape), out.stride(), out.storage_offset())
        self.rebuilt = rebuilt


class Replays:
    """One block's replayable sites (`producers`): what each norm made in this forward, and
    the `Packed` that stands for it where a projection saves it."""

    def __init__(self, block: torch.nn.Module, paths: Mapping[str, str]):
        self.modules = {site: block.get_submodule(path) for site, path in paths.items()}
        self.sites = frozenset(paths)
        self.reset()

    def reset(self) -> None:
        """Forget the last forward (at each forward's start)."""
        self.made: dict[str, _Made] = {}
        self.running: Optional[list] = None  # [site, input, packed input or None]

    def hook(self, active: Any) -> None:
        """Note each norm's input and output while `active()` (the block's hooks are on)."""
        for site, module in self.modules.items():
            def pre(_m, args, site=site):
                if active() and args and torch.is_tensor(args[0]):
                    self.running = [site, args[0], None]

            def post(m, _args, out, site=site):
                running, self.running = self.running, None
                if (active() and running is not None and running[0] == site and running[2] is not None
                        and torch.is_tensor(out) and _whole(out)):
                    self.made[site] = _Made(out, _Rebuilt(m, running[2], running[1].dtype))

            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post, always_call=True)

    def saved(self, t: torch.Tensor, packed: Any) -> None:
        """`t` was saved (as `packed`): the running norm's input, if it is the first floating
        tensor of that shape the norm saves."""
        running = self.running
        if running is not None and running[2] is None and t.is_floating_point() and t.shape == running[1].shape:
            running[2] = packed

    def packed(self, site: str, t: torch.Tensor) -> Optional[Packed]:
        """What autograd holds for `t`, saved at `site`, if `t` views the output its norm made
        in this forward (unchanged since); None otherwise."""
        made = self.made.get(site)
        if made is None or made.storage() is not t.untyped_storage() or made.version != t._version:
            return None
        view = (tuple(t.shape), t.stride(), t.storage_offset())
        return Packed(made.rebuilt, None if view == made.layout else view)


def _whole(out: torch.Tensor) -> bool:
    """`out` is contiguous and spans its storage: a rebuilt copy has its layout, so any view
    of the output is the same view of the copy."""
    return (out.is_contiguous() and out.storage_offset() == 0
            and out.numel() * out.element_size() == out.untyped_storage().nbytes())


__all__ = ["REPLAYED", "Replays", "producers"]
