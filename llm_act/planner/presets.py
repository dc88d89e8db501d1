"""Named model shapes (published GPT, Llama and MoE configurations) that `llm-act plan`
and the benches size on paper. They are data, not part of the analytic model: adding a
preset touches only this file. `model_shape(name, **changes)` overrides fields such as
seq_length or tp.
"""
from __future__ import annotations

from llm_act.planner.model_shape import ModelShape


def _gpt(layers, h, heads, seq=2048, **kw) -> ModelShape:
    """GPT-2/3 style (Megatron's GPT defaults): GELU, LayerNorm, biases, learned positions,
    tied embeddings, GPT-2 vocabulary, dropout 0.1."""
    return ModelShape(layers, h, heads, seq, 1, vocab_size=50257, dropout=0.1, **kw)


def _llama(layers, h, heads, groups, ffn) -> ModelShape:
    """Llama 3: SwiGLU, RMSNorm, GQA, no biases, rotary positions, untied embeddings."""
    return ModelShape(layers, h, heads, 8192, 1, ffn_hidden_size=ffn, num_query_groups=groups,
                      vocab_size=128256, gated_linear_unit=True, activation="silu", bias=False,
                      normalization="RMSNorm", position_embedding="rope", tie_embeddings=False)


def _mixtral_8x7b() -> ModelShape:
    """Mixtral 8x7B: Llama-style attention (GQA 32/8), 8 SwiGLU experts of 14336, top-2."""
    return ModelShape(32, 4096, 32, 32768, 1, ffn_hidden_size=14336, num_query_groups=8,
                      vocab_size=32000, gated_linear_unit=True, activation="silu", bias=False,
                      normalization="RMSNorm", position_embedding="rope", tie_embeddings=False,
                      num_experts=8, moe_topk=2)


def _deepseek_v3_like() -> ModelShape:
    """DeepSeek-V3's MoE layers (58 of its 61: the first 3 dense ones left out; hidden 7168,
    256 routed SwiGLU experts of 2048, top-8, 4k pre-training sequences) with standard
    multi-head attention in place of MLA and no shared expert (llm_act refuses both)."""
    return ModelShape(58, 7168, 128, 4096, 1, ffn_hidden_size=18432, vocab_size=129280,
                      gated_linear_unit=True, activation="silu", bias=False, normalization="RMSNorm",
                      position_embedding="rope", tie_embeddings=False, num_experts=256, moe_topk=8,
                      moe_ffn_hidden_size=2048)


#: Published shapes (seq_length = the model's context, micro_batch_size 1; override with `with_`).
MODELS: dict[str, ModelShape] = {
    "gpt2-medium": _gpt(24, 1024, 16, seq=1024),
    "gpt-1.3b": _gpt(24, 2048, 16),
    "gpt-7b": _gpt(32, 4096, 32),
    "gpt-13b": _gpt(40, 5120, 40),
    "gpt-175b": _gpt(96, 12288, 96),
    "llama-8b": _llama(32, 4096, 32, 8, 14336),
    "llama-70b": _llama(80, 8192, 64, 8, 28672),
    "mixtral-8x7b": _mixtral_8x7b(),
    "deepseek-v3-like": _deepseek_v3_like(),
}


def model_shape(name: str, **changes) -> ModelShape:
    """The preset `name` with fields replaced (e.g. seq_length=4096, tp=8)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name].with_(**changes)
