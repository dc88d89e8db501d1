"""Checks shared by the codec tests."""
import torch


def assert_nonfinite_kept(x: torch.Tensor, y: torch.Tensor) -> None:
    """`y` decodes `x`: same shape and dtype, finite where `x` is, NaN where `x` is NaN and
    +-Inf of the same sign where `x` is infinite."""
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y[torch.isfinite(x)]).all(), "a finite input decoded to Inf/NaN"
    assert torch.equal(torch.isnan(y), torch.isnan(x)), "NaN positions differ"
    assert torch.equal(torch.isposinf(y), torch.isposinf(x)), "+Inf lost or its sign flipped"
    assert torch.equal(torch.isneginf(y), torch.isneginf(x)), "-Inf lost or its sign flipped"
