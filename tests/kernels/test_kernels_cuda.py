"""On a CUDA device, every codec's Triton path against its torch reference (same codec, same input).

Each test also asserts that Triton kernels launched (`triton_launches`): the custom ops
fall back to the references silently wherever `use_triton` says no, and a comparison of
two reference runs would pass.

Deterministic codecs must decode identically, bit for bit;
stochastic ones must stay within their error bound and be unbiased over repeats. Skipped
without CUDA; the CPU suite covers the same kernels under TRITON_INTERPRET=1.
"""
import os

import pytest
import torch

from llm_act.codecs import make_codec

pytestmark = pytest.mark.gpu

DETERMINISTIC = ["int4_sym", "int8_sym", "int4_asym", "int4_channel", "fp8_e4m3", "fp8_e5m2",
                 "fewbit1", "fewbit3", "bitmask"]
STOCHASTIC = ["int1", "int2", "int4", "int8", "outlier_int4", "dual2"]


@pytest.fixture
def triton_launches(monkeypatch):
    """Names of the Triton kernels launched while the test runs."""
    from triton.runtime.jit import JITFunction

    launched: list[str] = []
    original = JITFunction.run

    def run(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", run)
    return launched


def _reference(codec, x):
    old = os.environ.get("LLM_ACT_KERNELS")
    os.environ["LLM_ACT_KERNELS"] = "torch"
    try:
        return codec.decode(codec.encode(x))
    finally:
        if old is None:
            del os.environ["LLM_ACT_KERNELS"]
        else:
            os.environ["LLM_ACT_KERNELS"] = old


def _input(name, shape, dtype):
    if name == "bitmask":
        return (torch.rand(shape, device="cuda") > 0.2).to(dtype)
    return torch.randn(shape, device="cuda", dtype=dtype) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4096, 1024), (333, 3, 130), (1,)])
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_kernel_matches_reference(name, shape, dtype, triton_launches):
    codec = make_codec(name)
    x = _input(name, shape, dtype)
    got = codec.decode(codec.encode(x))
    assert triton_launches, f"{name}: no Triton kernel ran"
    ref = _reference(codec, x)
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_cuda
    # bit for bit: the kernels divide with div_rn, never FMA-contract and convert floats
    # by bit operations (llm_act.kernels: no GPU-only semantics)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_kernel_error_matches_reference(name, dtype, triton_launches):
    codec = make_codec(name)
    x = _input(name, (2048, 2, 512), dtype)
    got = codec.decode(codec.encode(x)).float()
    assert triton_launches, f"{name}: no Triton kernel ran"
    ref = _reference(codec, x).float()
    e_got = (got - x.float()).square().mean().item()
    e_ref = (ref - x.float()).square().mean().item()
    assert 0.8 < e_got / e_ref < 1.25, (e_got, e_ref)
    mean = torch.stack([codec.decode(codec.encode(x)).float() for _ in range(64)]).mean(0)
    bias = (mean - x.float()).abs().mean().item()
    assert bias < 0.25 * e_got ** 0.5, (bias, e_got)


def test_nonfinite_positions_on_cuda():
    x = torch.randn(1000, 257, device="cuda")
    x[3, 5], x[999, 0], x[10, 256] = float("nan"), float("inf"), float("-inf")
    for name in DETERMINISTIC[:-1] + STOCHASTIC:
        y = make_codec(name).roundtrip(x)
        bad = ~torch.isfinite(y)
        assert torch.equal(bad, ~torch.isfinite(x)), name
