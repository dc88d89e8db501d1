"""The Triton path makes no host sync either (issue 26): every codec's encode and decode with
its launchers forced on CPU tensors, under the interpreter, as on CUDA."""
import pytest
import torch

from llm_act.codecs import make_codec
from llm_act.codecs.registry import CODEC_NAMES, MASK_CODECS
from tests.no_syncs import NoSyncs, force_triton

pytest.importorskip("triton")


@pytest.mark.parametrize("name", [n for n in CODEC_NAMES if n != "regen"])
def test_triton_encode_and_decode_issue_no_host_sync(name, monkeypatch):
    import triton.runtime.interpreter as interpreter

    force_triton(monkeypatch)
    launches = []
    launch = interpreter.GridExecutor.__call__
    monkeypatch.setattr(interpreter.GridExecutor, "__call__",
                        lambda self, *a, **k: launches.append(self.fn) or launch(self, *a, **k))
    codec = make_codec(name, seed=2)
    g = torch.Generator().manual_seed(0)
    if name in MASK_CODECS:
        x = torch.rand(64, 2, 96, generator=g) > 0.1
    else:
        x = torch.randn(64, 2, 96, generator=g).to(torch.bfloat16)
        x[3, 1, 5], x[7, 0, 9] = float("nan"), float("-inf")
    with NoSyncs():
        enc = codec.encode(x)
        y = codec.decode(enc)
    assert y.shape == x.shape
    assert len(launches) >= 2, "the Triton launchers did not run"  # an encode and a decode
    if name not in MASK_CODECS and not name.startswith("fewbit"):
        assert torch.isnan(y[3, 1, 5]) and torch.isneginf(y[7, 0, 9])
