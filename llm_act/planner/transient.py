"""The backward transient of one block: while it backpropagates, its recomputed tensors and the
largest group of tensors decoded together are live at full precision at once. The MILP
(`milp`) bounds it with its `peak` variable; the Lagrangian fast path (`lagrange`) checks it."""
from __future__ import annotations

from typing import Any, Sequence

from llm_act.codecs.registry import KEEP, RECOMPUTE


#: sites whose decoded copies one backward op needs at once (any other site is its own group)
DECODE_GROUPS: tuple[frozenset[str], ...] = (frozenset({"attn.q", "attn.k", "attn.v", "attn.out"}),)


def decode_groups(names: Sequence[str]) -> list[list[int]]:
    """Indices of `names` grouped by what is decoded at once (`DECODE_GROUPS`), in order."""
    groups: dict[Any, list[int]] = {}
    for i, name in enumerate(names):
        key = next((g for g in DECODE_GROUPS if name in g), name)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def transient_bytes(nbytes: Sequence[int], choices: Sequence[str], names: Sequence[str]) -> int:
    """The backward transient of one block under `choices`: the recomputed sites' bytes
    plus the largest decode group's compressed sites' bytes (the `peak` of `llm_act.planner.milp`)."""
    rec = sum(n for n, c in zip(nbytes, choices) if c == RECOMPUTE)
    dec = max((sum(nbytes[i] for i in g if choices[i] not in (KEEP, RECOMPUTE))
               for g in decode_groups(names)), default=0)
    return rec + dec
