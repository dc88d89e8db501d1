"""Per-channel codecs read a strided view in place (issue 26: `attn.v`, a slice of the QKV
buffer, was copied by `.contiguous()` on every encode): same record as the contiguous
copy, non-finite positions in the view's own order, and no copy on the Triton path."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llm_act.codecs import make_codec
from tests.no_syncs import force_triton

COPIES = {"clone", "copy_", "_to_copy", "contiguous"}


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _v_view():
    qkv = torch.randn(40, 2, 4, 3 * 32, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(torch.bfloat16)
    v = qkv[..., 64:]  # [s, b, g, d] with row stride 3 d, like megatron's split
    v[3, 1, 2, 5], v[39, 0, 0, 31] = float("nan"), float("-inf")
    return v


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_strided_view_encodes_like_its_copy(path, monkeypatch):
    if path == "triton":
        pytest.importorskip("triton")
        force_triton(monkeypatch)
    v = _v_view()
    assert not v.is_contiguous()
    codec = make_codec("int4_channel")
    strided, copied = codec.encode(v), codec.encode(v.contiguous())
    for key, t in copied.data.items():
        if key.startswith("nonfinite") and key != "nonfinite_count":
            used = int(copied.data["nonfinite_count"])
            assert torch.equal(strided.data[key][:used].view(torch.uint8),
                               t[:used].view(torch.uint8)), key
        else:
            assert torch.equal(strided.data[key], t), key
    y = codec.decode(strided)
    assert torch.isnan(y[3, 1, 2, 5]) and y[39, 0, 0, 31] == float("-inf")


def test_no_copy_of_the_view_on_the_triton_path(monkeypatch):
    pytest.importorskip("triton")
    force_triton(monkeypatch)
    v = _v_view()
    codec = make_codec("int4_channel")
    codec.encode(v)  # the codec's state is made at the first encode
    with _OpNames() as ops:
        codec.encode(v)
    assert not COPIES & set(ops.names), ops.names
    other = make_codec("int4")  # a per-group codec still reads a contiguous copy
    with _OpNames() as ops:
        other.encode(v)
    assert COPIES & set(ops.names)
