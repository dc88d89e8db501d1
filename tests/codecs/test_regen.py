"""RegenMask (generator state only): exact masks, sizes, errors."""
import pytest
import torch

from llm_act.codecs import RegenMask, make_codec
from llm_act.codecs.regen import dropout_keep_mask

MASK_DTYPES = [torch.bool, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", MASK_DTYPES)
def test_regen_sample_draws_torch_dropouts_own_mask(dtype):
    """The mask is the one `F.dropout` draws from the same generator state, and the
    generator advances as dropout's does: a compressed layer's forward is stock's."""
    g = torch.Generator().manual_seed(7)
    mask, enc = RegenMask().sample((3, 5, 130), 0.25, g, "cpu", dtype)
    torch.manual_seed(7)
    dropped = torch.nn.functional.dropout(torch.ones(3, 5, 130), 0.25, training=True)
    assert mask.dtype == dtype and torch.equal(mask, (dropped != 0).to(dtype))
    assert torch.equal(g.get_state(), torch.get_rng_state())
    assert enc.shape == (3, 5, 130) and enc.dtype == dtype


@pytest.mark.parametrize("like_dtype", [torch.float32, torch.bfloat16])
def test_dropout_keep_mask_is_dropouts_mask_for_any_dtype_and_stride(like_dtype):
    x = torch.ones(6, 40, 9, dtype=like_dtype).transpose(0, 2)  # a strided input
    torch.manual_seed(5)
    want = torch.nn.functional.dropout(x, 0.3, training=True) != 0
    g = torch.Generator().manual_seed(5)
    got = dropout_keep_mask(x.shape, 0.3, g, "cpu", like_dtype, torch.empty_like(x).stride())
    assert torch.equal(got, want)
    # p == 0 draws nothing and keeps all, as dropout does
    before = g.get_state().clone()
    assert bool(dropout_keep_mask((4,), 0.0, g).all()) and torch.equal(g.get_state(), before)


def test_regen_decode_is_identical_and_leaves_the_generator_alone():
    r = make_codec("regen")
    g = torch.Generator().manual_seed(3)
    mask1, enc1 = r.sample((256, 2, 512), 0.1, g)
    mask2, enc2 = r.sample((256, 2, 512), 0.1, g)
    assert not torch.equal(mask1, mask2)  # the generator advanced, as dropout's does
    state = g.get_state().clone()
    assert torch.equal(r.decode(enc2), mask2) and torch.equal(r.decode(enc1), mask1)
    assert torch.equal(g.get_state(), state)
    assert abs(mask1.float().mean().item() - 0.9) < 0.01


def test_regen_size_is_the_state_whatever_the_mask():
    r = RegenMask()
    sizes = set()
    for shape in [(1,), (1000,), (256, 2, 512), (0,)]:
        _, enc = r.sample(shape, 0.5, torch.Generator().manual_seed(0))
        assert enc.nbytes == r.nbytes_for(shape, torch.bool, device="cpu")
        sizes.add(enc.nbytes)
    assert sizes == {torch.Generator().get_state().numel()}
    assert r.lossless


def test_regen_default_generator_is_the_global_one():
    torch.manual_seed(11)
    mask, enc = RegenMask().sample((50,), 0.5)
    torch.manual_seed(11)
    assert torch.equal(mask, torch.nn.functional.dropout(torch.ones(50), 0.5, training=True) != 0)
    after = torch.get_rng_state()
    assert torch.equal(RegenMask().decode(enc), mask)
    assert torch.equal(torch.get_rng_state(), after)


def test_regen_errors():
    r = RegenMask()
    with pytest.raises(ValueError, match="sample"):
        r.encode(torch.rand(10) > 0.5)
    with pytest.raises(TypeError):
        r.encode(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError):
        r.sample((3,), 0.5, dtype=torch.int64)
    for p in (-0.1, 1.5, "0.5"):
        with pytest.raises(ValueError, match="p must"):
            r.sample((3,), p)
    empty, enc = r.sample((0, 3), 0.5)
    assert empty.shape == (0, 3) and r.decode(enc).shape == (0, 3)
