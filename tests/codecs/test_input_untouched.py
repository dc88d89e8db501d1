"""Every codec leaves its input bit-identical, and what decode returns shares no memory with
the stored record (issue 25: "a compressed backward must never change the forward").

An encode that scaled, clamped or rounded its input in place would change the tensor the
forward goes on computing with; a decode that returned a view of the record would let the
backward's in-place ops corrupt what a second decode (recompute, a retried backward) reads.
"""
import pytest
import torch

from llm_act.codecs import make_codec
from llm_act.codecs.registry import CODEC_NAMES, FEWBIT_CODECS, MASK_CODECS


def _inputs(name: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """A plain tensor, a strided view (read through `.contiguous()`, which may return the
    input itself), and one with non-finite values and an outlier channel."""
    g = torch.Generator().manual_seed(3)
    if name in MASK_CODECS:
        mask = torch.rand(64, 2, 96, generator=g) > 0.1
        return [mask, mask.transpose(0, 2)]
    base = torch.randn(64, 2, 96, generator=g).to(dtype)
    odd = base.clone()
    odd[:, :, 5] *= 40.0  # an outlier channel
    odd[3, 1, 7], odd[9, 0, 2], odd[11, 1, 40] = float("nan"), float("inf"), float("-inf")
    return [base, base.transpose(0, 2), odd]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads included), which `torch.equal` is not for NaN."""
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [n for n in CODEC_NAMES if n != "regen"])
def test_encode_leaves_its_input_and_decode_shares_nothing(name, dtype):
    codec = make_codec(name, seed=5)
    for x in _inputs(name, dtype):
        before = x.clone()
        enc = codec.encode(x)
        assert _same_bits(x, before), f"{name}: encode changed its input"
        record = _storages(enc.data.values())
        # the record holds no view of the input: the forward may go on changing x in place
        assert x.untyped_storage().data_ptr() not in record, f"{name}: the record aliases x"
        out = codec.decode(enc)
        assert not (_storages([out]) & record), f"{name}: decode returned a view of the record"
        snapshot = [t.clone() for t in enc.data.values()]
        out.mul_(0) if out.dtype != torch.bool else out.logical_not_()
        again = codec.decode(enc)
        assert all(_same_bits(a, b) for a, b in zip(enc.data.values(), snapshot)), \
            f"{name}: writing to the decoded tensor changed the record"
        assert again.shape == x.shape
    if name in FEWBIT_CODECS:  # its decode is f'(x), checked against the same input twice
        x = _inputs(name, dtype)[0]
        assert torch.equal(codec.decode(codec.encode(x)), codec.decode(codec.encode(x)))


def test_regen_decode_shares_nothing_with_the_record():
    codec = make_codec("regen")
    mask, enc = codec.sample((32, 2, 40), 0.25, torch.Generator().manual_seed(1))
    state = enc.data["state"].clone()
    out = codec.decode(enc)
    assert not (_storages([out]) & _storages(enc.data.values()))
    out.logical_not_()
    assert torch.equal(enc.data["state"], state) and torch.equal(codec.decode(enc), mask)
