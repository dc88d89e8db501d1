"""Core attention without s x s activations: torch SDPA, our chunked (flash-style) path for
attention dropout, compressed Q/K/V with recomputation, and the unfused path kept for
compressing the stored softmax. Framework-independent; `patches.megatron` wraps it.

Layout: q [s, b, heads, d], k and v [s_k, b, groups, d] (megatron's, after rotary; GQA
K/V un-expanded).
"""
from llm_act.attention.chunked import chunk_dropout_mask, chunked_attention
from llm_act.attention.core import BACKENDS, attention, pick_backend
from llm_act.attention.sdpa import sdpa_attention
from llm_act.attention.unfused import unfused_attention

__all__ = ["BACKENDS", "attention", "chunk_dropout_mask", "chunked_attention", "pick_backend",
           "sdpa_attention", "unfused_attention"]
