"""Converted layers under tensor parallelism (TP=2, two gloo processes on CPU).

With every site kept, and with bitmask/regen at the hidden-dropout sites, a converted
TP=2 layer gives outputs and gradients bit-identical to the stock TP=2 layer on every
rank (dropout on). With int8 at every linear/norm site the column linears all-reduce the
input gradient and the rows take split inputs: gradients stay within `TOL` = 3% (relative
L2) of stock, which int8's predicted error (~1e-2 of a tensor's range per element, spread
over 64-row reductions) keeps far below, and which a codec decoding zeros at one site fails.
"""
from __future__ import annotations

import pytest
import torch

from tests import testing

S, B, H = 16, 2, 64
#: relative error bound per gradient with int8 at every linear/norm site. Measured: the real
#: codec 0.0104 (largest, both ranks); zeros decoded at ln1.input 1.002, at mlp.fc2_input 1.000.
TOL = 0.03


def _errors(ref, got):
    """Relative L2 error of every gradient of `got` against `ref` (layer_step results)."""
    return [float((a - b).norm() / a.norm().clamp(min=1e-30)) for a, b in zip(ref[1], got[1])]


def _worker(rank, world_size, port):
    import warnings

    warnings.filterwarnings("ignore")
    from llm_act.codecs import make_codec
    from tests.patches import broken_codec
    from tests.patches.megatron.layer_pairs import twin_layers
    from tests.patches.megatron.test_layers import assert_identical, layer_step

    testing.init_parallel(tp=2, rank=rank, world_size=world_size, port=port)
    for dtype in (torch.float32, torch.bfloat16):
        cfg = testing.small_config(hidden_size=H, num_attention_heads=4, num_layers=1,
                                   dropout=0.1, dtype=torch.float32)
        torch.manual_seed(0)  # same input on both ranks
        x = torch.randn(S, B, H, dtype=dtype)
        stock, act, sites = twin_layers(cfg, dtype)
        ref = layer_step(stock, x)
        assert_identical(ref, layer_step(act, x))
        for name in ("bitmask", "regen"):
            for s in ("attn.hidden_dropout_mask", "mlp.hidden_dropout_mask"):
                sites[s].set_act_codec(s, make_codec(name))
            assert_identical(ref, layer_step(act, x))
        if dtype is torch.float32:
            codec = make_codec("int8")
            for s in ("ln1.input", "attn.qkv_input", "attn.out", "ln2.input", "mlp.fc1_input", "mlp.fc2_input"):
                sites[s].set_act_codec(s, codec)
            got = layer_step(act, x)
            for i, err in enumerate(_errors(ref, got)):
                assert err < TOL, f"rank {rank} gradient {i}: relative error {err:.3g}"
            assert torch.equal(ref[2], got[2])
            # the bound is not loose: zeros decoded at one site break it
            for s in ("ln1.input", "mlp.fc2_input"):
                sites[s].set_act_codec(s, broken_codec.break_codec(make_codec("int8")))
                assert max(_errors(ref, layer_step(act, x))) >= TOL, s
                sites[s].set_act_codec(s, codec)


@pytest.mark.dist
def test_tp2_converted_layers_match_stock():
    testing.spawn(_worker, 2, timeout=150)
