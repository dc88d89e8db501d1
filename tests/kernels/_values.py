"""Inputs and checks shared by the kernel tests."""
import torch

from llm_act.kernels import nonfinite_ref


def tiny_values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values at the bottom of `dtype`'s range, as float32: subnormals of float32 and
    float16; for bfloat16 the smallest normals instead, because the interpreter's own
    bfloat16 -> float32 load mangles subnormals (a GPU converts them exactly), and a
    kernel reading x cannot avoid that conversion without an int16 view of every input."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype).smallest_normal
    u = torch.rand(n, generator=g)
    return (1.0 + u) * tiny if dtype == torch.bfloat16 else u * tiny


def side_lists(encodes, x: torch.Tensor, *args, **kwargs) -> list:
    """Each encode (a kernel launcher, then its reference) run on `x` with a fresh state and
    side list: [(state, (index, value, count))] in the order given."""
    out = []
    for encode in encodes:
        state = nonfinite_ref.new_state("cpu")
        buffers = nonfinite_ref.empty_side_list(x.numel(), x.dtype, "cpu")
        encode(x, *args, state=state, **kwargs, **dict(zip(("nf_index", "nf_value", "nf_count"), buffers)))
        out.append((state, buffers))
    return out


def assert_same_side_list(found: list, count: int) -> None:
    """The kernel's side list (first of `found`) is the reference's: `count` slots, the same
    positions and exact bits, and the kernel's state counted the call and reset."""
    (state, (index, value, n)), (_, (rindex, rvalue, rn)) = found
    assert int(n) == int(rn) == count
    assert torch.equal(index[:count], rindex[:count])
    assert torch.equal(value[:count].view(torch.uint8), rvalue[:count].view(torch.uint8))
    assert state.tolist()[:3] == [1, 0, 0]  # the call counted, the running fields reset
