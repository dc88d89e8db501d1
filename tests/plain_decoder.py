"""A plain torch pre-norm decoder block (no megatron-core) for the generic-path tests.

LayerNorm -> QKV -> causal SDPA (`is_causal=True`, no s x s mask) -> projection ->
residual, then LayerNorm -> fc1 -> GELU -> fc2 -> residual: what a Hugging Face-style
decoder layer saves for backward, in a few lines.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PreNormBlock(nn.Module):
    def __init__(self, hidden: int = 64, heads: int = 4, ffn_mult: int = 4):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_mult * hidden)
        self.fc2 = nn.Linear(ffn_mult * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def make_blocks(n: int = 1, hidden: int = 64, heads: int = 4, seed: int = 0) -> nn.ModuleList:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    blocks = nn.ModuleList(PreNormBlock(hidden, heads) for _ in range(n))
    torch.random.set_rng_state(gen_state)
    return blocks
