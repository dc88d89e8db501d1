"""Broken-codec companions of the attention tests (`tests.patches.broken_codec`): the bounds of
tests/attention/test_attention.py fail with codecs decoding zeros, and stochastic codecs at
Q, K, V are unbiased through the attention backward -- which stochastic rounding that always
rounds down fails. (The shipped plans store Q, K, V with int4_channel and the probabilities
with int4_asym, both nearest rounding: "round_down" does not apply to them; "auto" may pick a
stochastic codec there.)"""
from __future__ import annotations

import math

import pytest
import torch

from llm_act.attention import attention
from llm_act.codecs import make_codec
from tests.attention import test_attention as A
from tests.rel_error import rel_error
from tests.patches import broken_codec

#: draws averaged, and the bound on sqrt(K) * err(mean gradient) / mean single err (1 for
#: unbiased noise). Measured at Q, K, V (chunked and sdpa alike): int8 0.93-0.99, int4
#: 1.02-1.09, int2 1.32-1.56; always rounding down sqrt(32) = 5.66 (each draw the same).
#: Bound: 3x the tested codecs' (int4, int8) worst.
DRAWS, BOUND = 32, 3.5


@pytest.mark.parametrize("unit_test", [
    lambda: A.test_compressed_qkv_recomputes_from_decoded_values("chunked", 0.1),
    lambda: A.test_compressed_qkv_recomputes_from_decoded_values("sdpa", 0.0),
    A.test_unfused_matches_reference_and_int4_asym_softmax_within_bound,
], ids=["qkv-chunked", "qkv-sdpa", "unfused-softmax"])
def test_attention_bounds_fail_with_codecs_decoding_zeros(unit_test):
    with broken_codec.everywhere(broken_codec.ZEROS), pytest.raises(AssertionError):
        unit_test()


def unbiased_ratios(backend, codec_name, kind=None):
    """sqrt(K) * err(mean of K gradients) / mean single err for dq, dk, dv, with `codec_name`
    (stochastic) storing Q, K, V."""
    q, k, v = A.make_qkv(32, heads=4, groups=2, d=16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    exact = A.grads(attention(q, k, v, True, 0.0, backend=backend, chunk_size=16), (q, k, v), dout)
    codecs = {site: make_codec(codec_name, seed=i) for i, site in enumerate(A.QKV)}
    if kind:
        for c in codecs.values():
            broken_codec.break_codec(c, kind)
    draws = [A.grads(attention(q, k, v, True, 0.0, backend=backend, chunk_size=16, codecs=codecs),
                     (q, k, v), dout) for _ in range(DRAWS)]
    out = []
    for i, ref in enumerate(exact):
        single = sum(rel_error(d[i], ref) for d in draws) / DRAWS
        mean = sum(d[i].double() for d in draws) / DRAWS
        out.append(math.sqrt(DRAWS) * rel_error(mean, ref.double()) / single)
    return out


def check_unbiased(ratios):
    for name, r in zip(("dq", "dk", "dv"), ratios):
        assert r <= BOUND, f"{name}: the mean of {DRAWS} draws is biased ({r:.2f} > {BOUND})"


@pytest.mark.parametrize("backend,codec_name", [("chunked", "int4"), ("sdpa", "int8")])
def test_stochastic_qkv_codecs_are_unbiased(backend, codec_name):
    check_unbiased(unbiased_ratios(backend, codec_name))


@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_unbiasedness_fails_with_biased_rounding(backend):
    with pytest.raises(AssertionError, match="biased"):
        check_unbiased(unbiased_ratios(backend, "int4", broken_codec.ROUND_DOWN))
