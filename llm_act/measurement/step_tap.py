"""What a tracking iteration's own training step measures, at no pass of its own.

Plan "auto" re-measures at its tracking iterations. Two kinds of figures need no extra
forward or backward: they can be read off the training step that runs anyway, under the
plan in force and in the memory that plan takes. `StepTap` is installed on the first
training forward of such an iteration (by the recorded step, `llm_act.measurement.replay`)
and removed at the step boundary; while installed it keeps

- a token sample of every site's tensor (`token_sample`: about `SAMPLE_ELEMS`
  elements, every channel) with its shape and dtype, taken by forward hooks on the modules
  the block schema names (`llm_act.sites`): a site's "input" tag is an argument of the
  module that stores it, a site made by a submodule (`Site.made_by`, the activation's input)
  is that submodule's output. The codecs' errors and outlier channels are computed on
  these samples after the step (`measure.profile_from_samples`); the sites hold what they
  hold, whatever codec, recomputation or keep the plan gives them. Sites without such a
  tensor (masks, the unfused softmax, the MoE's) keep the figures of the last full profile;
- c of every linear's input from the step's own backward (`linear_tap.LinearTap`:
  c_l = sum_t ||x_t||^2 ||dy_t||^2, the gradient dy the real backward hands the linear).
  Exact where the backward is: under a compressing plan dy carries the errors of the
  sites decoded above it, a relative error of their S (about 1e-2 for INT4) in c.

Only the first forward of each module counts (the first micro-batch, whose step the
recorded replay measures; under whole-block recomputation the first forward that
records for backward): later micro-batches and recomputations are left alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from llm_act import sites as schema
from llm_act.measurement import linear_tap
from llm_act.measurement.controlled import ControlledModel

#: codec statistics (errors, outlier channels) are taken on at most about this many elements
#: of a site's tensor: evenly spaced token rows (dim 0), every channel kept; the stored
#: bytes still come from the whole tensor's shape (`nbytes_for`)
SAMPLE_ELEMS = 1 << 14

#: megatron-core's core attention's forward: the names of its positional inputs
CORE_ARG_NAMES = ("query", "key", "value")


def token_sample(x: torch.Tensor) -> torch.Tensor:
    """Every k-th row of `x` along dim 0 (tokens in megatron's [s, b, ...] layout), k such
    that about `SAMPLE_ELEMS` elements remain; `x` itself when it is small."""
    if x.dim() < 2 or x.numel() <= SAMPLE_ELEMS:
        return x
    step = -(-x.numel() // SAMPLE_ELEMS)
    step = min(step, x.shape[0])
    return x[::step].contiguous() if step > 1 else x


@dataclass
class SiteSample:
    """One site's tensor in the training step: its shape, dtype and a token sample; where
    the codec in force has one scale per channel over the rows (`axis`, int4_channel), whose
    error a sample of the rows would understate, that codec's name with its expected error
    and the tensor's power on the whole tensor (float64 tensors, read at the boundary)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sample: torch.Tensor
    whole: Optional[tuple[str, torch.Tensor, torch.Tensor]] = None


def power_tensor(x: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the finite elements as a float64 tensor (no host sync)."""
    xf = x.detach().double()
    finite = torch.isfinite(xf)
    return torch.where(finite, xf, 0.0).pow(2).sum() / finite.sum().clamp(min=1)


def input_arg(site: str) -> Optional[int]:
    """The argument of the storing module that is `site`'s tensor (its "input" tag in its own
    slot), None where the schema names none."""
    spec = schema.SITE_OF[site]
    return next((t.arg for t in spec.tags if t.how == "input" and t.slot == spec.slot), None)


def submodule(root: Any, path: Optional[str]) -> Optional[torch.nn.Module]:
    """The submodule of `root` (a TransformerLayer) at the schema's dotted `path` (a
    `Site.slot` or `made_by`), None where there is none."""
    if root is None or not path:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


class StepTap:
    """While installed (`install` ... `remove`), records `samples` and the linears' c (see
    the module docstring) for the (layer, site) pairs of `controller`; `tapped`: the site
    types whose c the step's backward gives (`linear_tap.exact_for`), `params`/`groups`
    as `linear_tap.LinearTap` takes them."""

    def __init__(self, controller: ControlledModel, tapped: Sequence[str] = (),
                 params: Sequence[torch.Tensor] = (), groups: Optional[Sequence[str]] = None,
                 probe_codec: str = "int4"):
        self.controller = controller
        self.samples: dict[tuple[int, str], SiteSample] = {}
        self.linear = linear_tap.LinearTap(controller, tapped, params, probe_codec, groups, first_only=True)
        self.handles: list[Any] = []
        self.sample_seconds = 0.0

    @property
    def seconds(self) -> float:
        """Host time the tapped step spent in the tap's hooks: a tracking point's share of
        the training step (on a GPU the launches; the kernels they queue run with the step)."""
        return self.sample_seconds + self.linear.seconds

    def install(self) -> "StepTap":
        c = self.controller
        inputs: dict[int, tuple[torch.nn.Module, list]] = {}
        outputs: dict[int, tuple[torch.nn.Module, list]] = {}
        for layer in c.layers:
            for site in c.sites(layer):
                if site not in schema.SITE_OF or schema.SITE_OF[site].family == "moe":
                    continue
                arg = input_arg(site)
                module = c.module(layer, site) if arg is not None else submodule(
                    c.layer_modules.get(layer), schema.SITE_OF[site].made_by)
                if not isinstance(module, torch.nn.Module):
                    continue
                table = inputs if arg is not None else outputs
                table.setdefault(id(module), (module, []))[1].append(((layer, site), arg))
        for module, keys in inputs.values():
            self.handles.append(module.register_forward_pre_hook(self._pre(keys), with_kwargs=True))
        for module, keys in outputs.values():
            self.handles.append(module.register_forward_hook(self._post(keys)))
        self.linear.__enter__()
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.linear.__exit__(None, None, None)

    def _keep(self, key: tuple[int, str], x: Any) -> None:
        if key in self.samples or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        start = time.perf_counter()
        xd = x.detach()
        xs = token_sample(xd)
        whole = None
        codec = getattr(self.controller.module(*key), "act_codecs", {}).get(key[1])
        if getattr(codec, "axis", None) is not None and hasattr(codec, "expected_error_tensor"):
            whole = (codec.name, codec.expected_error_tensor(x), power_tensor(x))
        # a small tensor is its own sample: copied, as the step may still write to it in place
        self.samples[key] = SiteSample(tuple(x.shape), x.dtype, xs.clone() if xs is xd else xs, whole)
        self.sample_seconds += time.perf_counter() - start

    def _pre(self, keys: list):
        def pre(module, args, kwargs):
            for key, arg in keys:
                x = args[arg] if arg < len(args) else kwargs.get(CORE_ARG_NAMES[arg]) if arg < 3 else None
                self._keep(key, x)
        return pre

    def _post(self, keys: list):
        def post(module, args, out):
            y = out
            if isinstance(out, (tuple, list)):  # a linear's (output, bias): the sum is the site
                y = out[0]
                if len(out) > 1 and isinstance(out[1], torch.Tensor) and isinstance(y, torch.Tensor):
                    y = y + out[1]
            for key, _ in keys:
                self._keep(key, y)
        return post
