"""Agreement across ranks: every rank of a job must switch to the same plan at the same
iteration (design brief, "Distributed rules").

- A recomputed region holds tensor-parallel collectives, and ZeRO-3 gathers parameters
  inside recomputation: mismatched plans between TP or DP ranks would hang or diverge.
- So the statistics each rank measured are reduced first -- over the ranks of the same
  pipeline stage (its TP and DP ranks: they hold the same layers) for the profile, over
  every rank for the per-site-type sensitivities (site types are shared across stages) --
  then one rank per stage solves and broadcasts its decision (`broadcast`).
  Each stage plans with its own layers and micro-batches in flight.
- Reductions: stored bytes by max (a plan must fit the rank that stores most), times,
  errors, outlier rates and sensitivities by mean, budgets by min.

With megatron-core's parallel state initialised its groups are used (the stage group is
`get_tensor_and_data_parallel_group()`); otherwise the whole `torch.distributed` world is
one stage. Expert parallelism needs nothing more: megatron carves the expert-parallel group
out of a stage's TP x DP ranks (EP x expert-TP x expert-DP = TP x DP), so the ranks that hold
different experts of one MoE layer are in the stage group, agree on its plan, and reduce
their MoE statistics with it (bytes by max: the rank whose experts receive the most tokens).
`groups()` checks that layout.
Without torch.distributed (or with one rank) every function is the identity.
Statistics travel as small pickled Python objects (a few hundred numbers per tracking point),
so no tensor layout has to agree between ranks.

Ranks that disagree fail fast instead of hanging:

- `agree_setup` (called by `patches.megatron.apply` and the DeepSpeed `initialize`) compares
  every rank's `ActConfig` and resolved plan and raises `Disagreement` on every rank with one
  message naming the differing fields and each rank's value; `agree_plan` does the same for a
  plan asked for with `Controller.set_plan`. A plan is compared only between ranks that hold
  the same layer (pipeline stages hold different layers). A SHA-256 digest travels first;
  the full values only when the digests differ.
- Every collective issued here runs asynchronously and is waited for at most
  `LLM_ACT_COLLECTIVE_TIMEOUT` seconds (default 300; `timed`, for other modules too): a
  rank that never joins (it failed, stopped, or took another code path) ends in
  `CollectiveError` naming the operation, the group and the likely cause, not in a hang
  until the process group's own timeout (30 min for gloo). Payloads live on the current
  CUDA device under NCCL (whose `work.wait(timeout)` blocks the host up to the deadline),
  on the CPU otherwise.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from llm_act.plan import spans

#: environment variable: seconds any collective llm_act issues may wait for the other ranks
TIMEOUT_ENV = "LLM_ACT_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
#: the fix `agree_setup` names
SETUP_FIX = ('give every rank the same --act-compress-* flags (DeepSpeed: the same '
             '"activation_compression" section)')
#: at most this many differing fields are listed in a `Disagreement`
MAX_LISTED = 8


class Disagreement(RuntimeError):
    """Ranks of one job hold different llm_act settings or plans (raised on every rank)."""


class CollectiveError(RuntimeError):
    """A collective llm_act issued did not complete: a rank did not join in time, or failed."""


@dataclass
class Groups:
    """The process groups agreement uses (None = the default world group)."""

    stage: Any = None
    """ranks of this pipeline stage (TP x DP): profile statistics, plan broadcast"""
    world: Any = None
    """every rank: site-type sensitivities, the sampling noise"""
    src: int = 0
    """global rank that solves and broadcasts for this stage"""


def initialized_dist():
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
    dist = initialized_dist()
    if dist is None or dist.get_world_size() == 1:
        return None
    ps = _megatron_state()
    if ps is not None:
        stage = ps.get_tensor_and_data_parallel_group()
        ep = expert_parallel_ranks()
        if not set(ep) <= set(dist.get_process_group_ranks(stage)):
            raise RuntimeError(
                f"llm_act: the expert-parallel group (global ranks {spans(ep)}) reaches beyond this "
                f"pipeline stage's ranks ({spans(dist.get_process_group_ranks(stage))}): its ranks "
                "could not agree on one plan; initialise megatron's parallel state with "
                "initialize_model_parallel(..., expert_model_parallel_size=...) so that EP splits "
                "the data-parallel ranks of each stage")
        return Groups(stage=stage, world=None, src=dist.get_global_rank(stage, 0))
    return Groups(stage=None, world=None, src=0)


def expert_parallel_ranks() -> list[int]:
    """Global ranks of this rank's expert-parallel group (megatron's; this rank alone without
    expert parallelism or megatron's parallel state)."""
    dist = initialized_dist()
    if dist is None:
        return [0]
    ps = _megatron_state()
    if ps is None or ps.get_expert_model_parallel_world_size() == 1:
        return [dist.get_rank()]
    return list(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))


def data_parallel_rank() -> int:
    """This rank's index among the data-parallel replicas: megatron's DP rank when its
    parallel state is up, else the torch.distributed rank (a job without model
    parallelism: DDP, ZeRO), 0 when running alone."""
    dist = initialized_dist()
    if dist is None:
        return 0
    ps = _megatron_state()
    return int(ps.get_data_parallel_rank() if ps is not None else dist.get_rank())


def tensor_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group: megatron's TP rank when its
    parallel state is up, else 0 (no tensor parallelism: DDP, ZeRO, running alone)."""
    ps = _megatron_state()
    return int(ps.get_tensor_model_parallel_rank()) if ps is not None else 0


def collective_timeout() -> float:
    """Seconds a collective of ours waits for the other ranks (`LLM_ACT_COLLECTIVE_TIMEOUT`,
    default 300): long enough for a slow rank's first iteration, short enough that a rank
    that never comes does not hold the job until the process group's 30-minute timeout."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}: expected a positive number of seconds, got {raw!r}")
    return value


def _describe(group: Any) -> str:
    dist = initialized_dist()
    if group is None or group is dist.group.WORLD:
        return f"the world group ({dist.get_world_size()} ranks)"
    ranks = dist.get_process_group_ranks(group)
    return f"the group of global ranks {spans(ranks)}"


def timed(start: Callable[[], Any], op: str, group: Any = None) -> None:
    """Run a collective with a deadline: `start()` issues it with `async_op=True` and returns
    its work, which is waited for at most `collective_timeout()` seconds; a timeout or a
    failure raises `CollectiveError` naming `op` and `group`. E.g.
    `timed(lambda: dist.all_reduce(t, group=g, async_op=True), "all_reduce of the loss", g)`."""
    limit = collective_timeout()
    begun = time.monotonic()
    try:
        start().wait(timeout=datetime.timedelta(seconds=limit))
    except RuntimeError as err:  # gloo: "Operation timed out!"; NCCL: DistBackendError
        dist = initialized_dist()
        raise CollectiveError(
            f"llm_act: {op} over {_describe(group)} did not complete on rank {dist.get_rank()} "
            f"(after {time.monotonic() - begun:.1f} s; timeout {limit:g} s, set by {TIMEOUT_ENV}): "
            f"{err}. Likely cause: another rank of the group never reached this call -- it "
            "failed or stopped (see its log), or it took another path: a different "
            "--act-compress-* setup, or set_plan called on some ranks only"
        ) from err


def _device(group: Any) -> torch.device:
    """Where payload tensors live: NCCL moves only CUDA tensors, gloo CPU ones."""
    if initialized_dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(t: torch.Tensor, group: Any, op: str) -> list[torch.Tensor]:
    dist = initialized_dist()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    timed(lambda: dist.all_gather(out, t, group=group, async_op=True), op, group)
    return out


def _pack(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _unpack(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(t[:size].cpu().numpy().tobytes())


#: called before each collective of ours while a measurement runs
#: (`llm_act.runtime.round_guard.RoundGuard.checkpoint`: a status exchange, so that a rank
#: whose measurement failed is met by its peers instead of leaving them waiting here)
_before_collective: Optional[Callable[[], None]] = None


def set_before_collective(hook: Optional[Callable[[], None]]) -> None:
    """Install (or, with None, remove) the hook `gather` and `broadcast` call first."""
    global _before_collective
    _before_collective = hook


def _announce() -> None:
    if _before_collective is not None:
        _before_collective()


def gather(obj: Any, group: Any = None, op: str = "all_gather of statistics") -> list[Any]:
    """`obj` of every rank of `group` (a list in rank order); `op` names the operation in a
    `CollectiveError`."""
    dist = initialized_dist()
    if dist is not None:
        _announce()  # on every rank alike, also where `group` has one rank
    if dist is None or dist.get_world_size(group) == 1:
        return [obj]
    device = _device(group)
    payload = _pack(obj, device)
    sizes = [int(n) for n in _all_gather(torch.tensor([payload.numel()], device=device), group,
                                         f"{op} (sizes)")]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    return [_unpack(t, n) for t, n in zip(_all_gather(padded, group, op), sizes)]


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


def any_rank(flag: bool, g: Optional[Groups]) -> bool:
    """Whether `flag` holds on any rank of the stage: a rank-local finding (this rank's batch
    has new shapes) that decides whether a measuring pass runs is taken alike everywhere, as a
    pass holds collectives (ZeRO-3's parameter gathers, tensor parallelism's)."""
    if g is None:
        return bool(flag)
    return reduce_dict({"any": float(bool(flag))}, "max", g.stage)["any"] > 0


def broadcast(obj: Any, g: Optional[Groups], op: str = "broadcast of the plan") -> Any:
    """`obj` of the stage's source rank, on every rank of the stage."""
    dist = initialized_dist()
    if dist is not None:
        _announce()
    if dist is None or g is None or dist.get_world_size(g.stage) == 1:
        return obj
    device = _device(g.stage)
    source = dist.get_rank() == g.src
    payload = _pack(obj, device) if source else None
    size = torch.tensor([payload.numel() if source else 0], device=device)
    timed(lambda: dist.broadcast(size, src=g.src, group=g.stage, async_op=True), f"{op} (size)", g.stage)
    if not source:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    timed(lambda: dist.broadcast(payload, src=g.src, group=g.stage, async_op=True), op, g.stage)
    return _unpack(payload, int(size))


def is_source(g: Optional[Groups]) -> bool:
    dist = initialized_dist()
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
    ints[("loss",)] = profile.loss_bytes
    ints[("after",)] = profile.after_blocks_bytes
    for layer, ms in profile.block_ms.items():
        means[(layer, "block")] = ms
    ints = reduce_dict(ints, "max", g.stage)
    means = reduce_dict(means, "mean", g.stage)
    profile.other_bytes = int(ints[("other",)])
    profile.loss_bytes = int(ints[("loss",)])
    profile.after_blocks_bytes = int(ints[("after",)])
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
    for layer in profile.block_ms:
        profile.block_ms[layer] = means[(layer, "block")]
    return profile


# ---- agreement on settings and plans -------------------------------------------------------


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _per_rank(holders: list[tuple[int, Any]]) -> str:
    """"rank 0 'compress', rank 1 'keep'"; ranks sharing a value are listed together."""
    by_value: dict[str, list[int]] = {}
    shown: dict[str, Any] = {}
    for rank, value in holders:
        key = _canonical(value)
        by_value.setdefault(key, []).append(rank)
        shown.setdefault(key, value)
    return ", ".join(f"rank{'s' if len(r) > 1 else ''} {spans(r)} {shown[k]!r}" for k, r in by_value.items())


def _differences(parts: list[dict]) -> list[str]:
    """One line per differing field; a key `(field, layer)` is compared only between the
    ranks that hold it (that layer), and equal differences over several layers share a line."""
    grouped: dict[tuple[str, str], list] = {}
    for key in sorted({k for p in parts for k in p}, key=repr):
        holders = [(rank, p[key]) for rank, p in enumerate(parts) if key in p]
        if len({_canonical(v) for _, v in holders}) < 2:
            continue
        name, layer = key if isinstance(key, tuple) else (key, None)
        grouped.setdefault((name, _per_rank(holders)), []).append(layer)
    lines = []
    for (name, values), layers in grouped.items():
        where = "" if layers == [None] else f" (layer{'s' if len(layers) > 1 else ''} {spans(layers)})"
        lines.append(f"{name}{where}: {values}")
    return lines


def agree(items: Mapping[Any, Any], what: str, fix: str, group: Any = None) -> None:
    """Raise `Disagreement` on every rank of `group` unless all hold equal `items`.

    `items`: {field: value}, or {(field, layer): value} for what only the ranks holding
    `layer` compare. Collective (every rank of `group` must call it). The message, the same
    on every rank: "llm_act: ranks disagree on the <what>: <field>: rank 0 <value>, rank 1
    <value>; ...; <fix>".
    """
    dist = initialized_dist()
    if dist is None or dist.get_world_size(group) == 1:
        return
    device = _device(group)
    mine = hashlib.sha256(_canonical(sorted(items.items(), key=repr)).encode()).digest()
    digest = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    digests = _all_gather(digest, group, f"all_gather of the {what} digest")
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    # different digests may still agree on every key two ranks share (pipeline stages)
    lines = _differences(gather(dict(items), group, f"all_gather of the {what}"))
    if not lines:
        return
    more = len(lines) - MAX_LISTED
    listed = "; ".join(lines[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
    raise Disagreement(f"llm_act: ranks disagree on the {what}: {listed}; {fix}")


def _plan_items(plan: Mapping[int, Mapping[str, str]]) -> dict[tuple[str, int], str]:
    return {(f"plan at {site}", int(layer)): choice for layer, c in plan.items() for site, choice in c.items()}


def agree_setup(controller: Any, fix: str = SETUP_FIX) -> None:
    """Every rank of the job (the world: TP, PP and DP ranks) checks that it runs the same
    `ActConfig` and -- only when those agree, since a differing setting explains a differing
    plan -- the same plan at every layer it shares with another rank. Collective."""
    agree(dataclasses.asdict(controller.config), "activation-compression setup", fix)
    agree(_plan_items(controller.plan), "activation-compression setup", fix)  # {} when disabled


def agree_plan(plan: Mapping[int, Mapping[str, str]], g: Optional[Groups] = None) -> None:
    """The ranks of this pipeline stage (`g.stage`, the world without megatron's parallel
    state) check that they asked for the same plan (`Controller.set_plan`). Collective."""
    agree(_plan_items(plan), "plan asked for with set_plan",
          "call set_plan with the same plan on every rank", g.stage if g is not None else None)


def device_free_bytes() -> Optional[tuple[int, int]]:
    """(memory this process may still use, memory it holds in live tensors) on the current
    GPU, or None on CPU."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated(), torch.cuda.memory_allocated()
