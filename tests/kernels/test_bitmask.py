"""Bit-packed mask kernels vs the reference (interpreter on CPU)."""
import pytest
import torch

from llm_act.kernels import bitmask_ref as ref

triton_mask = pytest.importorskip("llm_act.kernels.bitmask_triton")


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (127,), (1000,), (3, 5, 130), (9000,), (0,)])
def test_pack_unpack_match_reference(dtype, shape):
    m = (torch.rand(shape) > 0.4).to(dtype)
    packed = triton_mask.pack_mask(m)
    assert torch.equal(packed, ref.pack_mask_ref(m))
    n = m.numel()
    out = triton_mask.unpack_mask(packed, n, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, ref.unpack_mask_ref(packed, n, dtype))
    assert torch.equal(out.view(shape), m)


def test_pack_noncontiguous():
    m = torch.rand(400, 21) > 0.5  # 8400 elements: three programs
    assert torch.equal(triton_mask.pack_mask(m.t()), ref.pack_mask_ref(m.t()))


def test_large_inputs_launch_several_programs(grids):
    grids.watch(triton_mask, "_pack_mask_kernel", "_unpack_mask_kernel")
    m = torch.rand(9000) > 0.4
    triton_mask.unpack_mask(triton_mask.pack_mask(m), m.numel(), torch.bool)
    assert grids.most("_pack_mask_kernel") > 1 and grids.most("_unpack_mask_kernel") > 1
    assert all(grids.exact(k) for k in grids.programs), grids.fusion  # no FMA contraction
