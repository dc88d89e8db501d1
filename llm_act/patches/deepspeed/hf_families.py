"""The Hugging Face decoder families the generic door knows site by site: one declared table each.

Why tables: the generic path (`generic.site_of`) guesses the site of what a block submodule
saves from its last name (`o_proj` -> `attn.out`, `c_proj` under `attn` -> `attn.out`, ...).
That is right for most decoders and silently wrong for any name it has not met. For the dense
decoders transformers ships and users train, the paths are known, so they are declared once,
here, keyed by `config.model_type` (the keys `llm-act plan --hf-config` reads too) and checked
against the decoder layer's class; a test holds each table to the block transformers builds
(every submodule path declared, nothing else), so a release that renames one is caught.

| block path (llama-style: llama, qwen2, qwen3, mistral) | site              | gpt2 path          |
| ------------------------------------------------------ | ----------------- | ------------------ |
| input_layernorm                                        | ln1.input         | ln_1               |
| self_attn (rotary's cos and sin, booked with Q)        | attn.q            | attn (nothing)     |
| self_attn.q_proj, k_proj, v_proj                       | attn.qkv_input    | attn.c_attn        |
| self_attn.q_norm, self_attn.k_norm (qwen3)             | attn.q/k_norm_input | -                |
| self_attn.o_proj                                       | attn.out          | attn.c_proj        |
| -                                                      | attn.dropout_mask | attn.attn_dropout  |
| -                                                      | attn.hidden_dropout_mask | attn.resid_dropout |
| post_attention_layernorm                               | ln2.input         | ln_2               |
| mlp.gate_proj, mlp.up_proj                             | mlp.fc1_input     | mlp.c_fc           |
| mlp (the gated product's operands), mlp.act_fn         | mlp.act_input     | mlp.act (mlp: nothing) |
| mlp.down_proj                                          | mlp.fc2_input     | mlp.c_proj         |
| -                                                      | mlp.hidden_dropout_mask | mlp.dropout  |

The families differ where the table does not look: Qwen2's q, k and v projections carry biases
(a linear saves its input either way), Mistral's sliding window lives in the attention mask and
the attention function's `sliding_window` argument, GPT-2 has LayerNorm, GELU, biases and
dropout modules. What the attention function itself saves (q, k, v, probabilities, masks, a
fused kernel's output) is told apart by `hf_attention`, not by this table.

Qwen3's `q_norm` / `k_norm` (an RMSNorm over each head, before rotary) save q and k *before*
the norm, with the normalised copy and the per-row statistics: what megatron-core's
qk-layernorm saves, the schema's `attn.q_norm_input` / `attn.k_norm_input`, so they are booked
there. `attn.q` / `attn.k` hold what the attention reads (after the norm and rotary), as in
megatron-core.

A container's own entry books what it saves outside its submodules: llama-style `self_attn`
saves rotary's cos and sin (booked with Q, as megatron-core books them) and `mlp` the gated
product's two operands (the activation's output and up_proj's; `mlp.act_input`, where
megatron-core's gated unit stores its fc1 output). None: it saves nothing of its own.

Other models keep the generic path and say so in one line (`family_of`): a model_type not
here, an MoE family (mixtral, qwen2_moe, qwen3_moe, ...: experts, not a dense MLP), and a
model whose blocks are not the family's decoder layer class (remote code reusing a model_type).
"""
from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

from llm_act.planner.hf_config import UNPLANNABLE
from llm_act.runtime.logs import default_handler
from llm_act.sites import (
    ATTN_DROPOUT_MASK,
    ATTN_HIDDEN_DROPOUT_MASK,
    ATTN_K_NORM_INPUT,
    ATTN_OUT,
    ATTN_Q,
    ATTN_Q_NORM_INPUT,
    ATTN_QKV_INPUT,
    LN1_INPUT,
    LN2_INPUT,
    MLP_ACT_INPUT,
    MLP_FC1_INPUT,
    MLP_FC2_INPUT,
    MLP_HIDDEN_DROPOUT_MASK,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderFamily:
    """One family's decoder layer, as the generic door books it."""

    block: str
    """the decoder layer class, "module:Class" (its blocks must be instances)"""
    attention: str
    """the path (in the block) of the attention module, whose forward calls the attention interface"""
    sites: Mapping[str, Optional[str]]
    """block submodule path -> the site of what that submodule saves itself (None: nothing)"""
    bypass: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """config flag -> the attn_implementation under which, when the flag is true, the layer
    computes its attention outside the interface (refused: q, k and v could not be told apart)"""

    def block_class(self) -> type:
        module, name = self.block.split(":")
        return vars(importlib.import_module(module))[name]


_LLAMA_STYLE: Mapping[str, Optional[str]] = MappingProxyType({
    "input_layernorm": LN1_INPUT,
    "self_attn": ATTN_Q,
    "self_attn.q_proj": ATTN_QKV_INPUT,
    "self_attn.k_proj": ATTN_QKV_INPUT,
    "self_attn.v_proj": ATTN_QKV_INPUT,
    "self_attn.o_proj": ATTN_OUT,
    "post_attention_layernorm": LN2_INPUT,
    "mlp": MLP_ACT_INPUT,
    "mlp.gate_proj": MLP_FC1_INPUT,
    "mlp.up_proj": MLP_FC1_INPUT,
    "mlp.act_fn": MLP_ACT_INPUT,
    "mlp.down_proj": MLP_FC2_INPUT,
})


def _llama_style(module: str, layer: str, **more: str) -> DecoderFamily:
    return DecoderFamily(f"transformers.models.{module}.modeling_{module}:{layer}", "self_attn",
                         MappingProxyType({**_LLAMA_STYLE, **more}))


#: model_type -> its decoder layer's table
FAMILIES: Mapping[str, DecoderFamily] = MappingProxyType({
    "gpt2": DecoderFamily(
        "transformers.models.gpt2.modeling_gpt2:GPT2Block", "attn",
        MappingProxyType({
            "ln_1": LN1_INPUT,
            "attn": None,
            "attn.c_attn": ATTN_QKV_INPUT,
            "attn.c_proj": ATTN_OUT,
            "attn.attn_dropout": ATTN_DROPOUT_MASK,
            "attn.resid_dropout": ATTN_HIDDEN_DROPOUT_MASK,
            "ln_2": LN2_INPUT,
            "mlp": None,
            "mlp.c_fc": MLP_FC1_INPUT,
            "mlp.act": MLP_ACT_INPUT,
            "mlp.c_proj": MLP_FC2_INPUT,
            "mlp.dropout": MLP_HIDDEN_DROPOUT_MASK,
        }),
        # GPT2Attention._upcast_and_reordered_attn: its own eager attention, not the interface
        bypass=MappingProxyType({"reorder_and_upcast_attn": "eager"})),
    "llama": _llama_style("llama", "LlamaDecoderLayer"),
    "mistral": _llama_style("mistral", "MistralDecoderLayer"),
    "qwen2": _llama_style("qwen2", "Qwen2DecoderLayer"),
    "qwen3": _llama_style("qwen3", "Qwen3DecoderLayer", **{"self_attn.q_norm": ATTN_Q_NORM_INPUT,
                                                           "self_attn.k_norm": ATTN_K_NORM_INPUT}),
})

#: config keys that make a model a mixture of experts (the planner refuses the same ones)
MOE_KEYS: tuple[str, ...] = tuple(k for k, why in UNPLANNABLE.items()
                                 if why == UNPLANNABLE["num_experts"])

#: what the generic path does with a model these tables do not cover, for the one line
_GENERIC = ("it keeps the generic path: sites guessed from submodule names, everything its "
            "attention saves booked at attn.q")


def hf_model(model: torch.nn.Module) -> Any:
    """The transformers `PreTrainedModel` in `model` (itself, or the first one it holds: a PEFT
    or other wrapper), or None. transformers is not imported for it: a model built with it
    has imported it already."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def family_of(hf: Any, block: torch.nn.Module) -> Optional[DecoderFamily]:
    """The family whose table books the blocks (`block`: one of them) of `hf` (`hf_model`'s
    answer), or None: then the model keeps the generic path, and a Hugging Face model says so
    in one info line naming its class (rank 0's, as the controller's plan lines)."""
    if hf is None:
        return None
    name, kind = type(hf).__name__, hf.config.model_type
    family = FAMILIES.get(kind)
    if family is not None and isinstance(block, family.block_class()):
        return family
    config = hf.config.to_dict()
    if any(config.get(k) for k in MOE_KEYS):
        why = f"{name} (model_type {kind!r}) is a mixture of experts, which has no site table"
    elif family is None:
        why = f"{name} (model_type {kind!r}) has no site table (those: {', '.join(FAMILIES)})"
    else:
        why = (f"{name}'s blocks are {type(block).__name__}, not {family.block.split(':')[1]} "
               f"of model_type {kind!r}")
    default_handler()  # printed where no logging is set up, as the controller's plan is
    log.info("llm_act: %s; %s", why, _GENERIC)
    return None


__all__ = ["DecoderFamily", "FAMILIES", "MOE_KEYS", "family_of", "hf_model"]
