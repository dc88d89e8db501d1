"""The backward transient of one block: what a plan adds to the memory while the block
backpropagates -- its recomputed tensors and its decoded copies, live at full precision -- on
top of the gradients in flight. The MILP (`milp`) bounds it with its `peak` variable; the
Lagrangian fast path (`lagrange`) and `evaluate_plan` compute it here.

A block backpropagates in stages (`BACKWARD_STAGES`: the MLP half, then the attention half).
What one stage holds is freed before the next, so the transient is the largest stage's:
its gradients in flight (`BlockProfile.stage_bytes`), the sites it consumes that the plan
recomputes, the largest group of its sites decoded together (`DECODE_GROUPS`), and what a
rebuild of this stage brings forward from a later one: a recomputed site whose producer
reads another recomputed site rebuilds and holds that one too (the rebuild cache of
`llm_act/patches/megatron/recompute_region`), and decodes its inputs while it does.

A block without `stage_bytes` (a measured profile, a hand-written one) is one stage holding
every site: all its recomputed sites plus its largest decode group, at once."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.sites import CHECKPOINT_SITE, DECODE_GROUPS, SITE_OF

def stage_of(name: str) -> Optional[str]:
    """The backward stage that consumes site `name` (`Site.stage`; None: not a block site,
    counted in every stage)."""
    site = SITE_OF.get(name)
    return None if site is None else site.stage


def decode_groups(names: Sequence[str]) -> list[list[int]]:
    """Indices of `names` grouped by what is decoded at once (`DECODE_GROUPS`), in order."""
    groups: dict[Any, list[int]] = {}
    for i, name in enumerate(names):
        key = next((g for g in DECODE_GROUPS if name in g), name)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def carries(names: Sequence[str], inputs: Sequence[Sequence[str]]) -> list[tuple[str, int, int]]:
    """(stage, j, i): rebuilding site j, consumed in `stage`, rebuilds its input i, consumed
    in a later stage, when both are recomputed; deeper chains follow (i's own recomputed
    inputs, each pair listed). i is then live in `stage` too. In producer order per stage."""
    where = {n: k for k, n in enumerate(names)}
    out: list[tuple[str, int, int]] = []
    for j, name in enumerate(names):
        stage = stage_of(name)
        if stage is None:
            continue
        todo = [j]
        while todo:
            k = todo.pop()
            for dep in inputs[k]:
                i = where.get(dep)
                if i is None or stage_of(names[i]) in (stage, None) or (stage, k, i) in out:
                    continue
                out.append((stage, k, i))
                todo.append(i)
    return out


def transient_bound(nbytes: Sequence[int], names: Sequence[str], inputs: Sequence[Sequence[str]],
                    recomputed: Sequence[bool], decoded: Sequence[bool],
                    stages: Sequence[tuple[str, int]] = ()) -> int:
    """The transient when the sites flagged `recomputed` are rebuilt and those flagged
    `decoded` are decoded (flags may overlap: an upper bound over plans within them), with
    `stages` ((stage, gradients in flight) pairs, `BlockProfile.stage_bytes`) added per
    stage; without stages, one stage and no gradients."""
    groups = decode_groups(names)
    if not stages:
        return (sum(n for n, r in zip(nbytes, recomputed) if r)
                + max((sum(nbytes[i] for i in g if decoded[i]) for g in groups), default=0))
    links = carries(names, inputs)
    peak = 0
    for stage, grad in stages:
        live = {i for i, r in enumerate(recomputed) if r and stage_of(names[i]) in (stage, None)}
        rebuilt = set()
        for s, j, i in links:  # in producer order: a chain is followed link by link
            if s == stage and recomputed[i] and (j in live or j in rebuilt) and recomputed[j]:
                rebuilt.add(i)
        here = [g for g in groups
                if any(stage_of(names[i]) in (stage, None) for i in g)
                or any(names[i] in inputs[k] for k in live | rebuilt for i in g)]
        dec = max((sum(nbytes[i] for i in g if decoded[i]) for g in here), default=0)
        peak = max(peak, grad + sum(nbytes[i] for i in live | rebuilt) + dec)
    return peak


def whole_block_bytes(nbytes: Sequence[int], names: Sequence[str], checkpoint: str,
                      held: Optional[int] = None) -> int:
    """The transient of a block recomputed whole from its checkpoint (`CHECKPOINT_SITE`,
    stored under `checkpoint`): every other site rebuilt at full precision, with the part of
    the checkpoint's site it does not hold (`held`: its bytes, default the whole site), and
    the checkpoint decoded when it is encoded."""
    ckpt = list(names).index(CHECKPOINT_SITE)
    held = nbytes[ckpt] if held is None else held
    rest = sum(n for i, n in enumerate(nbytes) if i != ckpt) + nbytes[ckpt] - held
    return rest + (held if checkpoint != KEEP else 0)


def transient_bytes(nbytes: Sequence[int], choices: Sequence[str], names: Sequence[str],
                    inputs: Optional[Sequence[Sequence[str]]] = None,
                    stages: Sequence[tuple[str, int]] = ()) -> int:
    """The backward transient of one block under `choices` (the `peak` of
    `llm_act.planner.milp`), gradients in flight included when `stages` are given."""
    inputs = inputs if inputs is not None else [()] * len(names)
    return transient_bound(nbytes, names, inputs, [c == RECOMPUTE for c in choices],
                           [c not in (KEEP, RECOMPUTE) for c in choices], stages)
