"""`SavedTensorCompression.site_of`: a subclass that tells a context's saved tensors apart books
each at its own site (the ledger's per-site bytes) and is asked for each site's codec (the
generic door's blocks do this inside an attention call)."""
from __future__ import annotations

import torch

from llm_act.codecs import make_codec
from llm_act.generic.hooks import SavedTensorCompression
from llm_act.ledger import SavedTensorLedger


class _ByWidth(SavedTensorCompression):
    """Books tensors whose last dim is 32 at attn.q, the rest at the context's site."""

    def __init__(self, module):
        super().__init__(module, "int8", site="mlp.fc1_input", layer=0)
        self.asked: list[tuple[str, str]] = []

    def site_of(self, t):
        return "attn.q" if t.shape[-1] == 32 else self.site

    def codec(self, name, site=None):
        self.asked.append((name, site))
        return super().codec(name, site)


def test_a_subclass_books_each_tensor_at_its_site():
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))
    x = torch.randn(4, 16, 64, requires_grad=True)
    hooks = _ByWidth(net)
    with SavedTensorLedger() as ledger, hooks:
        y = net(x)
    # the first linear saves x (last dim 64), the second its input (last dim 32)
    int8 = make_codec("int8")
    assert ledger.by_site() == {(0, "mlp.fc1_input"): int8.nbytes_for((4, 16, 64), torch.float32),
                                (0, "attn.q"): int8.nbytes_for((4, 16, 32), torch.float32)}
    assert sorted(hooks.asked) == [("int8", "attn.q"), ("int8", "mlp.fc1_input")]
    y.sum().backward()
    assert x.grad is not None
