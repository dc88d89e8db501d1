"""Agreement across ranks: every rank of a job must switch to the same plan at the same
iteration (design brief, "Distributed rules").

- A recomputed region holds tensor-parallel collectives, and ZeRO-3 gathers parameters
  inside recomputation: mismatched plans between TP or DP ranks would hang or diverge.
- So the statistics each rank measured are reduced first -- over the ranks of the same
  pipeline stage (its TP and DP ranks: they hold the same layers) for the profile, over
  every rank for the per-site-type sensitivities (site types are shared across stages) --
  then one rank per stage solves and broadcasts its decision (`broadcast_object_list`).
  Each stage plans with its own layers and micro-batches in flight.
- Reductions: stored bytes by max (a plan must fit the rank that stores most), times,
  errors, outlier rates and sensitivities by mean, budgets by min.

With megatron-core's parallel state initialised its groups are used (the stage group is
`get_tensor_and_data_parallel_group()`); otherwise the whole `torch.distributed` world is
one stage. Without torch.distributed (or with one rank) every function is the identity.
Statistics travel as small Python objects (`all_gather_object`): a few hundred numbers per
tracking point, so no tensor layout has to agree between ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch


@dataclass
class Groups:
    """The process groups agreement uses (None = the default world group)."""

    stage: Any = None
    """ranks of this pipeline stage (TP x DP): profile statistics, plan broadcast"""
    world: Any = None
    """every rank: site-type sensitivities, the sampling noise"""
    src: int = 0
    """global rank that solves and broadcasts for this stage"""


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _megatron_state():
    """megatron-core's `parallel_state` when it is installed and initialised, else None."""
    try:
        from megatron.core import parallel_state as ps

        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # megatron-core absent
        return None


def groups() -> Optional[Groups]:
    """The groups of this job, or None when running alone."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return None
    ps = _megatron_state()
    if ps is not None:
        stage = ps.get_tensor_and_data_parallel_group()
        return Groups(stage=stage, world=None, src=dist.get_global_rank(stage, 0))
    return Groups(stage=None, world=None, src=0)


def data_parallel_rank() -> int:
    """This rank's index among the data-parallel replicas: megatron's DP rank when its
    parallel state is up, else the torch.distributed rank (a job without model
    parallelism: DDP, ZeRO), 0 when running alone."""
    dist = _dist()
    if dist is None:
        return 0
    ps = _megatron_state()
    return int(ps.get_data_parallel_rank() if ps is not None else dist.get_rank())


def gather(obj: Any, group: Any = None) -> list[Any]:
    """`obj` of every rank of `group` (a list in rank order)."""
    dist = _dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def reduce_dict(values: Mapping[Any, float], op: str, group: Any = None) -> dict[Any, float]:
    """Combine `{key: number}` of every rank of `group` by `op` ("max", "min", "mean"); a
    key some ranks lack is combined over the ranks that have it."""
    if op not in ("max", "min", "mean"):
        raise ValueError(f"op: expected 'max', 'min' or 'mean', got {op!r}")
    parts = gather(dict(values), group)
    keys = sorted({k for p in parts for k in p}, key=repr)
    out = {}
    for k in keys:
        vals = [float(p[k]) for p in parts if k in p]
        out[k] = max(vals) if op == "max" else min(vals) if op == "min" else sum(vals) / len(vals)
    return out


def broadcast(obj: Any, g: Optional[Groups]) -> Any:
    """`obj` of the stage's source rank, on every rank of the stage."""
    dist = _dist()
    if dist is None or g is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=g.src, group=g.stage)
    return box[0]


def is_source(g: Optional[Groups]) -> bool:
    dist = _dist()
    return dist is None or g is None or dist.get_rank() == g.src


def agree_profile(profile: Any, g: Optional[Groups]) -> Any:
    """Reduce a `MeasuredProfile` in place over the stage (bytes max, errors, outlier rates
    and times mean) and return it."""
    if g is None:
        return profile
    ints, means = {}, {}
    for (layer, site), st in profile.sites.items():
        ints[(layer, site, "keep")] = st.keep_bytes
        means[(layer, site, "outlier")] = st.outlier_rate
        if st.forward_ms is not None:
            means[(layer, site, "fwd")] = st.forward_ms
        for name, opt in st.options.items():
            ints[(layer, site, name)] = opt.nbytes
            means[(layer, site, name, "rel")] = opt.rel_error
            means[(layer, site, name, "err")] = opt.error
            means[(layer, site, name, "enc")] = opt.encode_ms
            means[(layer, site, name, "dec")] = opt.decode_ms
    ints[("other",)] = profile.other_bytes
    ints = reduce_dict(ints, "max", g.stage)
    means = reduce_dict(means, "mean", g.stage)
    profile.other_bytes = int(ints[("other",)])
    for (layer, site), st in profile.sites.items():
        st.keep_bytes = int(ints[(layer, site, "keep")])
        st.outlier_rate = means[(layer, site, "outlier")]
        if st.forward_ms is not None:
            st.forward_ms = means[(layer, site, "fwd")]
        for name, opt in st.options.items():
            opt.nbytes = int(ints[(layer, site, name)])
            opt.rel_error = means[(layer, site, name, "rel")]
            opt.error = means[(layer, site, name, "err")]
            opt.encode_ms = means[(layer, site, name, "enc")]
            opt.decode_ms = means[(layer, site, name, "dec")]
    return profile


def device_free_bytes() -> Optional[tuple[int, int]]:
    """(memory this process may still use, memory it holds in live tensors) on the current
    GPU, or None on CPU."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated(), torch.cuda.memory_allocated()
