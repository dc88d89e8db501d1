"""GACT's gradient sensitivity c_i per site type (GACT sec. 4, Alg. 1) and its failure
prediction.

Linearising the gradient in the compression error (GACT eq. 3, Thm. 2), the noise a plan
adds to the gradient is V = sum over stored tensors l of c_l * S_l, where S_l is the
codec's error at tensor l. Here S is the codec's `expected_error` relative to the tensor's
power, mean(x^2) (for a few-bit site: of mean(f'(x)^2), the quantity it stores): the
units of the planner's prior, so that c_l carries the tensor's scale as GACT's c_l carries
its range R_l. Scaling a site's tensor by 10 with the gradient's Jacobian unchanged
multiplies c by 100.

Measuring c_i (Alg. 1, with every other tensor exact): one exact forward/backward pass, and
per site type one pass that differs from it only in the random draws of an unbiased
stochastic codec at site i (all layers at once: c_i is shared across identical blocks),
every other site kept, the same dropout masks (the RNG streams are rewound before each
pass). With g the probe's gradient and g0 the exact one, E||g - g0||^2 = tr Var_Q[g] = V_i
to first order, so

    c_i = ||g - g0||^2 / sum_l S_il,

S_il the probe codec's relative error on layer l's tensor. A linear's input needs no probe
pass: its c comes exactly from the exact pass's backward (`llm_act.measurement.linear_tap`).
The probe at a value site is stochastic INT4 (`int4`); at a few-bit site it is f'(x) plus Rademacher noise of the
fitted fewbit3 table's error, so S is in f' units there. Deterministic codecs (nearest
rounding, few-bit tables) enter the planner with their bias^2, which is what their
`expected_error` gives. The passes use `torch.autograd.grad` (no `.grad`, no `main_grad`,
no optimizer), rewind every RNG stream and never call the real codecs
(`llm_act.measurement.probing.isolated`).

Per parameter group (an optimizer that normalises each parameter, as Adam does): GACT
bounds the noise of the whole gradient, but Adam divides every parameter's update by that
parameter's own gradient scale, so a small group (a norm's weight) whose gradient the
codec drowns is hurt although the total looks fine. With `groups` (a group name per
parameter, `llm_act.measurement.fidelity.group_name`), c_i is measured per group G as well, and the
c the planner uses is the worst group's, each group's measured against its own sampling
noise and rescaled to the whole gradient's:

    c_i = max_G c_iG * samp / samp_G,

so "sum_i c_i S_i <= f * samp" implies "sum_i c_iG S_i <= f * samp_G" for every group G.
`Sensitivity.c_whole` keeps GACT's whole-gradient c.

Predicting failure (GACT sec. 4.2): the mini-batch sampling noise of the gradient is
estimated from the same batch split in halves, Var[g] ~ ||g_a - g_b||^2 / 4 (each half's
mean has twice the variance of the full batch's, and they are independent); when the
plan's predicted compression noise exceeds `warn_ratio` times that, `check_noise` warns,
naming the fix.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from llm_act.measurement.controlled import ControlledModel

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.fewbit import derivative
from llm_act.codecs.registry import FEWBIT_CODECS, make_codec
from llm_act.measurement import linear_tap, probing
from llm_act.measurement.head_cut import HeadCut
from llm_act.sites import ATTN_SOFTMAX, DEFAULT_CODECS, MASK_SITES, MLP_ACT_INPUT, SITES

#: the codec whose random draws measure c at value sites
PROBE_CODEC = "int4"


class CompressionNoiseWarning(UserWarning):
    """The compression noise is large against the mini-batch sampling noise."""


@dataclass
class Sensitivity:
    """One measurement: c per site type, the pieces it came from, and the sampling noise."""

    c: dict[str, float] = field(default_factory=dict)
    diff_sq: dict[str, float] = field(default_factory=dict)
    """||g_probe - g_exact||^2 per site type (at a tapped site: its expectation, c * probe_s)"""
    probe_s: dict[str, float] = field(default_factory=dict)
    """sum over layers of the probe's relative error S_il"""
    sampling_noise: Optional[float] = None
    """Var of the full-batch gradient from data sampling (None: batch of one)"""
    c_whole: dict[str, float] = field(default_factory=dict)
    """GACT's c of the whole gradient (equal to `c` without groups)"""
    sampling_by_group: dict[str, float] = field(default_factory=dict)
    """the sampling noise per parameter group (with groups)"""
    tapped: tuple[str, ...] = ()
    """site types whose c came from the exact pass's backward (`linear_tap`), not a probe"""
    coherence: dict[str, float] = field(default_factory=dict)
    """site type -> kappa of its biased codec (with `biased`): the squared gradient error it
    really adds over what GACT's model predicts for independent errors of its size"""


class _ValueProbe(Codec):
    """Stochastic INT4 at a value site, recording S (relative error) of every encode."""

    keeps_nonfinite = False  # the inner codec keeps them already

    def __init__(self, seed: int, record: list):
        super().__init__(seed)
        self.inner = make_codec(PROBE_CODEC, seed=seed)
        self.name = "probe"
        self.record = record

    def _encode(self, x: torch.Tensor) -> Encoded:
        power = float(x.detach().double().pow(2).mean()) or 1.0
        self.record.append(float(self.inner.expected_error(x)) / power)
        return self.inner.encode(x)

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.inner.decode(enc)


class _DerivativeProbe(Codec):
    """At a few-bit site: stores f'(x) + sigma * Rademacher noise (unbiased), sigma^2 the
    fewbit3 table's expected error on x; S = sigma^2 / mean(f'(x)^2)."""

    keeps_nonfinite = False  # it stores f'(x), not x, like the few-bit codec it stands for

    def __init__(self, seed: int, activation: str, record: list):
        super().__init__(seed)
        self.table_codec = make_codec("fewbit3", activation=activation)
        self.table = self.table_codec.table  # the MLP takes the few-bit path for it
        self.activation = activation
        self.name = "probe"
        self.record = record

    def _encode(self, x: torch.Tensor) -> Encoded:
        d = derivative(self.activation)(x.detach().float())
        var = max(float(self.table_codec.expected_error(x)), 1e-12)
        sign = torch.randint(0, 2, d.shape, generator=self.generator(x.device), device=x.device)
        noisy = d + math.sqrt(var) * (2.0 * sign.float() - 1.0)
        power = float(d.double().pow(2).mean()) or 1.0
        self.record.append(var / power)
        return self._record(x, d=noisy.to(x.dtype))

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.data["d"]


class _Recording(Codec):
    """A real codec at a site, recording its S (expected error over the power of what it
    stores: x, or f'(x) for a few-bit table) on every encode."""

    keeps_nonfinite = False  # the inner codec keeps them already

    def __init__(self, inner: Codec, activation: Optional[str], record: list):
        super().__init__(0)
        self.inner, self.activation, self.record = inner, activation, record
        self.name = inner.name
        if getattr(inner, "table", None) is not None:
            self.table = inner.table  # the MLP takes the few-bit path for it

    def _encode(self, x: torch.Tensor) -> Encoded:
        stored = derivative(self.activation)(x.detach().float()) if self.activation else x.detach()
        power = float(stored.double().pow(2).mean()) or 1.0
        self.record.append(float(self.inner.expected_error(x)) / power)
        return self.inner.encode(x)

    def decode(self, enc: Encoded) -> torch.Tensor:
        return self.inner.decode(enc)


def _probe(controller: ControlledModel, layer: int, site: str, seed: int, record: list) -> Codec:
    if site == MLP_ACT_INPUT and controller.accepts(layer, site, DEFAULT_CODECS[MLP_ACT_INPUT]):
        act = controller.module(layer, site).act_activation
        if isinstance(act, str) and act != "relu":
            return _DerivativeProbe(seed, act, record)
    return _ValueProbe(seed, record)


def sensitive_sites(controller: ControlledModel) -> list[str]:
    """Site types that carry noise when compressed (dropout masks never do; a ReLU MLP
    stores its activation as an exact 1-bit mask)."""
    out = []
    for layer in controller.layers:
        for site in controller.sites(layer):
            if site in MASK_SITES or site in out:
                continue
            if site == MLP_ACT_INPUT and controller.module(layer, site).act_activation == "relu":
                continue
            if site == ATTN_SOFTMAX and (controller.module(layer, site).act_attention or "stock") not in (
                    "stock", "unfused"):
                continue  # the memory-efficient attention stores no probabilities
            out.append(site)
    return out


def measure_sensitivity(controller: ControlledModel, forward: Callable[[], Any], params: Any, *,
                        sites: Optional[Sequence[str]] = None, seed: int = 0,
                        sampling: bool = True, groups: Optional[Sequence[str]] = None,
                        biased: Optional[dict[str, str]] = None, tap: bool = True,
                        head: Optional[torch.nn.Module] = None, signed: bool = False,
                        rows: Optional[tuple[int, int]] = None,
                        tapped_from: Optional[linear_tap.LinearTap] = None,
                        sampling_from: Optional[tuple[float, dict[str, float]]] = None) -> Sensitivity:
    """c_i for each site type in `sites` (default: all that carry noise) on the batch
    `forward()` runs (see the module docstring): one exact pass, which also gives c of every
    linear's input (`llm_act.measurement.linear_tap`), and one probe pass per other site type.
    `params`: the parameters whose gradient counts (a module, modules or tensors).
    `sampling`: also estimate the mini-batch sampling noise (needs a loss with a batch
    dimension of at least 2: `forward()` returning per-sample or per-token losses; one more
    pass, `sampling_halves`).
    `groups`: a parameter-group name per parameter: c becomes the worst group's, each
    against its own sampling noise (needs `sampling`).
    `biased`: site type -> a biased codec (nearest rounding, few-bit) whose coherence kappa
    is measured at that site (one pass per site with that codec in every layer):
    kappa = ||g_codec - g_exact||^2 / (c_whole * sum_l S_l). Stochastic rounding gives 1 in
    expectation; an error that is the same on every token adds up in a weight gradient and
    gives more. Sites whose c is not measured here are skipped; every rank runs the same
    passes. `tap=False` probes the linears' inputs too (to check the tap against the probe).
    `head`: the model's output layer: every pass after the exact one starts its backward
    below it (`llm_act.measurement.head_cut`; the same gradients, without the head's cost).
    `signed`: every pass backpropagates the difference of the batch's two halves' mean
    losses (`signed_loss`) instead of their mean: the exact pass's gradient is then
    g_a - g_b, whose ||.||^2 / 4 is the sampling noise, so no pass of its own is run for it;
    a probe's error enters with the sign of its row, which leaves E||g - g0||^2 unchanged
    for errors independent across rows (four times the unsigned one's: `SIGNED_GAIN`), and
    a linear's c the same. A biased codec's coherence (errors alike across rows, which the
    signs would cancel) needs the plain passes: `biased` is refused with `signed`.
    `rows`: (the rows `forward()` runs, the rows of the whole batch), where the closure runs
    the first rows of the batch alone (`StepReplay.probe(rows=...)`): every figure is
    scaled to the whole batch (`scale_rows`).
    `tapped_from`: a `LinearTap` that recorded the training step itself (`StepTap`): the
    linears' inputs take their c from it, the step's own backward over the whole batch, and
    the passes tap nothing.
    `sampling_from`: (the sampling noise, per group) a measurement without sampling uses
    for the worst group's c (an earlier one's: a round of plain passes has none)."""
    params = probing.params_of(params)
    if not params:
        raise ValueError("params: no trainable parameter given")
    if groups is not None and len(groups) != len(params):
        raise ValueError(f"groups: expected one name per parameter ({len(params)}), got {len(groups)}")
    if signed and biased:
        raise ValueError("biased: a coherence needs the unsigned passes (signed=False)")
    sites = list(sensitive_sites(controller) if sites is None else sites)
    tapped = [site for site in sites if tap and linear_tap.exact_for(controller, site)]
    stepped = [site for site in tapped if tapped_from is not None and site in tapped_from.sites
               and site not in (biased or {})]
    tapped = [site for site in tapped if site not in stepped]
    out = Sensitivity(tapped=tuple(tapped + stepped))
    per_group: dict[str, dict[str, float]] = {}
    with probing.isolated(controller, params) as snap, torch.enable_grad():
        tap = linear_tap.LinearTap(controller, tapped, params, PROBE_CODEC, groups, biased=biased, seed=seed)
        loss_of = signed_loss if signed else batch_loss
        passes = HeadCut(head, params, loss_of, per_row_losses)
        probing.install(controller, {})
        snap.restore()
        with tap:
            exact = passes.exact(forward, halves=sampling and not signed)
        gain = SIGNED_GAIN if signed and passes.signed_rows else 1.0
        if signed and not passes.signed_rows:
            sampling = False  # a batch of one: nothing to sign, the plain mean was used
        c, s_sum, by_group = tap.results()
        for site in tapped:
            out.c[site], out.probe_s[site] = c[site] / gain, s_sum[site]
            out.diff_sq[site] = c[site] * s_sum[site]
            per_group[site] = {g: v / gain for g, v in by_group[site].items()}
        for site in sites:
            if site in out.c or site in stepped:
                continue
            record: list[float] = []
            probes = {
                (layer, site): _probe(controller, layer, site, seed * 1_000_003 + 7919 * SITES.index(site) + layer, record)
                for layer in controller.layers if site in controller.sites(layer)
            }
            snap.restore()
            probing.install(controller, probes)
            grad = passes.again(forward)
            d2, total_s = probing.sq_distance(grad, exact), sum(record)
            out.diff_sq[site] = d2
            out.probe_s[site] = total_s
            out.c[site] = d2 / (gain * total_s) if total_s > 0 else 0.0
            if groups is not None and total_s > 0:
                per_group[site] = {g: v / (gain * total_s)
                                   for g, v in probing.sq_by_group(grad, exact, groups).items()}
            del grad
        # every rank runs the same passes (the forwards hold collectives): no filter on local values
        out.coherence = tap.coherence(out.c)
        todo = {site: name for site, name in (biased or {}).items() if site in out.c and site not in tapped}
        if todo:
            out.coherence.update(_coherence(controller, forward, passes, snap, todo, out.c, seed, exact))
        if sampling and signed:  # the exact pass's gradient is g_a - g_b
            out.sampling_noise = probing.sq_distance(exact, None) / 4.0
            if groups is not None:
                out.sampling_by_group = {g: v / 4.0 for g, v in probing.sq_by_group(exact, None, groups).items()}
        elif sampling:
            probing.install(controller, {})
            snap.restore()
            halves = passes.half(forward, exact, lambda: sampling_halves(forward, params, snap, exact))
            if halves is not None:
                out.sampling_noise = probing.sq_distance(*halves) / 4.0
                if groups is not None:
                    by_half = probing.sq_by_group(halves[0], halves[1], groups)
                    out.sampling_by_group = {g: v / 4.0 for g, v in by_half.items()}
    if rows is not None:
        scale_rows(out, per_group, *rows)
    if stepped:  # the training step's own figures: the whole batch, unsigned
        c, s_sum, by_group = tapped_from.results()
        for site in stepped:
            out.c[site], out.probe_s[site] = c[site], s_sum[site]
            out.diff_sq[site] = c[site] * s_sum[site]
            per_group[site] = dict(by_group[site])
    out.c_whole = dict(out.c)
    samp, samp_groups = ((out.sampling_noise, out.sampling_by_group) if out.sampling_noise
                         else sampling_from or (None, {}))
    if per_group and samp:
        out.c = {site: worst_group(per_group.get(site), samp_groups, samp, c) for site, c in out.c.items()}
    return out


#: E||g_probe - g_exact||^2 of the signed passes (`signed_loss`) over the unsigned ones'
#: (`batch_loss`), for errors independent across rows: each half's mean enters whole, where
#: the plain mean takes half of each (2^2), and the halves' errors add independently
SIGNED_GAIN = 4.0


def scale_rows(out: Sensitivity, per_group: dict[str, dict[str, float]], measured: int, whole: int) -> None:
    """Scale the figures of a measurement on the first `measured` of `whole` rows to the
    whole batch. The replay weights every row as in the whole batch, so the gradient is
    the sum of the measured rows' shares: its error from independent row errors, and its
    sampling variance, grow with the rows (x whole / measured). A biased codec's
    coherence also grows with the rows its error is alike across; the measurement cannot
    tell rows from tokens there, so it is extrapolated as if all of kappa's excess over 1
    came from pairs of rows (the largest it can be): 1 + (kappa - 1) (whole - 1) / (measured - 1)."""
    if measured >= whole or measured < 1:
        return
    f = whole / measured
    out.c = {k: v * f for k, v in out.c.items()}
    out.diff_sq = {k: v * f for k, v in out.diff_sq.items()}
    for site, groups in per_group.items():
        per_group[site] = {g: v * f for g, v in groups.items()}
    if out.sampling_noise is not None:
        out.sampling_noise *= f
    out.sampling_by_group = {g: v * f for g, v in out.sampling_by_group.items()}
    if measured > 1:
        out.coherence = {k: (1.0 + (v - 1.0) * (whole - 1) / (measured - 1)) if v > 1.0 else v
                         for k, v in out.coherence.items()}


def _coherence(controller: ControlledModel, forward: Callable[[], Any], passes: HeadCut,
               snap: probing.RngSnapshot,
               biased: dict[str, str], c: dict[str, float], seed: int,
               exact: list[torch.Tensor]) -> dict[str, float]:
    """kappa per site of `biased` (see `measure_sensitivity`), against `c` (whole gradient)
    and the exact pass's gradient `exact` (`passes` ran it: `HeadCut.again` after it)."""
    out = {}
    for site, name in biased.items():
        record: list[float] = []
        codecs = {}
        for layer in controller.layers:
            if site not in controller.sites(layer) or not controller.accepts(layer, site, name):
                continue  # (`Measurements.charged_codecs` names only codecs every layer takes)
            act = controller.module(layer, site).act_activation if site == MLP_ACT_INPUT else None
            act = act if isinstance(act, str) and name in FEWBIT_CODECS else None
            inner = make_codec(name, seed=seed + 7919 * layer, activation=act or "gelu")
            codecs[(layer, site)] = _Recording(inner, act, record)
        snap.restore()
        probing.install(controller, codecs)
        grad = passes.again(forward)
        d2, s_sum = probing.sq_distance(grad, exact), sum(record)
        if c[site] > 0 and s_sum > 0:  # else nothing to scale: this rank reports no kappa there
            out[site] = d2 / (c[site] * s_sum)
        del grad
    return out


def worst_group(c_by_group: Optional[dict[str, float]], sampling_by_group: dict[str, float],
                sampling: float, whole: float) -> float:
    """max over groups G of c_iG * samp / samp_G (groups with no sampling noise left out),
    and never less than the whole gradient's c."""
    worst = whole
    for g, c in (c_by_group or {}).items():
        s = sampling_by_group.get(g, 0.0)
        if s > 0 and math.isfinite(c):
            worst = max(worst, c * sampling / s)
    return worst


def per_row_losses(out: Any) -> Optional[torch.Tensor]:
    """The mean loss of each row of the batch `forward()` returned (a loss tensor, or a tuple
    led by one, with the batch first), None for a scalar or a batch of one."""
    loss = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(loss, torch.Tensor) or loss.dim() == 0 or loss.shape[0] < 2:
        return None
    return loss.float().reshape(loss.shape[0], -1).mean(dim=1)


def signed_loss(out: Any) -> torch.Tensor:
    """The mean loss of the batch's first half minus that of its second (`sampling_halves`'
    halves): its gradient is g_a - g_b (see `measure_sensitivity`'s `signed`); the plain
    `batch_loss` for a batch of one."""
    per = per_row_losses(out)
    if per is None:
        return probing.scalar_loss(out)
    half = per.shape[0] // 2
    return per[:half].mean() - per[half:2 * half].mean()


def batch_loss(out: Any) -> torch.Tensor:
    """The loss every exact and probe pass backpropagates: the mean of the per-row losses
    over the two halves `sampling_halves` splits the batch into (the first 2 * (b // 2)
    rows: the exact pass's gradient is then the mean of the halves'), or the mean of
    everything for a batch of one (`probing.scalar_loss`)."""
    per = per_row_losses(out)
    if per is None:
        return probing.scalar_loss(out)
    return per[:2 * (per.shape[0] // 2)].mean()


def sampling_halves(forward: Callable[[], Any], params: list[torch.Tensor], snap: probing.RngSnapshot,
                    whole: list[torch.Tensor]) -> Optional[list[list[torch.Tensor]]]:
    """The gradients of the two halves of the batch, each scaled as a full batch's, given
    `whole`, the exact pass's gradient of `batch_loss` (the halves' mean): one forward for
    half a, and g_b = 2 * whole - g_a (the loss is linear in the per-row losses; one
    forward per pass, as some losses -- megatron's cross entropy -- cannot backpropagate
    twice). ||g_a - g_b||^2 / 4 is the sampling noise. None for a batch of one."""
    snap.restore()
    out = forward()
    per = per_row_losses(out)
    if per is None:
        return None
    half = per.shape[0] // 2
    g_a = probing.optional_grad(per[:half].mean(), params)
    del out, per
    return [g_a, [2.0 * w - a for w, a in zip(whole, g_a)]]


def check_noise(noise: float, sampling_noise: Optional[float], warn_ratio: float = 1.0,
                where: str = "") -> Optional[float]:
    """Warn (`CompressionNoiseWarning`) when the predicted compression noise `noise` is more
    than `warn_ratio` times the sampling noise; returns the ratio (None if unknown)."""
    if sampling_noise is None or not math.isfinite(noise):
        return None
    ratio = noise / sampling_noise if sampling_noise > 0 else (math.inf if noise > 0 else 0.0)
    if ratio > warn_ratio:
        warnings.warn(
            f"activation compression adds gradient noise {noise:.3g}, {ratio:.3g}x the mini-batch "
            f"sampling noise {sampling_noise:.3g}{where}: training may converge worse (GACT sec. 4.2). "
            "Fix: give the sensitive sites more bits (a larger memory budget, or codecs such as "
            "int8 / outlier_int4 instead of int2 / int1 there), or set a smaller "
            "ActConfig.variance_budget so the planner bounds the noise.",
            CompressionNoiseWarning, stacklevel=2,
        )
    return ratio
