"""Test helpers: a stock TransformerLayer and a converted twin with the same weights.

`twin_layers` builds both on the current parallel state; `grads` runs a module forward
and backward with a fixed output gradient and returns the input and parameter grads,
so a converted module can be compared with the stock one bit for bit or within a bound.
"""
from __future__ import annotations

import math

import torch

from llm_act.codecs.base import Codec, Encoded
from tests import testing
from tests.rel_error import rel_error


def twin_layers(config, dtype=torch.float32, state=None):
    """(stock, converted, sites) TransformerLayers with equal weights (in `dtype`); with
    `config.qk_layernorm` from the local spec with q/k norms."""
    from llm_act.patches.megatron.swap import convert_layer

    spec = testing.local_layer_spec(qk_layernorm=True) if getattr(config, "qk_layernorm", False) else None
    stock = testing.transformer_layer(config, spec=spec)
    if state is not None:
        stock.load_state_dict(state)
    stock = stock.to(dtype)
    act = testing.transformer_layer(config, spec=spec).to(dtype)
    act.load_state_dict(stock.state_dict())
    sites = convert_layer(act, 0)
    return stock, act, sites


def submodule(layer, site: str):
    """The module of `layer` that stores `site` (stock or converted)."""
    return {
        "ln1.input": lambda: layer.input_layernorm,
        "attn.qkv_input": lambda: layer.self_attention.linear_qkv,
        "attn.out": lambda: layer.self_attention.linear_proj,
        "ln2.input": lambda: layer.pre_mlp_layernorm,
        "mlp.fc1_input": lambda: layer.mlp.linear_fc1,
        "mlp.act_input": lambda: layer.mlp,
        "mlp.fc2_input": lambda: layer.mlp.linear_fc2,
        "attn.q_norm_input": lambda: layer.self_attention.q_layernorm,
        "attn.k_norm_input": lambda: layer.self_attention.k_layernorm,
    }[site]()


def input_width(config, site: str) -> int:
    if site == "mlp.fc2_input":
        return config.ffn_hidden_size
    if site == "attn.out":
        return config.kv_channels * config.num_attention_heads
    if site in ("attn.q_norm_input", "attn.k_norm_input"):  # per head
        return config.kv_channels
    return config.hidden_size


def grads(module, x: torch.Tensor, gy_seed: int = 7) -> list[torch.Tensor]:
    """[x.grad, *param grads] after backward of <module(x), gy> with a seeded gy."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    if isinstance(out, tuple):
        out, bias = out
        if bias is not None:
            out = out + bias
    gen = torch.Generator().manual_seed(gy_seed)
    gy = torch.randn(out.shape, generator=gen).to(out.dtype)
    out.backward(gy)
    return [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def rel_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """Relative L2 error of each gradient (float64)."""
    return [rel_error(g, r) for g, r in zip(got, ref)]


class GaussianChannel(Codec):
    """The error model of a codec as a channel: decode = fn(x) + N(0, sigma2) per element.

    Used to propagate a codec's *predicted* error (its `expected_error`, a mean squared
    error per element) through a module's real backward: the gradient error this channel
    causes is the predicted gradient error of the codec.
    """

    def __init__(self, sigma2: float, fn=None, seed: int = 99, table=None, activation=None):
        super().__init__(seed)
        self.sigma = math.sqrt(max(float(sigma2), 0.0))
        self.fn = fn
        self.name = "gaussian"
        if table is not None:  # stands in for a FewBit codec: decode yields f'(x) + noise
            self.table, self.activation = table, activation

    def _encode(self, x: torch.Tensor) -> Encoded:
        return self._record(x, value=x.clone())

    def _decode(self, enc: Encoded) -> torch.Tensor:
        x = enc.data["value"].double()
        y = self.fn(x) if self.fn is not None else x
        noise = torch.randn(y.shape, generator=self.generator(y.device), dtype=torch.float64)
        return (y + self.sigma * noise).to(enc.dtype)

    def nbytes_for(self, shape, dtype):
        return math.prod(shape) * torch.finfo(dtype).bits // 8
