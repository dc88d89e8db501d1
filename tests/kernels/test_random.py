"""`random_triton.uniform8`: 8 random bits per element for stochastic rounding, four Philox
outputs per call. Unbiased to 2**-K_BITS of a step, and every byte value equally likely."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from llm_act.kernels import int_quant_triton as tri  # noqa: E402
from llm_act.kernels.packing_ref import unpack_bits  # noqa: E402
from llm_act.kernels.random_triton import K_BITS, uniform8  # noqa: E402


@triton.jit
def _probe(out_ptr, seed, R: tl.constexpr, C: tl.constexpr):
    pid = tl.program_id(0)
    u = uniform8(seed, pid, R, C)
    offs = pid * R * C + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(out_ptr + offs, u)


def test_bytes_are_uniform_and_distinct_across_programs():
    out = torch.empty(4 * 32 * 64)
    _probe[(4,)](out, 11, R=32, C=64)
    b = (out * 256 - 0.5).round().long()
    assert torch.equal((b.float() + 0.5) / 256, out)  # (b + 1/2) / 256 exactly
    hist = torch.bincount(b, minlength=256).float()
    expected = out.numel() / 256
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < 350, chi2  # 255 degrees of freedom: p ~ 1e-4 at 350
    tiles = b.view(4, -1)
    assert all(not torch.equal(tiles[0], tiles[i]) for i in range(1, 4))


@pytest.mark.parametrize("frac", [0.02, 0.5, 0.97])
def test_stochastic_rounding_bias_within_two_to_minus_k(frac):
    """Codes of v = 4 + frac: the mean code is v within 2**-K_BITS of a step (plus sampling
    noise); `frac` 0.02 and 0.97 sit where a coarse draw would be most biased."""
    n, gs = 1 << 18, 64
    step = 1 / 15
    x = torch.full((n,), (4 + frac) * step)
    x[0::gs], x[1::gs] = 0.0, 1.0  # every group spans [0, 1]: scale 1/15, zero 0
    enc = tri.int_quant_encode(x, 4, gs, False, seed=2024)
    codes = unpack_bits(enc[0], 4, n).double()
    keep = torch.ones(n, dtype=torch.bool)
    keep[0::gs] = keep[1::gs] = False
    mean_code = codes[keep].mean().item()
    sigma = (frac * (1 - frac) / keep.sum().item()) ** 0.5
    assert abs(mean_code - (4 + frac)) <= 2.0**-K_BITS + 4 * sigma, mean_code
