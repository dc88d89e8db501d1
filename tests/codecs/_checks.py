"""Checks shared by the codec tests."""
import torch

from llm_act.codecs.base import nonfinite_capacity


def assert_nonfinite_kept(x: torch.Tensor, y: torch.Tensor) -> None:
    """`y` decodes `x`: same shape and dtype, finite where `x` is, NaN where `x` is NaN and
    +-Inf of the same sign where `x` is infinite."""
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y[torch.isfinite(x)]).all(), "a finite input decoded to Inf/NaN"
    assert torch.equal(torch.isnan(y), torch.isnan(x)), "NaN positions differ"
    assert torch.equal(torch.isposinf(y), torch.isposinf(x)), "+Inf lost or its sign flipped"
    assert torch.equal(torch.isneginf(y), torch.isneginf(x)), "-Inf lost or its sign flipped"


def assert_nonfinite_kept_within_capacity(x: torch.Tensor, y: torch.Tensor) -> None:
    """As `assert_nonfinite_kept` for the first `nonfinite_capacity` non-finite elements of
    `x` (row-major); past the capacity a non-finite element decodes to NaN, never finite."""
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    bad_at = torch.nonzero(~torch.isfinite(flat_x)).reshape(-1)
    kept = torch.zeros_like(flat_x, dtype=torch.bool)
    kept[bad_at[:nonfinite_capacity(x.numel())]] = True
    assert_nonfinite_kept(torch.where(kept | torch.isfinite(flat_x), flat_x, float("nan")), flat_y)
