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
    """As `assert_nonfinite_kept` for `nonfinite_capacity` of x's non-finite elements (which
    ones is the kernels' business: programs take slots as they come); past the capacity a
    non-finite element decodes to NaN, never to a finite value or the other Inf."""
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    finite = torch.isfinite(flat_x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(flat_y[finite]).all(), "a finite input decoded to Inf/NaN"
    bad_x, bad_y = flat_x[~finite], flat_y[~finite]
    assert (torch.isnan(bad_y) | (bad_y == bad_x)).all(), "a non-finite input decoded to another value"
    assert torch.isnan(bad_y[torch.isnan(bad_x)]).all(), "NaN lost"
    exact = (torch.isnan(bad_y) & torch.isnan(bad_x)) | (bad_y == bad_x)
    assert int(exact.sum()) >= min(bad_x.numel(), nonfinite_capacity(x.numel())), \
        "fewer non-finite values kept exactly than the side list holds"
