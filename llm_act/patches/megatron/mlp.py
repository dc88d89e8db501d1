"""`ActMLP`: megatron-core's MLP whose activation stores little for backward.

The activation input (site `mlp.act_input`) is stored by kind of activation:
- GELU / SiLU (and megatron's fused tanh-GELU): with a few-bit codec, only the bucket
  index of x (Few-Bit Backward: backward multiplies by the decoded q(x) ~ f'(x)); with a
  value codec, encode(x) and f is differentiated again at the decoded x;
- ReLU: the 1-bit mask relu(x) > 0, exact, whatever the codec (relu' is 0/1);
- SwiGLU / GeGLU (`gated_linear_unit`), squared ReLU and any other activation: encode(x)
  with the site's value codec, differentiated again at the decoded x. Few-bit codecs do
  not apply there (the gated product and relu^2 need x itself, not only f'(x)).
The linears fc1/fc2 are separate `Act*ParallelLinear` modules with their own sites.
With the site kept (or no grad / eval) `forward` is `MLP.forward`, unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from llm_act._imports import require
from llm_act.codecs.base import Codec
from llm_act.patches.megatron.act_module import ActModule
from llm_act.patches.megatron.functions import EncodedRecompute, FewBitActivation, MaskActivation

require("megatron.core", "llm_act.patches.megatron.mlp")
from megatron.core.transformer.mlp import MLP  # noqa: E402
from llm_act.codecs.registry import CODEC_NAMES, refusal  # noqa: E402
from llm_act.sites import MLP_ACT_INPUT

SITE = MLP_ACT_INPUT


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def activation_of(config) -> tuple[str, Callable, Optional[str]]:
    """(kind, f, few-bit activation name) of an MLP's activation under `config`.

    kind: "fewbit" (f' depends on x only: few-bit or value codec), "mask" (ReLU),
    "value" (a value codec only). f is what the compressed path computes (the stock
    formula, in eager mode).
    """
    act = config.activation_func
    fused = bool(config.bias_activation_fusion)
    if config.gated_linear_unit:
        clamp, offset = config.activation_func_clamp_value, config.glu_linear_offset
        inner = _gelu_tanh if (fused and act is F.gelu) else act

        def glu(x):
            x_glu, x_linear = torch.chunk(x, 2, dim=-1)
            if clamp is not None:
                x_glu = x_glu.clamp(min=None, max=clamp)
                x_linear = x_linear.clamp(min=-clamp, max=clamp)
            return inner(x_glu) * (x_linear + offset)

        return "value", glu, None
    if act is F.gelu:
        return ("fewbit", _gelu_tanh, "gelu_tanh") if fused else ("fewbit", F.gelu, "gelu")
    if act is F.silu:
        return "fewbit", F.silu, "silu"
    if act is F.relu or act is torch.relu:
        return "mask", torch.relu, "relu"
    return "value", act, None


class ActMLP(ActModule, MLP):
    """MLP storing its activation input compactly (site `mlp.act_input`)."""

    ACT_SITES = (SITE,)

    def __init__(self, *args: Any, **kwargs: Any):
        MLP.__init__(self, *args, **kwargs)
        self._act_init()

    @property
    def act_activation(self) -> Optional[str]:
        """The activation a few-bit codec for this MLP must be fitted to (make_codec's
        `activation=`), or None when few-bit codecs do not apply (gated units, ...)."""
        kind, _, name = activation_of(self.config)
        return name if kind == "fewbit" else None

    def set_act_codec(self, site: str, codec: Optional[Codec]) -> None:
        if codec is not None and site == SITE:
            kind, _, name = activation_of(self.config)
            few = getattr(codec, "table", None) is not None and hasattr(codec, "activation")
            why = refusal(SITE, codec.name, kind) if codec.name in CODEC_NAMES else None
            if why is not None:  # the schema's rule, the one every caller asks
                raise ValueError(
                    f"{why} (this MLP: gated_linear_unit={self.config.gated_linear_unit}, activation "
                    f"{getattr(self.config.activation_func, '__name__', self.config.activation_func)})")
            if few and kind == "fewbit" and codec.activation != name:
                raise ValueError(
                    f"codec {codec.name!r} is fitted to {codec.activation!r}, this MLP computes "
                    f"{name!r}: build it with make_codec({codec.name!r}, activation={name!r})")
        ActModule.set_act_codec(self, site, codec)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        codec = self.act_codec(SITE, stores=self._act_input_like(hidden_states))
        if codec is None:
            return MLP.forward(self, hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None or self.config.use_te_activation_func:
            raise NotImplementedError(
                "mlp.act_input: compression with per-token scales (MoE) or Transformer Engine "
                "activations is not supported; keep this site")
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        intermediate = self._activation(intermediate, codec)
        return self.linear_fc2(intermediate)

    def _act_input_like(self, hidden_states: torch.Tensor) -> tuple:
        """(shape, dtype) of the activation's input, fc1's output (sequence parallel: fc1
        all-gathers the sequence), before fc1 runs: what the site keeps raw."""
        fc1 = self.linear_fc1
        width = getattr(fc1, "output_size_per_partition", None)
        if width is None:
            return (tuple(hidden_states.shape), hidden_states.dtype)
        seq = hidden_states.shape[0]
        if getattr(self.config, "sequence_parallel", False):
            seq *= max(1, fc1.output_size // max(width, 1))
        return ((seq, *hidden_states.shape[1:-1], width), hidden_states.dtype)

    def _activation(self, x: torch.Tensor, codec: Codec) -> torch.Tensor:
        kind, fn, _ = activation_of(self.config)
        if not x.requires_grad:
            return fn(x)
        if kind == "mask":
            return MaskActivation.apply(x, self, SITE)
        if kind == "fewbit" and getattr(codec, "table", None) is not None:
            return FewBitActivation.apply(x, fn, codec, self, SITE)
        return EncodedRecompute.apply(x, fn, codec, self, SITE)
