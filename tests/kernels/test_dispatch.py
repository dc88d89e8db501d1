"""`LLM_ACT_KERNELS` picks the kernels: unset/"auto" by device, "torch" the references;
anything else is an error naming the allowed values (a typo must not silently run the
default)."""
import pytest
import torch

from llm_act.codecs import make_codec
from llm_act.kernels import KERNEL_CHOICES, kernel_choice, use_triton


@pytest.mark.parametrize("value,want", [("", "auto"), ("auto", "auto"), ("torch", "torch"),
                                        (" Torch ", "torch")])
def test_known_values(monkeypatch, value, want):
    monkeypatch.setenv("LLM_ACT_KERNELS", value)
    assert kernel_choice() == want
    assert use_triton(torch.zeros(1)) is False  # CPU tensors always take the references
    if want == "torch" and torch.cuda.is_available():
        assert use_triton(torch.zeros(1, device="cuda")) is False


def test_unset_is_auto(monkeypatch):
    monkeypatch.delenv("LLM_ACT_KERNELS", raising=False)
    assert kernel_choice() == "auto"


@pytest.mark.parametrize("value", ["triton", "refs", "0"])
def test_unknown_value_raises_at_first_dispatch(monkeypatch, value):
    monkeypatch.setenv("LLM_ACT_KERNELS", value)
    with pytest.raises(ValueError) as err:
        use_triton(torch.zeros(1))
    msg = str(err.value)
    assert f"LLM_ACT_KERNELS={value!r}" in msg
    assert all(choice in msg for choice in KERNEL_CHOICES)
    with pytest.raises(ValueError, match="LLM_ACT_KERNELS"):  # a codec's encode, too
        make_codec("int4").encode(torch.randn(8))
