"""`hf_attention.AttentionSaves`, the rules that tell what an attention call saves apart, on
attentions written here in plain torch (no transformers): an unfused one with grouped K/V
expanded by copy and dropout, SDPA's fused kernel with grouped K/V, q/k/v as views of one
projection's output, and q/k/v without autograd history."""
from __future__ import annotations

import torch

from llm_act.patches.deepspeed.hf_attention import AttentionSaves
from llm_act.sites import ATTN_DROPOUT_MASK, ATTN_K, ATTN_OUT, ATTN_Q, ATTN_SOFTMAX, ATTN_V

B, H, G, S, D = 2, 4, 2, 8, 16


def _qkv(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, 64, generator=g, requires_grad=requires_grad)
    q = (x[..., :64] * 2).view(B, S, H, D).transpose(1, 2)
    k = (x[..., :32] + 1).view(B, S, G, D).transpose(1, 2)
    v = (x[..., 32:] - 1).view(B, S, G, D).transpose(1, 2)
    return q, k, v


def _sites(attention, q, k, v) -> list[tuple[tuple, str]]:
    """(shape, site) of every tensor `attention(q, k, v)` saves."""
    saves = AttentionSaves(q, k, v)
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), saves.site_of(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(q, k, v)
    return seen


def _unfused(q, k, v, p=0.5):
    k = k[:, :, None].expand(B, G, H // G, S, D).reshape(B, H, S, D)  # copies, as repeat_kv does
    v = v[:, :, None].expand(B, G, H // G, S, D).reshape(B, H, S, D)
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = torch.nn.functional.dropout(probs, p=p, training=True)
    return torch.matmul(probs, v)


def test_unfused_attention_with_expanded_kv_and_dropout():
    seen = _sites(_unfused, *_qkv())
    sites = {site for _, site in seen}
    assert sites == {ATTN_Q, ATTN_K, ATTN_V, ATTN_SOFTMAX, ATTN_DROPOUT_MASK}, seen
    # the probabilities and the mask have the scores' shape; K and V are the expanded copies
    assert all(shape[-1] == S for shape, site in seen if site in (ATTN_SOFTMAX, ATTN_DROPOUT_MASK))


def test_fused_attention_with_grouped_kv():
    def fused(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    seen = _sites(fused, *_qkv())
    assert sorted(site for _, site in seen) == sorted([ATTN_Q, ATTN_K, ATTN_V] + [ATTN_OUT] * (len(seen) - 3))
    assert (( B, G, S, D), ATTN_K) in seen and ((B, G, S, D), ATTN_V) in seen  # un-expanded


def test_views_of_one_projection_are_told_apart():
    """GPT-2's q, k and v: views of one c_attn output (one storage), apart by autograd node."""
    x = torch.randn(B, S, 3 * H * D, requires_grad=True)
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in (x * 1).split(H * D, dim=2))
    saves = AttentionSaves(q, k, v)
    assert [saves.site_of(t) for t in (q, k, v)] == [ATTN_Q, ATTN_K, ATTN_V]
    assert saves.site_of(k.transpose(2, 3).reshape(B * H, D, S)) == ATTN_K


def test_without_autograd_history_by_storage():
    q, k, v = _qkv(requires_grad=False)
    saves = AttentionSaves(q, k, v)
    assert [saves.site_of(t) for t in (q, k, v)] == [ATTN_Q, ATTN_K, ATTN_V]
    assert saves.site_of(torch.zeros(B, H, S, S, dtype=torch.bool)) == ATTN_DROPOUT_MASK
    assert saves.site_of(torch.zeros(B, H, S)) == ATTN_OUT  # a logsumexp
    assert saves.site_of(torch.zeros(B, 1, S, S)) == ATTN_OUT  # the mask it was given
