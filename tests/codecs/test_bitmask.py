"""BitMask (8 per byte): exact masks, sizes, errors."""
import math

import pytest
import torch

from llm_act.codecs import BitMask, make_codec

MASK_DTYPES = [torch.bool, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (127,), (3, 5, 130), (256, 2, 512)])
def test_bitmask_round_trip_and_size(dtype, shape):
    c = BitMask()
    m = (torch.rand(shape) > 0.3).to(dtype)
    enc = c.encode(m)
    y = c.decode(enc)
    assert y.dtype == dtype and torch.equal(y, m)
    assert enc.nbytes == c.nbytes_for(shape, dtype) == math.ceil(math.prod(shape) / 8)
    assert c.lossless and c.expected_error(m.float()) == 0.0


def test_bitmask_noncontiguous_empty_and_types():
    c = make_codec("bitmask")
    m = torch.rand(40, 33) > 0.5
    assert torch.equal(c.roundtrip(m.t()), m.t())
    e = c.encode(torch.empty(0, 4, dtype=torch.bool))
    assert e.nbytes == 0 and c.decode(e).shape == (0, 4)
    for bad in (torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="bitmask"):
            c.encode(bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2.0, -1.0])
def test_bitmask_rejects_non_binary_values(value):
    m = torch.ones(20)
    m[3] = value
    with pytest.raises(ValueError, match="0 and 1"):
        BitMask().encode(m)


def test_triton_path_packs_in_one_launch_without_a_check(monkeypatch):
    """Where the kernel runs (forced here, as on CUDA) a float mask is not checked for 0/1
    (that needs a host sync): encode is the packing launch alone, and any nonzero value,
    NaN included, decodes to 1."""
    import triton.runtime.interpreter as interpreter

    from tests.no_syncs import NoSyncs, force_triton

    force_triton(monkeypatch)
    launches = []
    launch = interpreter.GridExecutor.__call__
    monkeypatch.setattr(interpreter.GridExecutor, "__call__",
                        lambda self, *a, **k: launches.append(self.fn.__name__)
                        or launch(self, *a, **k))
    m = (torch.rand(3, 700) > 0.3).to(torch.bfloat16)
    m[0, 3], m[1, 5], m[2, 7] = float("nan"), 2.0, -1.0
    with NoSyncs():
        enc = BitMask().encode(m)
    assert launches == ["_pack_mask_kernel"]
    y = BitMask().decode(enc)
    assert torch.equal(y, (m != 0).to(m.dtype))
