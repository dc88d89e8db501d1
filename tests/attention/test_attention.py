"""The attention paths against a float64 math reference, their dropout masks, and what they save."""
import math

import pytest
import torch

from llm_act.attention import (attention, chunk_dropout_mask, chunked_attention, pick_backend,
                               sdpa_attention, unfused_attention)
from llm_act.codecs.registry import make_codec
from tests.rel_error import rel_error

QKV = ("attn.q", "attn.k", "attn.v")


def make_qkv(s, b=2, heads=4, groups=2, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(s, b, groups, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(s, b, groups, d, generator=g).to(dtype).requires_grad_()
    return q, k, v


def reference(q, k, v, causal, p=0.0, keep=None):
    """Math attention in float64 with expanded K/V and an explicit mask (the spec)."""
    s, _, h, d = q.shape
    r = h // k.shape[2]
    qq = q.double().permute(1, 2, 0, 3)
    kk = k.double().repeat_interleave(r, 2).permute(1, 2, 0, 3)
    vv = v.double().repeat_interleave(r, 2).permute(1, 2, 0, 3)
    scores = qq @ kk.transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, k.shape[0], dtype=torch.bool).triu(1), -math.inf)
    probs = scores.softmax(-1)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return (probs @ vv).permute(2, 0, 1, 3)


def _causal_probs(q, k):
    """The softmax probabilities [b, heads, s, s] the unfused path stores (float32)."""
    s, _, h, d = q.shape
    qq = q.detach().permute(1, 2, 0, 3)
    kk = k.detach().repeat_interleave(h // k.shape[2], 2).permute(1, 2, 0, 3)
    scores = (qq @ kk.transpose(-1, -2) / math.sqrt(d))
    return scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf).softmax(-1)


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout.to(out.dtype))


def saved_stats(fn):
    """(bytes of distinct saved storages, numel of the largest saved tensor, output)."""
    storages, largest = {}, [0]

    def pack(t):
        st = t.untyped_storage()
        storages[id(st)] = (st.nbytes(), st)
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(n for n, _ in storages.values()), largest[0], out


# ---- exactness of the chunked path -----------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("s,chunk", [(37, (5, 7)), (16, 16), (9, 4)])
def test_chunked_matches_float64_reference(causal, groups, s, chunk):
    q, k, v = make_qkv(s, heads=4, groups=groups)
    out = chunked_attention(q, k, v, causal, chunk_size=chunk)
    ref = reference(q, k, v, causal)
    dout = torch.randn(ref.shape, dtype=torch.float64)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    for got, want in zip(grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=5e-6)


def test_chunked_bf16_close_to_reference():
    q, k, v = make_qkv(33, dtype=torch.bfloat16)
    out = chunked_attention(q, k, v, True, chunk_size=8)
    ref = reference(q, k, v, True)
    dout = torch.randn(ref.shape, dtype=torch.float64)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, ref) < 1e-2
    for got, want in zip(grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout)):
        assert got.dtype == torch.bfloat16 and rel_error(got, want) < 2e-2


# ---- dropout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_chunked_dropout_reproduces_math_path_with_same_masks(causal):
    q, k, v = make_qkv(29, groups=2)
    p, chunk = 0.3, (6, 8)
    rng_before = torch.get_rng_state()
    out = chunked_attention(q, k, v, causal, p, generator=torch.Generator().manual_seed(7),
                            chunk_size=chunk)
    dq, dk, dv = grads(out, (q, k, v), torch.ones(out.shape))
    assert torch.equal(torch.get_rng_state(), rng_before), "the global RNG was consumed"
    keep = chunk_dropout_mask(2, 4, 29, 29, p, torch.Generator().manual_seed(7), like_dtype=q.dtype)
    assert 0.6 < keep.float().mean() < 0.8
    ref = reference(q, k, v, causal, p, keep)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    for got, want in zip((dq, dk, dv), grads(ref, (q, k, v), torch.ones(ref.shape))):
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=5e-6)
    # a different generator seed gives a different mask (the masks are really used)
    other = chunked_attention(q, k, v, causal, p, generator=torch.Generator().manual_seed(8),
                              chunk_size=chunk)
    assert not torch.allclose(other, out)


def test_regenerated_mask_backward_bit_identical_to_stored_mask():
    q, k, v = make_qkv(31, groups=1)
    dout = torch.randn(q.shape)
    results = []
    for storage in ("regen", "bitmask"):
        gen = torch.Generator().manual_seed(11)
        out = chunked_attention(q, k, v, True, 0.2, generator=gen, chunk_size=(8, 5),
                                mask_storage=storage)
        results.append((out, *grads(out, (q, k, v), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_default_generator_drives_dropout_without_one():
    q, k, v = make_qkv(12)
    torch.manual_seed(3)
    a = chunked_attention(q, k, v, True, 0.5, chunk_size=4)
    ga = grads(a, (q, k, v), torch.ones(a.shape))
    torch.manual_seed(3)
    b = chunked_attention(q, k, v, True, 0.5, chunk_size=4)
    gb = grads(b, (q, k, v), torch.ones(b.shape))
    torch.manual_seed(3)
    keep = chunk_dropout_mask(2, 4, 12, 12, 0.5, None, like_dtype=q.dtype)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    torch.testing.assert_close(a.double(), reference(q, k, v, True, 0.5, keep), rtol=0, atol=2e-6)


def test_sdpa_with_generator_leaves_global_rng_untouched():
    q, k, v = make_qkv(10)
    before = torch.get_rng_state()
    a = sdpa_attention(q, k, v, True, 0.3, generator=torch.Generator().manual_seed(1))
    b = sdpa_attention(q, k, v, True, 0.3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, b)
    torch.testing.assert_close(sdpa_attention(q, k, v, True).double(), reference(q, k, v, True),
                               rtol=0, atol=2e-6)


# ---- what is saved -----------------------------------------------------------------------------

def _per_sbh(fn, s, b=2, hidden=512, heads=8, dtype=torch.float32):
    q, k, v = make_qkv(s, b, heads, heads, hidden // heads, dtype)
    nbytes, largest, _ = saved_stats(lambda: fn(q, k, v))
    return nbytes / (s * b * hidden), largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_saved_bytes_do_not_grow_with_s(dtype):
    run = lambda q, k, v: chunked_attention(  # noqa: E731
        q, k, v, True, 0.1, generator=torch.Generator().manual_seed(0))
    small, _ = _per_sbh(run, 128, dtype=dtype)
    large, largest = _per_sbh(run, 1024, dtype=dtype)
    elt = torch.finfo(dtype).bits // 8
    assert large <= small
    # q, k, v, out in the model dtype + float32 logsumexp (4 bytes per head = 4 * 8 / 512)
    assert large == pytest.approx(4 * elt + 4 * 8 / 512, abs=0.01)
    assert largest <= 1024 * 2 * 512  # O(s * d): no s x s tensor


def test_sdpa_saves_no_s_by_s_tensor_on_cpu_without_dropout():
    small, _ = _per_sbh(lambda q, k, v: sdpa_attention(q, k, v, True), 128)
    large, largest = _per_sbh(lambda q, k, v: sdpa_attention(q, k, v, True), 1024)
    assert large <= small + 1e-9
    assert largest <= 1024 * 2 * 512


def test_gqa_saves_unexpanded_kv():
    q, k, v = make_qkv(64, heads=8, groups=2, d=16)
    qbytes = q.numel() * 4
    for fn in (lambda: chunked_attention(q, k, v, True, 0.1, generator=torch.Generator()),
               lambda: sdpa_attention(q, k, v, True)):
        nbytes, _, _ = saved_stats(fn)
        # q + out + k + v (a quarter of q each) + logsumexp + (chunked) a CPU generator state
        assert nbytes <= 2.5 * qbytes + 2 * 8 * 64 * 4 + 5056


# ---- compressed Q, K, V ------------------------------------------------------------------------

def _predicted_rel_error(x, codec):
    """Relative rms error of decode(encode(x)) predicted by the codec's error model."""
    return math.sqrt(codec.expected_error(x.detach()) / float(x.detach().double().pow(2).mean()))


@pytest.mark.parametrize("backend,p", [("chunked", 0.1), ("sdpa", 0.0)])
def test_compressed_qkv_recomputes_from_decoded_values(backend, p):
    q, k, v = make_qkv(40, heads=4, groups=2, d=16)
    dout = torch.randn(q.shape)
    codecs = {site: make_codec("int4_channel") for site in QKV}

    def run(codecs):
        gen = torch.Generator().manual_seed(5)
        return attention(q, k, v, True, p, backend=backend, generator=gen, codecs=codecs,
                         chunk_size=16)

    exact = run(None)
    nbytes, largest, out = saved_stats(lambda: run(codecs))
    assert torch.equal(out, exact)  # the forward itself uses the exact values
    codes = sum(make_codec("int4_channel").nbytes_for(t.shape, t.dtype) for t in (q, k, v))
    assert nbytes <= codes + 5056  # encoded q, k, v (+ the dropout generator state), no out
    got = grads(out, (q, k, v), dout)
    want = grads(exact, (q, k, v), dout)
    # consistency: exactly the gradient of the same attention evaluated at the decoded q, k, v
    dec = [make_codec("int4_channel").roundtrip(t.detach()).requires_grad_() for t in (q, k, v)]
    at_dec = attention(*dec, True, p, backend=backend, generator=torch.Generator().manual_seed(5),
                       chunk_size=16)
    for a, b in zip(got, grads(at_dec, dec, dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # bound: relative gradient error <= the sum of the predicted relative input errors
    bound = sum(_predicted_rel_error(t, make_codec("int4_channel")) for t in (q, k, v))
    errs = [rel_error(a, b) for a, b in zip(got, want)]
    assert 0.02 < max(errs) and max(errs) <= bound, (errs, bound)


def test_compressed_qkv_nan_in_q_gives_nan_grads():
    q, k, v = make_qkv(16, heads=4, groups=2, d=8)
    with torch.no_grad():
        q[3, 1, 2, 5] = float("nan")
    out = attention(q, k, v, True, 0.0, backend="chunked", chunk_size=8,
                    codecs={site: "int4_channel" for site in QKV})
    dq, dk, dv = grads(out, (q, k, v), torch.ones(out.shape))
    assert torch.isnan(dq[3, 1, 2]).all() and torch.isnan(dk[:4, 1, 1]).all()
    assert torch.isnan(dv[:4, 1, 1]).all()
    assert torch.isfinite(dq[:, 0]).all() and torch.isfinite(dk[:, 0]).all()


# ---- the unfused path --------------------------------------------------------------------------

def test_unfused_matches_reference_and_int4_asym_softmax_within_bound():
    q, k, v = make_qkv(48, heads=4, groups=2, d=16)
    dout = torch.randn(q.shape)
    ref = reference(q, k, v, True)
    want = grads(ref, (q, k, v), dout)
    out = unfused_attention(q, k, v, True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    for a, b in zip(grads(out, (q, k, v), dout), want):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=5e-6)
    nbytes, largest, out = saved_stats(
        lambda: unfused_attention(q, k, v, True, softmax_codec=make_codec("int4_asym")))
    assert nbytes < 3 * q.numel() * 4 + 2 * 4 * 48 * 48  # int4 probabilities, not float32
    # bound: each gradient's relative error <= the relative rms error of the stored
    # probabilities predicted by the codec's error model (measured: about half of it)
    weights = _causal_probs(q, k)
    codec = make_codec("int4_asym")
    bound = math.sqrt(codec.expected_error(weights) / float(weights.pow(2).mean()))
    errs = [rel_error(a, b) for a, b in zip(grads(out, (q, k, v), dout), want)]
    assert 0.01 < max(errs) <= bound, (errs, bound)


def test_unfused_masks_bitmask_and_regen_bit_identical_to_stored_mask():
    q, k, v = make_qkv(20, heads=4, groups=4)
    dout = torch.randn(q.shape)
    results, sizes = [], []
    for codec in (None, make_codec("bitmask"), make_codec("regen")):
        gen = torch.Generator().manual_seed(2)
        nbytes, _, out = saved_stats(lambda: unfused_attention(q, k, v, True, 0.25, mask_codec=codec,
                                                               generator=gen))
        results.append((out, *grads(out, (q, k, v), dout)))
        sizes.append(nbytes)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    # the same stored tensors apart from the mask: bool (1 byte), bitmask (1 bit), regen (state)
    numel = 2 * 4 * 20 * 20
    rest = sizes[0] - numel
    assert sizes[1] - rest == math.ceil(numel / 8)
    assert sizes[2] - rest == torch.Generator().get_state().numel()


# ---- choosing the path, bad arguments ----------------------------------------------------------

def test_pick_backend_and_errors():
    cpu = torch.device("cpu")
    assert pick_backend("auto", 0.0, cpu) == "sdpa"
    assert pick_backend("auto", 0.1, cpu) == "chunked"
    assert pick_backend("auto", 0.1, torch.device("cuda")) == "sdpa"
    q, k, v = make_qkv(8)
    with pytest.raises(ValueError, match="stock"):
        attention(q, k, v, backend="stock")
    with pytest.raises(ValueError, match="dropout_p"):
        chunked_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="multiple"):
        chunked_attention(q, k[:, :, :1].expand(8, 2, 3, 8), v[:, :, :1].expand(8, 2, 3, 8))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="attn.softmax"):
        attention(q, k, v, backend="sdpa", codecs={"attn.softmax": "int4_asym"})
    with pytest.raises(ValueError, match="site"):
        attention(q, k, v, codecs={"mlp.fc1_input": "int4"})


def test_auto_backend_on_cpu_with_dropout_is_memory_efficient():
    q, k, v = make_qkv(256, heads=2, groups=2, d=16)
    _, largest, _ = saved_stats(lambda: attention(q, k, v, True, 0.1, generator=torch.Generator()))
    assert largest <= q.numel()


def test_report_hook_sees_each_site():
    q, k, v = make_qkv(16)
    seen = {}
    attention(q, k, v, True, 0.1, generator=torch.Generator(), backend="chunked",
              codecs={"attn.q": "int4_channel"},
              report=lambda site, tensors, n: seen.__setitem__(site, seen.get(site, 0) + n))
    assert set(seen) == {"attn.q", "attn.k", "attn.v", "attn.dropout_mask"}
    assert seen["attn.q"] == make_codec("int4_channel").nbytes_for(q.shape, q.dtype)
    assert seen["attn.k"] == k.numel() * 4
