"""What a Hugging Face attention saves, told apart: q, k, v and the attention's own tensors.

Why: a transformers decoder computes its attention in one call through the attention
interface, `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)(module, query, key, value, attention_mask, ...)`, and a fused kernel
saves q, k, v, its output and its logsumexp inside one op: the submodule that saves them (the
attention module) cannot tell them apart, so the generic path booked them all at `attn.q`.
The call's own arguments can.

How (`book`): while a block's hooks are active (a plan encodes something in it), the attention
module's forward pre-hook has the interface object its modeling file calls hand out, for that
forward only, the function it would have returned wrapped: the wrapper calls it unchanged (the
same function with the same arguments: the forward is stock's) inside
`hooks.inside(AttentionSaves(query, key, value))`, and the forward hook (always called, errors
included) takes the wrapper away. Nothing is renamed and no transformers code is copied:
`config._attn_implementation`, the mask function chosen by that name, flash attention's own
reading of it, GPT-2's `using_eager` and the family's eager function (the interface's default)
all stay stock's. Under plan "keep" (no hook active) and plan "recompute" (the block recomputes
as a whole and its site hooks stay off) nothing is swapped. ZeRO-3 gathers parameters in
module hooks, which this leaves alone (the attention function owns no parameters). The swap is
process-wide for one attention forward: one thread drives a model's forward, as in DeepSpeed
and torch.

What each saved tensor of the call is booked at (`AttentionSaves.site_of`, the first rule that
holds):
1. attn.q / attn.k / attn.v: query, key or value as passed, and what one-input ops make of
   it (views, transposes, `repeat_kv`'s GQA copies, the math kernel's scaled copies), found
   by walking autograd's graph back from the saved tensor (at most `MAX_STEPS` nodes);
2. attn.softmax: the probabilities, one-input ops back to a softmax (eager; SDPA's math
   kernel, which CPU SDPA runs with dropout);
3. attn.dropout_mask: no autograd history and the scores' shape [b, heads, s_q, s_kv];
4. attn.out: the rest, a fused kernel's output and logsumexp (SDPA's flash / efficient / CPU
   kernels, flash-attn, flex), the mask it was given, its RNG state.

So: eager saves q, the GQA-expanded k and v (attn.k, attn.v: more bytes than the un-expanded
K/V the schema sizes), the probabilities before and after dropout (attn.softmax) and the
dropout mask; SDPA's fused kernels save q, k and v as passed (un-expanded under GQA where the
kernel takes `enable_gqa`; `repeat_kv`'s copies when a mask is given), the output and the
logsumexp (attn.out, where the schema puts them; the output is also o_proj's input);
flash_attention_* and flex_attention save the same kinds as SDPA's fused kernels (by these
rules; the CPU tests cannot run them: flash needs CUDA, flex has no CPU backward).

Supported `attn_implementation` values (`SUPPORTED`, where the installed transformers has them):
eager, sdpa, flash_attention_2/3/4, flex_attention. Any other (`paged|eager`, a Hub kernel, a
function a user registered) is refused in one line (`check`): what it saves is not known.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol

import torch
from torch.autograd.graph import get_gradient_edge

from llm_act.sites import ATTN_DROPOUT_MASK, ATTN_K, ATTN_OUT, ATTN_Q, ATTN_SOFTMAX, ATTN_V

#: attn_implementation values whose saved tensors the rules above tell apart
SUPPORTED: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2", "flash_attention_3",
                              "flash_attention_4", "flex_attention")

#: how many one-input autograd nodes a saved tensor is traced back through to q, k, v or a
#: softmax (the longest met: SDPA's math kernel's scaled, transposed, expanded K, 7)
MAX_STEPS = 16

_FIX = "load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"


def _edge(t: torch.Tensor) -> Optional[tuple]:
    """(autograd node, output number) that produced `t` (a leaf's AccumulateGrad), or None."""
    if not t.requires_grad:
        return None
    edge = get_gradient_edge(t)
    return edge.node, edge.output_nr


def _storage_key(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.device


class AttentionSaves:
    """The sites of what one call of an attention function saves (the module docstring's table)."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        self.nodes: dict[tuple, str] = {}
        self.plain: dict[tuple, str] = {}  # q, k, v without autograd history: by storage
        for t, site in ((value, ATTN_V), (key, ATTN_K), (query, ATTN_Q)):
            edge = _edge(t)
            if edge is not None:
                self.nodes[edge] = site
            else:
                self.plain[_storage_key(t)] = site
        self.scores = (*query.shape[:-1], key.shape[-2])

    def site_of(self, t: torch.Tensor) -> str:
        node = _edge(t)
        for _ in range(MAX_STEPS):
            if node is None:
                break
            site = self.nodes.get(node)
            if site is not None:
                return site
            if "Softmax" in type(node[0]).__name__:  # SoftmaxBackward0, SafeSoftmaxBackward0
                return ATTN_SOFTMAX
            inputs = [n for n in node[0].next_functions if n[0] is not None]
            if len(inputs) != 1:
                break
            node = inputs[0]
        if not t.requires_grad:
            site = self.plain.get(_storage_key(t))
            if site is not None:
                return site
            if tuple(t.shape) == self.scores:
                return ATTN_DROPOUT_MASK
        return ATTN_OUT


class Booking(Protocol):
    """What `book` needs of a block's saved-tensor hooks (`generic._BlockHooks`)."""

    @property
    def active(self) -> bool: ...

    def inside(self, saves: AttentionSaves) -> ContextManager[None]: ...


def refusal(model_name: str, implementation: Any, interface: Any) -> str:
    """The one line that refuses an attn_implementation whose saved tensors are not known."""
    have = [n for n in SUPPORTED if n == "eager" or n in interface]
    return (f"model: {model_name} has attn_implementation {implementation!r}, whose saved tensors "
            f"llm_act cannot tell apart (q, k, v and the attention's own); supported: "
            f"{', '.join(have)}; {_FIX}")


def interface_of(attention: torch.nn.Module, model_name: str):
    """The attention interface object the modeling file of `attention` calls; a ValueError in
    one line when the installed transformers has none (not the version the 'hf' extra pins)."""
    namespace = vars(sys.modules[type(attention).__module__])
    interface = namespace.get("ALL_ATTENTION_FUNCTIONS")
    if interface is None or not callable(getattr(type(interface), "get_interface", None)):
        import transformers

        raise ValueError(
            f"model: {model_name}'s {type(attention).__name__} ({type(attention).__module__}) does not "
            f"call transformers' AttentionInterface.get_interface, through which llm_act tells q, k "
            f"and v apart: transformers {transformers.__version__} is not the version llm_act "
            f"supports; pip install 'llm-act[hf]'")
    return interface


def check(model_name: str, config: Any, attention: torch.nn.Module,
          bypass: Mapping[str, str]) -> None:
    """Refuse, in one line, an attention llm_act cannot book: an unsupported
    attn_implementation, or a config flag that takes the attention off the interface."""
    implementation = config._attn_implementation
    interface = interface_of(attention, model_name)
    if implementation not in SUPPORTED or (implementation != "eager" and implementation not in interface):
        raise ValueError(refusal(model_name, implementation, interface))
    for flag, under in bypass.items():
        if under == implementation and config.to_dict().get(flag):
            raise ValueError(
                f"model: {model_name} has {flag}=True, which under attn_implementation "
                f"{implementation!r} computes the attention outside transformers' attention "
                f"interface, where llm_act cannot tell q, k and v apart; set {flag}=False or "
                f"{_FIX}")


class _Swap:
    """One attention module's forward hooks: the interface hands out booked functions while
    the block's hooks are active (the module docstring's "How")."""

    def __init__(self, attention: torch.nn.Module, hooks: Booking, model_name: str):
        self.interface = interface_of(attention, model_name)
        self.hooks, self.model_name = hooks, model_name
        self.restore: Optional[Callable[[], None]] = None
        attention.register_forward_pre_hook(self.pre)
        attention.register_forward_hook(self.post, always_call=True)

    def pre(self, _module, _args) -> None:
        if not self.hooks.active or self.restore is not None:
            return
        interface = self.interface
        own = vars(interface)
        had, previous = "get_interface" in own, own.get("get_interface")
        stock = interface.get_interface

        def restore() -> None:
            if had:
                interface.get_interface = previous
            else:
                del interface.get_interface

        def get_interface(implementation: str, default: Callable) -> Callable:
            if implementation not in SUPPORTED:
                raise ValueError(refusal(self.model_name, implementation, interface))
            return self._booked(stock(implementation, default))

        interface.get_interface = get_interface
        self.restore = restore

    def post(self, _module, _args, _out) -> None:
        if self.restore is not None:
            restore, self.restore = self.restore, None
            restore()

    def _booked(self, function: Callable) -> Callable:
        hooks = self.hooks

        def booked(module, query, key, value, *args, **kwargs):
            with hooks.inside(AttentionSaves(query, key, value)):
                return function(module, query, key, value, *args, **kwargs)

        return booked


def book(attention: torch.nn.Module, hooks: Booking, model_name: str) -> None:
    """Tell q, k, v and the attention's own saved tensors apart in `attention`'s forward
    (a transformers attention module), for `hooks` (its block's)."""
    _Swap(attention, hooks, model_name)


__all__ = ["AttentionSaves", "Booking", "MAX_STEPS", "SUPPORTED", "book", "check", "interface_of",
           "refusal"]
