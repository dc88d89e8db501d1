"""GACT's sensitivity of a linear's input, read off one exact backward (no probe pass).

A linear y = x W^T uses its saved input only for its weight's gradient, dW = dy^T x; the
input's own gradient needs the weight alone. A codec error e stored in place of x therefore
adds dy^T e to that one gradient and nothing else, and for errors independent across
elements with a relative error S uniform over a token's elements (variance S ||x_t||^2 / d
on each of token t's d elements: what per-group rounding along the hidden dimension gives),

    E ||dy^T e||^2 = S * sum_t ||dy_t||^2 ||x_t||^2 = S * c_l,

with dy the gradient the backward hands the linear. For tokens of equal power, c_l is
mean(x^2) * d * ||dy||^2. This is exact where the probe (`llm_act.measurement.sensitivity`)
estimates the same quantity from random draws; one backward gives it for every linear
input of every layer at once, where each probed site type costs a forward/backward pass.

The planner's c of a site type is shared by its layers: as the probe measures it,
c_i = sum_l S_l c_l / sum_l S_l, S_l the probe codec's relative error (stochastic INT4) on
layer l's tensor; per parameter group G, the sum runs over the layers whose weight is in G.

Not tapped (the probe measures them): linears under sequence parallelism (their saved
input is a token shard of the gathered input their weight gradient reads), and any holder
that is not a dense 2-D linear (the MoE experts).
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from llm_act.codecs.registry import make_codec
from llm_act.measurement.controlled import ControlledModel
from llm_act.sites import SITE_OF

#: schema holders whose site is the input of a dense linear
_LINEAR_HOLDERS = ("column", "row")


def exact_for(controller: ControlledModel, site: str) -> bool:
    """Whether c at `site` comes from the tap: a linear's input in every layer that has it,
    a 2-D weight, no sequence parallelism."""
    spec = SITE_OF.get(site)
    if spec is None or spec.holder not in _LINEAR_HOLDERS:
        return False
    modules = [controller.module(layer, site) for layer in controller.layers if site in controller.sites(layer)]
    return bool(modules) and all(_dense_linear(m) for m in modules)


def _dense_linear(module: Any) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2
            and not getattr(module, "sequence_parallel", False))


class LinearTap:
    """While entered, records c_l and the probe codec's S_l of every (layer, site) in
    `sites` from the passes that run (forward hooks on the linears, tensor hooks on their
    outputs). `params`/`groups`: the parameters whose gradient counts and a group name per
    parameter (a weight not among them adds nothing). `first_only`: each linear's first
    forward that records for backward counts, later ones (more micro-batches of a training
    step) not."""

    def __init__(self, controller: ControlledModel, sites: Sequence[str], params: Sequence[torch.Tensor],
                 probe_codec: str, groups: Optional[Sequence[str]] = None,
                 biased: Optional[dict[str, str]] = None, seed: int = 0, first_only: bool = False):
        self.sites = tuple(sites)
        self.first_only = first_only
        self.targets = {(layer, site): controller.module(layer, site)
                        for site in self.sites for layer in controller.layers if site in controller.sites(layer)}
        names = groups if groups is not None else [""] * len(params)
        self.group_of = {id(p): g for p, g in zip(params, names)}
        self.probe = make_codec(probe_codec)
        self.c_l: dict[tuple[int, str], torch.Tensor] = {}
        self.s_l: dict[tuple[int, str], float] = {}
        # a biased codec's error at a linear input, dy^T (Q(x) - x), is its exact weight-gradient
        # error: the coherence numerator (`sensitivity._coherence`) with no pass of its own
        self.biased = {key: make_codec(biased[key[1]], seed=seed + 7919 * key[0])
                       for key in self.targets if key[1] in (biased or {})}
        self.biased_s: dict[tuple[int, str], float] = {}
        self.biased_d2: dict[tuple[int, str], torch.Tensor] = {}
        self.handles: list[Any] = []
        self.seconds = 0.0
        """host time spent in the hooks (what a training step the tap records pays for it)"""

    def __enter__(self) -> "LinearTap":
        for key, module in self.targets.items():
            self.handles.append(module.register_forward_hook(self._hook(key)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, key: tuple[int, str]):
        def forward_hook(module: Any, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            y = output[0] if isinstance(output, (tuple, list)) else output
            if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and y.requires_grad and y.shape[:-1] == x.shape[:-1]):
                return  # a forward without grad (a checkpoint's first pass) stores nothing
            if self.first_only and key in self.s_l:
                return
            start = time.perf_counter()
            xd = x.detach()
            token_power = xd.double().pow(2).sum(dim=-1)
            # tensors until `results` (no host sync inside a training step: `StepTap`)
            power = token_power.sum() / max(1, xd.numel())  # mean(x^2)
            as_tensor = getattr(self.probe, "expected_error_tensor", None)
            err = as_tensor(xd) if as_tensor is not None else torch.tensor(
                float(self.probe.expected_error(xd)), dtype=torch.float64, device=xd.device)
            self.s_l[key] = torch.where(power > 0, err / power.clamp_min(1e-300), torch.zeros_like(err))
            codec = self.biased.get(key)
            if codec is not None:
                p = float(power)
                self.biased_s[key] = float(codec.expected_error(xd)) / p if p > 0 else 0.0

            def on_grad(dy: torch.Tensor) -> None:
                begin = time.perf_counter()
                dy = dy.detach()
                c = (dy.double().pow(2).sum(dim=-1) * token_power).sum()
                self.c_l[key] = self.c_l.get(key, 0.0) + c
                if codec is not None:  # x is held by the linear's own backward: no extra copy
                    err = codec.decode(codec.encode(xd)).float() - xd.float()
                    dw = dy.reshape(-1, dy.shape[-1]).float().t() @ err.reshape(-1, err.shape[-1])
                    self.biased_d2[key] = self.biased_d2.get(key, 0.0) + dw.double().pow(2).sum()
                self.seconds += time.perf_counter() - begin

            y.register_hook(on_grad)
            self.seconds += time.perf_counter() - start
        return forward_hook

    def _weight_group(self, key: tuple[int, str]) -> Optional[str]:
        weight = getattr(self.targets[key], "weight", None)
        return self.group_of.get(id(weight)) if weight is not None else None

    def coherence(self, c: dict[str, float]) -> dict[str, float]:
        """kappa of each biased codec against the whole gradient's `c`, as
        `sensitivity._coherence` defines it: sum_l ||dy_l^T e_l||^2 / (c * sum_l S_l)."""
        out = {}
        for site in {key[1] for key in self.biased}:
            keys = [k for k in self.biased if k[1] == site]
            d2 = sum(float(self.biased_d2[k]) for k in keys if k in self.biased_d2 and self._weight_group(k) is not None)
            s_sum = sum(self.biased_s.get(k, 0.0) for k in keys)
            if c.get(site, 0.0) > 0 and s_sum > 0:
                out[site] = d2 / (c[site] * s_sum)
        return out

    def results(self) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, float]]]:
        """(c per site, sum_l S_l per site, c per site per weight group), as the probe's."""
        c: dict[str, float] = {}
        s_sum: dict[str, float] = {}
        by_group: dict[str, dict[str, float]] = {}
        for site in self.sites:
            keys = [k for k in self.targets if k[1] == site]
            total_s = sum(float(self.s_l.get(k, 0.0)) for k in keys)
            s_sum[site] = total_s
            groups: dict[str, float] = {}
            for k in keys:
                g = self._weight_group(k)
                if g is None or k not in self.c_l:
                    continue
                groups[g] = groups.get(g, 0.0) + float(self.s_l.get(k, 0.0)) * float(self.c_l[k])
            noise = sum(groups.values())
            c[site] = noise / total_s if total_s > 0 else 0.0
            by_group[site] = {g: v / total_s for g, v in groups.items()} if total_s > 0 else {}
        return c, s_sum, by_group
