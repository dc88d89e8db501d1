"""Core attention without s x s activations: torch SDPA, our chunked (flash-style) path for
attention dropout, compressed Q/K/V (backpropagated from the stored output and logsumexp,
or recomputed), and the unfused path kept for compressing the stored softmax.
Framework-independent; `patches.megatron` wraps it.

Layout: q [s, b, heads, d], k and v [s_k, b, groups, d] (megatron's, after rotary; GQA
K/V un-expanded).
"""
from llm_act.attention.chunked import chunk_dropout_mask, chunked_attention
from llm_act.attention.core import (BACKENDS, DEFAULT_LOSSY_BACKWARD, LOSSY_BACKWARDS, OutSource,
                                    attention, pick_backend, resolve_lossy_backward)
from llm_act.attention.sdpa import sdpa_attention
from llm_act.attention.unfused import unfused_attention

__all__ = ["BACKENDS", "DEFAULT_LOSSY_BACKWARD", "LOSSY_BACKWARDS", "OutSource", "attention",
           "chunk_dropout_mask", "chunked_attention", "pick_backend", "resolve_lossy_backward",
           "sdpa_attention", "unfused_attention"]
