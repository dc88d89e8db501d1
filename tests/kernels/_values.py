"""Inputs shared by the kernel tests."""
import torch


def tiny_values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values at the bottom of `dtype`'s range, as float32: subnormals of float32 and
    float16; for bfloat16 the smallest normals instead, because the interpreter's own
    bfloat16 -> float32 load mangles subnormals (a GPU converts them exactly), and a
    kernel reading x cannot avoid that conversion without an int16 view of every input."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype).smallest_normal
    u = torch.rand(n, generator=g)
    return (1.0 + u) * tiny if dtype == torch.bfloat16 else u * tiny
