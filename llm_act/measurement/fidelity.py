"""Gradient fidelity: the compressed gradient against the exact one, on one micro-batch.

How a user trusts compression on a model we never tested: every `ActConfig.fidelity_every`
iterations (and on demand, `Controller.request_fidelity()`), the micro-batch of that
training step is run again from the same state, once with every site exact and once with
the plan in force, and the relative error ||g_plan - g_exact|| / ||g_exact|| is reported:

- per parameter group (a parameter's name with the layer index taken out, so
  `decoder.layers.*.mlp.linear_fc1.weight` gathers fc1's weight of every layer) and in total;
- per site type, for `SITES_PER_REPORT` lossy site types in rotation: the error with only
  that site compressed (its codec of the plan in every layer), the rest exact;
- the gradient-noise ratio (GACT's criterion, the one plan "auto" holds to a budget): the
  compression's squared error ||g_plan - g_exact||^2 over the mini-batch sampling variance
  of the gradient, ||g_a - g_b||^2 / 4 from the batch's two halves
  (`llm_act.measurement.sensitivity.sampling_halves`), per parameter group and in total.
  Below 1 the compression adds less noise than drawing another batch does.

Both passes run inside `llm_act.measurement.probing.isolated` with the RNG streams rewound before each,
so they draw the same dropout masks and differ only by the codecs; the plan's codecs are
fresh instances (the real ones and their generators are never touched), sites the plan
recomputes are run exact (recomputation reproduces them bit for bit). A "keep" plan
therefore reports exactly 0, and a codec made worse reports more.

The report is logged (`llm_act.measurement.fidelity`), kept in `Adapter.fidelity` (the last
`HISTORY` reports, checkpointed with the controller) and summed over ranks: squared errors
and squared norms are averaged over the ranks that hold a group before the ratio is taken.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from llm_act.measurement.controlled import ControlledModel

from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.measurement import probing
from llm_act.measurement.head_cut import HeadCut
from llm_act.measurement.sensitivity import batch_loss, per_row_losses, sampling_halves
from llm_act.sites import MASK_SITES

log = logging.getLogger(__name__)

#: lossy site types measured alone per report (each costs one more forward/backward)
SITES_PER_REPORT = 1
#: reports kept in the controller's state
HISTORY = 64
_LAYER_INDEX = re.compile(r"\.(layers|h|blocks)\.\d+\.")
_WRAPPERS = re.compile(r"^(module\.)+")


def group_name(name: str) -> str:
    """The parameter group of `name`: the layer index replaced by `*`, wrappers' `module.`
    prefixes dropped (`module.decoder.layers.3.mlp.linear_fc1.weight` ->
    `decoder.layers.*.mlp.linear_fc1.weight`)."""
    return _LAYER_INDEX.sub(lambda m: f".{m.group(1)}.*.", _WRAPPERS.sub("", name))


def named_params(roots: Sequence[torch.nn.Module], fallback: Sequence[torch.Tensor] = ()
                 ) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every trainable parameter of `roots` (several roots, e.g.
    virtual pipeline chunks, are told apart by a `chunkN.` prefix), else of `fallback`."""
    out, seen = [], set()
    for i, root in enumerate(roots):
        prefix = f"chunk{i}." if len(roots) > 1 else ""
        for name, p in root.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + name, p))
    if not out:
        out = [(f"param{i}", p) for i, p in enumerate(fallback) if p.requires_grad]
    return out


def lossy_sites(plan: dict[int, dict[str, str]],
                sites_of: Optional[Callable[[int], Sequence[str]]] = None) -> list[str]:
    """Site types some layer stores with a lossy codec (masks are stored exactly);
    with `sites_of` (layer -> the sites it has, `Controller.sites`), only sites the layers
    have: a plan names every site of the schema (the MoE's and the final norm's in every
    layer), and a report's pass on a site no layer has would measure nothing."""
    out: list[str] = []
    for layer, choice in plan.items():
        present = None if sites_of is None else set(sites_of(layer))
        for site, name in choice.items():
            if present is not None and site not in present:
                continue
            if name not in (KEEP, RECOMPUTE) and site not in MASK_SITES and site not in out:
                out.append(site)
    return out


def plan_codecs(controller: ControlledModel, plan: dict[int, dict[str, str]], seed: int,
                only: Optional[str] = None) -> dict[tuple[int, str], Any]:
    """Fresh codecs of `plan` for `probing.install` (recomputed sites exact); with `only`,
    that site type alone."""
    codecs = {}
    for layer in controller.layers:
        for site in controller.sites(layer):
            name = plan.get(layer, {}).get(site, KEEP)
            if name in (KEEP, RECOMPUTE) or (only is not None and site != only):
                continue
            codecs[(layer, site)] = controller.new_codec(layer, site, name, seed + 7919 * layer + 104_729 * len(codecs))
    return codecs


def measure_sums(controller: ControlledModel, forward: Callable[[], Any], named: list[tuple[str, torch.Tensor]],
                 plan: dict[int, dict[str, str]], sites: Sequence[str] = (), seed: int = 0,
                 head: Optional[torch.nn.Module] = None,
                 sampling: Optional[dict[str, float]] = None) -> dict[str, float]:
    """The squared sums a report is made of, as one flat mapping (so ranks can combine it):
    `err:<group>` ||g_plan - g_exact||^2 and `norm:<group>` ||g_exact||^2 per parameter
    group, `samp:<group>` its sampling variance (none for a batch of one), and
    `site:<site>` the total ||g_site - g_exact||^2 with only that site type compressed, for
    each of `sites`. `head`: the output layer, below which every pass after the exact one
    starts its backward (`llm_act.measurement.head_cut`). `sampling`: the sampling variance
    per group, measured already (plan "auto" measures it at its tracking points) in the
    units of the batch `forward()` runs: the halves' pass is then not run."""
    params = [p for _, p in named]
    groups = [group_name(n) for n, _ in named]
    out: dict[str, float] = {}
    passes = HeadCut(head, params, batch_loss, per_row_losses)

    def again(codecs: dict) -> list[torch.Tensor]:
        snap.restore()
        probing.install(controller, codecs)
        return passes.again(forward)

    with probing.isolated(controller, params) as snap, torch.enable_grad():
        snap.restore()
        probing.install(controller, {})
        exact = passes.exact(forward, halves=True)
        out.update({f"norm:{g}": v for g, v in probing.sq_by_group(exact, None, groups).items()})
        comp = again(plan_codecs(controller, plan, seed))
        out.update({f"err:{g}": v for g, v in probing.sq_by_group(comp, exact, groups).items()})
        del comp
        if sampling:
            out.update({f"samp:{g}": v for g, v in sampling.items() if g in set(groups)})
        else:
            probing.install(controller, {})
            snap.restore()
            halves = passes.half(forward, exact, lambda: sampling_halves(forward, params, snap, exact))
            if halves is not None:
                out.update({f"samp:{g}": v / 4.0 for g, v in probing.sq_by_group(*halves, groups).items()})
            del halves
        for site in sites:
            alone = again(plan_codecs(controller, plan, seed + 1, only=site))
            out[f"site:{site}"] = probing.sq_distance(alone, exact)
            del alone
    return out


@dataclass
class FidelityReport:
    """Relative gradient errors of the plan in force at `iteration`."""

    iteration: int
    total: float
    groups: dict[str, float] = field(default_factory=dict)
    sites: dict[str, float] = field(default_factory=dict)
    """site type -> error with that site alone compressed (measured at this report)"""
    noise_ratio: Optional[float] = None
    """compression's squared gradient error over the sampling variance, whole gradient
    (None: the batch had one sample)"""
    noise_ratios: dict[str, float] = field(default_factory=dict)
    """the same per parameter group"""
    rows: Optional[tuple[int, int]] = None
    """(rows measured, rows of the batch) where the report replayed the batch's first rows
    (plan "auto"); None: the whole batch. Errors that average out over rows are larger on
    fewer, so such a report errs on the high side"""
    shares: dict[str, float] = field(default_factory=dict)
    """parameter group -> its share of the whole gradient's squared error (summing to 1 where
    there is any error): where the error sits, which a group's relative error does not say (a
    norm's weight can be off by 100% and hold a thousandth of the error)"""

    @classmethod
    def from_sums(cls, iteration: int, sums: dict[str, float],
                  rows: Optional[tuple[int, int]] = None) -> "FidelityReport":
        norm = {k[5:]: v for k, v in sums.items() if k.startswith("norm:")}
        err = {k[4:]: v for k, v in sums.items() if k.startswith("err:")}
        whole = sum(norm.values())
        groups = {g: _rel(err.get(g, 0.0), n) for g, n in norm.items()}
        sites = {k[5:]: _rel(v, whole) for k, v in sums.items() if k.startswith("site:")}
        samp = {k[5:]: v for k, v in sums.items() if k.startswith("samp:")}
        ratios = {g: _ratio(err.get(g, 0.0), v) for g, v in samp.items()}
        total = _ratio(sum(err.values()), sum(samp.values())) if samp else None
        err_all = sum(err.values())
        shares = {g: _ratio(err.get(g, 0.0), err_all) for g in norm} if err_all != 0 else {}  # NaN stays NaN
        return cls(iteration, _rel(err_all, whole), groups, sites, total, ratios,
                   None if rows is None else (int(rows[0]), int(rows[1])), shares)

    def to_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "total": self.total, "groups": dict(self.groups),
                "sites": dict(self.sites), "noise_ratio": self.noise_ratio,
                "noise_ratios": dict(self.noise_ratios), "rows": None if self.rows is None else list(self.rows),
                "shares": dict(self.shares)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FidelityReport":
        ratio, rows = d.get("noise_ratio"), d.get("rows")
        return cls(int(d["iteration"]), float(d["total"]), dict(d.get("groups", {})), dict(d.get("sites", {})),
                   None if ratio is None else float(ratio), dict(d.get("noise_ratios", {})),
                   None if rows is None else (int(rows[0]), int(rows[1])), dict(d.get("shares", {})))

    def format(self, worst: int = 5) -> str:
        """One line: the total, the worst parameter groups and the measured sites."""
        top = sorted(self.groups.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)
        parts = [f"{g} {v:.3g}" for g, v in top[:worst]]
        on = "" if self.rows is None else f" on the first {self.rows[0]} of {self.rows[1]} rows"
        line = (f"gradient fidelity at iteration {self.iteration}{on}: relative error {self.total:.3g} "
                f"(worst groups: {', '.join(parts) or 'none'})")
        if self.noise_ratio is not None:
            line += f"; {self.format_noise(worst)}"
        if self.sites:
            line += "; alone: " + ", ".join(f"{s} {v:.3g}" for s, v in self.sites.items())
        return line

    def format_noise(self, worst: int = 3) -> str:
        """The gradient-noise ratio: total and the worst parameter groups."""
        top = sorted(self.noise_ratios.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)
        return (f"gradient-noise ratio (compression / sampling variance) {self.noise_ratio:.3g} (worst groups: "
                + ", ".join(f"{g} {v:.3g}" for g, v in top[:worst]) + ")")


def _rel(err2: float, norm2: float) -> float:
    """sqrt(err2 / norm2); 0 when both are 0, inf for an error on a zero gradient, NaN
    stays NaN."""
    return math.sqrt(_ratio(err2, norm2))


def _ratio(num: float, den: float) -> float:
    """num / den of two squared norms; 0 when both are 0, inf for a positive num over 0,
    NaN stays NaN."""
    if den == 0.0:
        return 0.0 if num == 0.0 else (math.inf if num > 0 else math.nan)
    return num / den


def latest_sites(reports: Sequence[FidelityReport]) -> dict[str, tuple[int, float]]:
    """site type -> (iteration, error) of its latest measurement over `reports`."""
    out: dict[str, tuple[int, float]] = {}
    for r in reports:
        for site, v in r.sites.items():
            out[site] = (r.iteration, v)
    return out
