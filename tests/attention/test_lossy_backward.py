"""Lossy Q/K/V: the backward-only path ("stored": out and logsumexp from the forward) against
the recompute path and against autograd of the float64 reference with the same masks.

- with nothing lost (a lossy-flagged exact codec), "stored" gives the recompute path's
  output and gradients to float tolerance, chunked (dropout on and off, causal or not,
  GQA) and SDPA, and both match autograd of the reference attention with the forward's
  keep-mask; a shifted logsumexp or a backward that drops the mask fails that check;
- the logsumexp is booked at its own site `attn.lse` (4 bytes per (b, head, s)); the path
  stores no s x s tensor; with `out_source` it stores no output and reads the consumer's;
- with real codecs, "stored" is worse than "recompute" (the measured reason the default is
  "recompute"), and "auto" runs "recompute".
"""
import numpy as np
import pytest
import torch

import llm_act.attention.core as core_mod
from llm_act.attention import (DEFAULT_LOSSY_BACKWARD, OutSource, attention, chunk_dropout_mask,
                               resolve_lossy_backward)
from llm_act.attention import fused
from llm_act.codecs.registry import make_codec
from tests.attention.exact_codec import ExactLossy
from tests.attention.test_attention import grads, make_qkv, reference, saved_stats
from tests.rel_error import rel_error

QKV = ("attn.q", "attn.k", "attn.v")
CASES = [("chunked", 0.0, True, 2), ("chunked", 0.25, True, 2), ("chunked", 0.25, False, 1),
         ("chunked", 0.25, True, 4), ("sdpa", 0.0, True, 2), ("sdpa", 0.0, False, 4)]


def run(q, k, v, backend, p, causal, mode, codecs=None, **kw):
    codecs = {s: ExactLossy() for s in QKV} if codecs is None else codecs
    return attention(q, k, v, causal, p, backend=backend, codecs=codecs, chunk_size=(8, 5),
                     generator=torch.Generator().manual_seed(9), lossy_backward=mode, **kw)


def reference_grads(q, k, v, p, causal, dout):
    """(out, dq, dk, dv) of the float64 reference with the keep-mask the forward draws."""
    b, h, s = q.shape[1], q.shape[2], q.shape[0]
    keep = (chunk_dropout_mask(b, h, s, k.shape[0], p, torch.Generator().manual_seed(9),
                               like_dtype=q.dtype) if p > 0 else None)
    ref = reference(q, k, v, causal, p, keep)
    return (ref, *grads(ref, (q, k, v), dout))


def assert_matches_reference(got, want):
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=2e-6)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=5e-6)


@pytest.mark.parametrize("backend,p,causal,groups", CASES)
def test_stored_matches_recompute_and_reference_when_nothing_is_lost(backend, p, causal, groups):
    q, k, v = make_qkv(37, heads=4, groups=groups)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("stored", "recompute"):
        out = run(q, k, v, backend, p, causal, mode)
        results[mode] = (out, *grads(out, (q, k, v), dout))
    for a, b in zip(results["stored"], results["recompute"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert_matches_reference(results["stored"], reference_grads(q, k, v, p, causal, dout))


@pytest.mark.parametrize("backend,p", [("chunked", 0.25), ("sdpa", 0.0)])
def test_reference_check_fails_with_a_wrong_lse_or_an_ignored_mask(backend, p, monkeypatch):
    """The check above is not vacuous: the stored path's backward with its logsumexp shifted,
    or without the dropout mask, misses the reference."""
    q, k, v = make_qkv(29, heads=4, groups=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    want = reference_grads(q, k, v, p, True, dout)
    name = "chunked_backward" if backend == "chunked" else "fused_backward"
    real = getattr(core_mod, name)
    lse_at = 4 if backend == "chunked" else 6  # the logsumexp's position in the call
    breaks = [lambda a: a[:lse_at] + (a[lse_at] + 0.2,) + a[lse_at + 1:]]
    if p > 0:
        breaks.append(lambda a: a[:9] + (None,) + a[10:])  # chunked_backward's keep-mask
    for broken in breaks:
        monkeypatch.setattr(core_mod, name, lambda *a, broken=broken: real(*broken(a)))
        out = run(q, k, v, backend, p, True, "stored")
        got = (out, *grads(out, (q, k, v), dout))
        with pytest.raises(AssertionError):
            assert_matches_reference(got, want)
    monkeypatch.setattr(core_mod, name, real)
    out = run(q, k, v, backend, p, True, "stored")
    assert_matches_reference((out, *grads(out, (q, k, v), dout)), want)


def test_lse_booked_at_its_own_site():
    s, b, h = 40, 2, 4
    q, k, v = make_qkv(s, b=b, heads=h, groups=2, d=16)
    for backend, p in (("chunked", 0.1), ("sdpa", 0.0)):
        seen = {}
        out = run(q, k, v, backend, p, True, "stored",
                  codecs={s: "int4_channel" for s in QKV},
                  report=lambda site, tensors, n: seen.__setitem__(site, seen.get(site, 0) + n))
        assert seen["attn.lse"] == 4 * b * h * s
        assert seen["attn.out"] == out.numel() * 4  # the output, which its consumer keeps anyway
        assert out.is_contiguous()  # so the consumer's [s, b, hidden] view is that memory
        assert seen["attn.q"] == make_codec("int4_channel").nbytes_for(q.shape, q.dtype)
        assert ("attn.dropout_mask" in seen) == (p > 0)


def test_stored_saves_no_s_by_s_tensor():
    s = 256
    q, k, v = make_qkv(s, heads=2, groups=2, d=16)
    codec = make_codec("int4_channel")
    nbytes, largest, out = saved_stats(lambda: run(q, k, v, "chunked", 0.1, True, "stored",
                                                   codecs={x: codec for x in QKV}))
    codes = sum(codec.nbytes_for(t.shape, t.dtype) for t in (q, k, v))
    assert nbytes <= codes + out.numel() * 4 + 4 * 2 * 2 * s + 5056
    assert largest <= q.numel()


def test_out_source_gives_the_output_or_falls_back_to_recompute():
    """recompute_out with an `OutSource`: no output stored; the consumer's offered copy is
    what backward reads; an offer of other memory, or none, makes backward recompute."""
    q, k, v = make_qkv(33, heads=4, groups=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    codecs = {s: "int4_channel" for s in QKV}
    stored = run(q, k, v, "chunked", 0.2, True, "stored", codecs=codecs)
    want = grads(stored, (q, k, v), dout)
    recomputed = run(q, k, v, "chunked", 0.2, True, "recompute", codecs=codecs)
    want_recompute = grads(recomputed, (q, k, v), dout)
    assert max(rel_error(a, b) for a, b in zip(want, want_recompute)) > 1e-3  # the paths differ

    for offer in ("same", "other", None):
        source = OutSource()
        nbytes, _, out = saved_stats(lambda: run(q, k, v, "chunked", 0.2, True, "stored",
                                                 codecs=codecs, recompute_out=True,
                                                 out_source=source))
        stored_copy = out.detach().clone()
        if offer == "same":
            assert source.offer(out.reshape(33, 2, -1), lambda: stored_copy)
        elif offer == "other":
            assert not source.offer(stored_copy, lambda: stored_copy)
        got = grads(out, (q, k, v), dout)
        expect = want if offer == "same" else want_recompute
        for a, b in zip(got, expect):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert nbytes < 3 * q.numel() * 4 / 2  # encoded q, k, v, lse and the state: no output


def test_out_source_takes_only_the_output_itself_not_its_address():
    """An offer is matched to the output by its storage, not by where it lies: a tensor of
    the same size that the allocator placed where a freed output was is refused."""
    memory = np.zeros(8 * 16, dtype=np.float32)  # outlives the storages made on it
    source = OutSource()
    out = torch.from_numpy(memory).view(8, 16)
    source.expect(out)
    assert source.offer(out.reshape(8, 2, 8), lambda: out)  # the output, as its consumer views it
    del out  # the output's storage is freed
    stranger = torch.from_numpy(memory)  # another storage, same address and size
    assert not source.offer(stranger, lambda: stranger)
    assert not source.offer(torch.zeros(8 * 16), lambda: None)


def test_real_codecs_stored_is_worse_so_auto_recomputes():
    """int4_channel at Q/K/V: "stored" (exact lse and out beside decoded Q/K/V) errs more
    than "recompute" (consistent out and lse); "auto" is "recompute"."""
    q, k, v = make_qkv(64, heads=4, groups=2, d=16)
    with torch.no_grad():  # a peaked attention, as in trained models
        q.mul_(2.0), k.mul_(2.0)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    exact = run(q, k, v, "chunked", 0.0, True, "stored", codecs={})
    want = grads(exact, (q, k, v), dout)
    errs = {}
    for mode in ("stored", "recompute", "auto"):
        out = run(q, k, v, "chunked", 0.0, True, mode, codecs={s: "int4_channel" for s in QKV})
        assert torch.equal(out, exact)  # the forward uses the exact values either way
        errs[mode] = [rel_error(a, b) for a, b in zip(grads(out, (q, k, v), dout), want)]
    assert all(s > r for s, r in zip(errs["stored"], errs["recompute"])), errs
    assert errs["auto"] == errs["recompute"]
    assert DEFAULT_LOSSY_BACKWARD == resolve_lossy_backward("auto") == "recompute"
    with pytest.raises(ValueError, match="lossy_backward"):
        attention(q, k, v, lossy_backward="never")


def test_sdpa_with_dropout_on_cpu_recomputes():
    """No CPU kernel returns SDPA's logsumexp with dropout: "stored" falls back to recompute
    (same result as asking for it)."""
    q, k, v = make_qkv(20)
    dout = torch.randn(q.shape)
    outs = [run(q, k, v, "sdpa", 0.2, True, mode) for mode in ("stored", "recompute")]
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads(outs[0], (q, k, v), dout), grads(outs[1], (q, k, v), dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("groups", [4, 2])
def test_cuda_kernel_calls_are_well_formed_on_meta_tensors(groups):
    """The CUDA pair (efficient attention) cannot run here: its argument plumbing and the
    GQA reduction are checked on meta tensors (torch's shape functions)."""
    s, b, h, d = 37, 2, 4, 16
    q = torch.empty(s, b, h, d, device="meta", dtype=torch.bfloat16)
    k = torch.empty(s, b, groups, d, device="meta", dtype=torch.bfloat16)
    out, lse, rng = fused.fused_forward(fused.CUDA_EFFICIENT, q, k, k, True, 0.1, 0.25)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape[:2] == (b, h)
    assert len(rng) == 2
    dq, dk, dv = fused.fused_backward(fused.CUDA_EFFICIENT, out, q, k, k, out, lse, rng, True,
                                      0.1, 0.25)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert fused.fused_kind(q, k, k, True, 0.1) is None  # meta: no kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("groups,p", [(4, 0.0), (2, 0.0), (2, 0.2)])
def test_cuda_stored_matches_autograd_of_the_same_kernel(groups, p):
    """On CUDA: the stored path's backward (efficient-attention backward from the stored
    out, lse, philox seed/offset) equals autograd through the same kernel and mask."""
    s, b, h, d = 96, 2, 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, b, n, d, device="cuda", generator=gen).requires_grad_()
               for n in (h, groups, groups))
    dout = torch.randn(q.shape, device="cuda", generator=gen)
    assert fused.fused_kind(q, k, v, True, p) == fused.CUDA_EFFICIENT
    codecs = {x: ExactLossy() for x in QKV}
    out = attention(q, k, v, True, p, backend="sdpa", codecs=codecs, lossy_backward="stored",
                    generator=torch.Generator(device="cuda").manual_seed(3))
    got = grads(out, (q, k, v), dout)
    r = h // groups
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with core_mod.generator_as_default(torch.Generator(device="cuda").manual_seed(3), "cuda"):
        ref = torch.ops.aten._scaled_dot_product_efficient_attention(
            leaves[0].permute(1, 2, 0, 3), leaves[1].repeat_interleave(r, 2).permute(1, 2, 0, 3),
            leaves[2].repeat_interleave(r, 2).permute(1, 2, 0, 3), None, True, p, True,
            scale=d ** -0.5)[0].permute(2, 0, 1, 3)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b_ in zip(got, grads(ref, leaves, dout)):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
