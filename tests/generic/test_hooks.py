"""GACT's generic path (`llm_act.generic.hooks`) on a plain torch pre-norm decoder block.

Byte figures for the test block (fp32, b=2, s=64, h=64, 4 heads, ffn 256):
stock 528384 B held for backward, of which 524288 B (131072 floats) are encodable
activations and 4096 B are norm statistics and the softmax logsumexp (small / no grad).
IntQuant with 128-element groups stores n*bits/8 + 8*n/128 bytes, so all sizes here
being multiples of 128: int8 -> 8.5 bits (139264 B, 3.765x on the activations, 3.686x
overall), int4 -> 4.5 bits (73728 B, 7.11x / 6.79x).

Gradient bound: stochastic rounding adds per-element noise of variance ~Delta^2/6 with
Delta = range/255 per group of 128, about 0.8% of an activation's rms for int8, and a
weight gradient sums such noise over tokens incoherently, so its relative error is of the
same order: measured 0.3-1.1% per weight for this block; the test bound is 2%, and the
mean over 4 independent encodings must roughly halve the error (the noise is unbiased).
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch

from llm_act.codecs import make_codec
from llm_act.codecs.base import Codec
from llm_act.generic.checkpoint import checkpoint_blocks
from llm_act.generic.hooks import GenericCompression, compress_saved_tensors
from llm_act.ledger import SavedTensorLedger
from tests.plain_decoder import make_blocks
from tests.rel_error import rel_error

SHAPE = (2, 64, 64)


def _run(model, x, context=None, proj=None):
    """Forward under a ledger (and `context`), backward; (ledger, grads incl. x.grad)."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    with SavedTensorLedger() as ledger:
        if context is not None:
            with context:
                y = model(x)
        else:
            y = model(x)
    loss = (y * proj).sum() if proj is not None else (y * y).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if x.grad is not None:
        grads["input"] = x.grad.clone()
    return ledger, grads


@pytest.fixture
def block():
    return make_blocks(1)[0]


@pytest.fixture
def x():
    return torch.randn(*SHAPE, requires_grad=True)


def record_encoded_shapes(monkeypatch) -> list:
    """The shapes every codec encodes from now on, in order (each record's size formula
    depends on its own shape: the non-finite side list has a fixed size per tensor); wraps
    whatever `Codec.encode` is at the call, a sabotaged one included."""
    shapes: list = []
    encode = Codec.encode

    def recording(self, t):
        shapes.append(tuple(t.shape))
        return encode(self, t)

    monkeypatch.setattr(Codec, "encode", recording)
    return shapes


@pytest.fixture
def encoded_shapes(monkeypatch) -> list:
    return record_encoded_shapes(monkeypatch)


@pytest.mark.parametrize("name,min_ratio,bound", [("int8", 3.6, 2e-2), ("int4", 6.5, 0.3)])
def test_bytes_fall_by_the_codec_factor_and_grads_stay_close(block, x, name, min_ratio, bound,
                                                             encoded_shapes):
    stock, g_ref = _run(block, x)
    hooks = compress_saved_tensors(block, name)
    ledger, g = _run(block, x, hooks)
    s = hooks.stats
    codec = make_codec(name)
    # every encodable activation is a multiple of the group size: the sizes add up exactly
    assert s.raw_bytes % (4 * 128) == 0 and s.raw_bytes >= 0.99 * stock.total_bytes
    assert sum(4 * math.prod(shape) for shape in encoded_shapes) == s.raw_bytes
    assert s.encoded_bytes == sum(codec.nbytes_for(shape, torch.float32) for shape in encoded_shapes)
    assert s.by_codec == {name: s.encoded_bytes}
    # the ledger sees the encoded bytes instead of the raw ones, and the rest unchanged
    assert ledger.total_bytes == stock.total_bytes - s.raw_bytes + s.encoded_bytes
    assert ledger.total_bytes == s.encoded_bytes + s.kept_bytes
    assert stock.total_bytes / ledger.total_bytes > min_ratio
    assert s.decoded == s.encoded  # each record decoded once in backward
    for n, ref in g_ref.items():
        if ref.norm() > 0:
            assert rel_error(g[n], ref) < bound, n
    assert torch.equal(g["fc2.bias"], g_ref["fc2.bias"])  # no activation involved


def test_int8_noise_is_unbiased(block, x):
    proj = torch.randn(SHAPE)
    _, g_ref = _run(block, x, proj=proj)
    runs = [_run(block, x, compress_saved_tensors(block, "int8", seed=k), proj)[1]
            for k in range(4)]
    for n in ("qkv.weight", "fc1.weight", "proj.weight"):
        single = sum(rel_error(r[n], g_ref[n]) for r in runs) / len(runs)
        mean = torch.stack([r[n] for r in runs]).mean(0)
        assert single < 2e-2
        assert rel_error(mean, g_ref[n]) < 0.7 * single, n  # ~1/sqrt(4) for unbiased noise


def test_parameters_are_never_encoded_and_codec_chosen_per_tensor(block, x):
    param_ptrs = {p.untyped_storage().data_ptr() for p in block.parameters()}
    asked = []

    def choose(t: torch.Tensor):
        asked.append(t.untyped_storage().data_ptr())
        return "int4" if t.shape[-1] == 256 else "int8"

    hooks = compress_saved_tensors(block, choose)
    ledger, _ = _run(block, x, hooks)
    assert asked and not param_ptrs.intersection(asked)
    assert hooks.stats.parameters >= 4  # the four linear weights at least
    # fc1 output and the GELU output ([2, 64, 256], [128, 256]) in int4, the rest int8
    int4_bytes = make_codec("int4").nbytes_for((2, 64, 256), torch.float32)
    assert hooks.stats.by_codec["int4"] == 2 * int4_bytes
    assert set(hooks.stats.by_codec) == {"int4", "int8"}
    assert ledger.total_bytes == hooks.stats.encoded_bytes + hooks.stats.kept_bytes


def test_module_none_still_recognises_parameters(block, x):
    hooks = compress_saved_tensors(None, "int8")
    _run(block, x, hooks)
    with_module = compress_saved_tensors(block, "int8")
    _run(block, x, with_module)
    assert hooks.stats.parameters == with_module.stats.parameters > 0
    assert hooks.stats.encoded_bytes == with_module.stats.encoded_bytes


def test_a_storage_saved_by_several_ops_is_encoded_once():
    a = torch.randn(4096, requires_grad=True)

    def f(a):
        h = a * 3.0  # saves nothing; h is the shared activation
        m = h.view(64, 64)
        # sin, cos and both operands of mm save h (whole, and two views of it)
        return h.sin().sum() + h.cos().sum() + (m @ m.t()).sum()

    f(a).backward()
    g_ref = a.grad.clone()
    a.grad = None
    hooks = compress_saved_tensors(None, "int8")
    with SavedTensorLedger() as ledger:
        with hooks:
            out = f(a)
    s = hooks.stats
    assert (s.encoded, s.reused) == (1, 3)
    expected = make_codec("int8").nbytes_for((4096,), torch.float32)
    assert ledger.total_bytes == s.encoded_bytes == expected
    out.backward()
    assert s.decoded == 1  # once per storage per backward
    assert rel_error(a.grad, g_ref) < 2e-2


def test_each_backward_decodes_again_and_sees_the_same_values(block, x):
    hooks = compress_saved_tensors(block, "int8")
    with hooks:
        y = block(x)
    (y * y).sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    assert hooks.stats.decoded == hooks.stats.encoded
    (y * y).sum().backward()
    assert hooks.stats.decoded == 2 * hooks.stats.encoded
    for p, g in zip(block.parameters(), first):
        assert torch.equal(p.grad, g)


def test_small_view_of_a_big_storage_does_not_pin_it():
    a = torch.randn(8192, requires_grad=True)
    hooks = compress_saved_tensors(None, "int8")
    with SavedTensorLedger() as ledger:
        with hooks:
            big = a * 2.0
            out = big[:10].sin().sum()  # a 10-element view: kept, cloned
            ref = weakref.ref(big.untyped_storage())
            del big
    assert ref() is None
    assert ledger.total_bytes == hooks.stats.kept_bytes == 40
    out.backward()
    assert torch.allclose(a.grad[:10], 2.0 * torch.cos(2.0 * a.detach()[:10]))


def test_bool_masks_are_bit_packed_losslessly():
    a = torch.randn(4096, requires_grad=True)
    cond = torch.rand(4096) > 0.5
    torch.where(cond, a * a, -a).sum().backward()
    g_ref = a.grad.clone()
    a.grad = None
    hooks = compress_saved_tensors(None, "keep")  # floats kept, the mask packed
    with SavedTensorLedger() as ledger:
        with hooks:
            out = torch.where(cond, a * a, -a).sum()
    assert hooks.stats.by_codec == {"bitmask": 4096 // 8}
    assert ledger.total_bytes == 4096 // 8 + 4096 * 4  # the mask + `a` saved by a * a
    out.backward()
    assert torch.equal(a.grad, g_ref)


def test_nan_input_gives_nan_grads_where_stock_does(block):
    x = torch.randn(*SHAPE)
    x[0, 5, 3] = float("nan")
    x.requires_grad_(True)
    _, g_ref = _run(block, x)
    _, g = _run(block, x, compress_saved_tensors(block, "int8"))
    assert g_ref["qkv.weight"].isnan().any()
    for n, ref in g_ref.items():
        assert torch.equal(g[n].isnan(), ref.isnan()), n


def test_nothing_is_encoded_under_no_grad(block, x):
    hooks = compress_saved_tensors(block, "int8")
    with SavedTensorLedger() as ledger, hooks, torch.no_grad():
        block(x)
    assert hooks.stats.encoded == 0 and ledger.total_bytes == 0
    wrapped = GenericCompression(block, "int8")
    with torch.no_grad():
        assert torch.equal(wrapped(x), block(x))
    assert wrapped.hooks.stats.encoded == 0


def test_generic_compression_wrapper(block, x, encoded_shapes):
    wrapped = GenericCompression(block, "int8")
    with SavedTensorLedger() as ledger:
        y = wrapped(x)
    assert torch.equal(y, block(x))  # the forward itself is unchanged
    assert not wrapped.hooks.active
    assert ledger.total_bytes == wrapped.hooks.stats.encoded_bytes + wrapped.hooks.stats.kept_bytes
    assert sum(math.prod(shape) for shape in encoded_shapes) == 131072
    expected = sum(make_codec("int8").nbytes_for(shape, torch.float32) for shape in encoded_shapes)
    assert wrapped.hooks.stats.encoded_bytes == expected
    y.sum().backward()
    assert all(p.grad is not None for p in block.parameters())


def test_checkpoint_blocks_bit_identical_without_codec(x):
    blocks = make_blocks(2)
    model = torch.nn.Sequential(*blocks)
    stock, g_ref = _run(model, x)
    handle = checkpoint_blocks(blocks)
    ledger, g = _run(model, x)
    for n, ref in g_ref.items():
        assert torch.equal(g[n], ref), n
    # one block input per block (the second one is the first block's output)
    assert ledger.by_site() == {(0, "ln1.input"): x.nbytes, (1, "ln1.input"): x.nbytes}
    assert stock.total_bytes > 10 * ledger.total_bytes
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_blocks(blocks)
    handle.remove()
    again, _ = _run(model, x)
    assert again.total_bytes == stock.total_bytes


def test_checkpoint_blocks_with_an_int8_checkpoint(x):
    blocks = make_blocks(2)
    model = torch.nn.Sequential(*blocks)
    _, g_ref = _run(model, x)
    handle = checkpoint_blocks(blocks, "int8")
    ledger, g = _run(model, x)
    per_block = make_codec("int8").nbytes_for(SHAPE, torch.float32)
    assert ledger.by_site() == {(0, "ln1.input"): per_block, (1, "ln1.input"): per_block}
    assert [h.stats.encoded for h in handle.hooks] == [1, 1]
    for n, ref in g_ref.items():
        if ref.norm() > 0:
            assert rel_error(g[n], ref) < 2e-2, n
    handle.remove()


def test_bad_arguments(block, x):
    with pytest.raises(ValueError, match="fewbit3"):
        compress_saved_tensors(block, "fewbit3")
    with pytest.raises(ValueError, match="nope"):
        compress_saved_tensors(block, "nope")
    with pytest.raises(TypeError, match="codec_for"):
        compress_saved_tensors(block, 8)
    with pytest.raises(TypeError, match="module"):
        compress_saved_tensors("block", "int8")
    with pytest.raises(ValueError, match="min_numel"):
        compress_saved_tensors(block, "int8", min_numel=-1)
    with pytest.raises(ValueError, match="site"):
        compress_saved_tensors(block, "int8", site="attn.nope")
    with pytest.raises(ValueError, match="returned"):
        with compress_saved_tensors(block, lambda t: "int9"):
            block(x)
    with pytest.raises(TypeError, match="blocks"):
        checkpoint_blocks([block, "x"])


def test_autocast_weight_copies_count_as_parameters(block, x):
    plain = compress_saved_tensors(block, "int8")
    _run(block, x, plain)
    cast = compress_saved_tensors(block, "int8")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _run(block, x, cast)
    assert cast.stats.parameters == plain.stats.parameters > 0
    assert cast.stats.encoded == plain.stats.encoded


def test_an_activation_where_a_freed_parameter_was_is_encoded():
    """Parameters are told apart by their live storage, not by an address: an activation
    allocated where a released parameter lived (ZeRO-3 frees a gathered parameter after its
    module runs) is encoded at its site like any other. Keyed by the address alone it was
    kept raw, on the ranks whose allocator happened to reuse the block, and "auto"'s
    measurement then took different paths on different ranks."""
    numel = 4096
    memory = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)  # outlives both storages
    module = torch.nn.Linear(1, 1, bias=False)
    module.weight = torch.nn.Parameter(torch.from_numpy(memory))
    module.forward = lambda x: x * 2
    module.register_forward_hook(lambda m, args, out: setattr(m.weight, "data", torch.empty(0)))
    x = torch.randn(numel, requires_grad=True)
    hooks = compress_saved_tensors(None, "int8")
    with hooks:
        y = module(x)  # the pre-hook notes the weight's storage; the post-hook frees it
        z = torch.from_numpy(memory).copy_(y)  # a new storage at the same address
        assert z.untyped_storage().data_ptr() == memory.ctypes.data
        out = z.sin()  # saves z
    assert hooks.stats.parameters == 0
    assert hooks.stats.by_codec == {"int8": make_codec("int8").nbytes_for((numel,), torch.float32)}
    out.sum().backward()
    assert rel_error(x.grad, 2 * torch.cos(2 * x.detach())) < 2e-2
