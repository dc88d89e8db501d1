"""The merged problem: classes that differ only in measured figures, solved as one.

One job: merge the classes of blocks that differ only in noise and time (per-layer
sensitivities, times within their measurement noise) into one class each with the
count-weighted means (`merge_classes`), and give a merged solution back to its members
(`spread_solution`). The merged MILP is small whatever the depth, and its plan has exactly the
same bytes, time and summed noise in the original problem: the full search takes it as a
fallback (`llm_act.planner.search`) and the fast path starts from it (`llm_act.planner.fast`).
"""
from __future__ import annotations

from llm_act.planner.classes import BlockClass, ChoiceOption, Solution, no_whole_blocks


def merge_classes(classes: list[BlockClass]) -> tuple[list[BlockClass], list[int]]:
    """Classes that differ only in measured figures (per-layer sensitivities, times that
    differ by their measurement noise) merged into one with the count-weighted mean noise
    and time of every option, and the merged index of every class. A plan of the merged
    problem, given to all its members (`spread_solution`), has exactly the same bytes, time and
    summed noise in the original one (the means are count-weighted): a feasible answer found
    in a fraction of the time."""
    index: dict[tuple, int] = {}
    merged: list[BlockClass] = []
    member: list[int] = []

    def bare(opts):
        return [ChoiceOption(o.name, o.stored, 0.0, 0.0, o.transient) for o in opts]

    for cls in classes:
        key = (cls.inflight, tuple((s.name, s.inputs, tuple((o.name, o.stored) for o in opts))
                                   for s, opts in zip(cls.sites, cls.options)),
               tuple((o.name, o.stored, o.transient) for o in cls.full), cls.grad, cls.stages, cls.floor,
               cls.input_bytes)
        if key not in index:
            index[key] = len(merged)
            merged.append(BlockClass(cls.sites, cls.inflight, 0, [bare(opts) for opts in cls.options],
                                 bare(cls.full), cls.grad, cls.stages, input_bytes=cls.input_bytes))
        m = merged[index[key]]
        m.first = m.first or cls.first
        for mine, theirs in zip(m.options + [m.full], cls.options + [cls.full]):
            for o, t in zip(mine, theirs):
                o.noise += cls.count * t.noise
                o.cost_ms += cls.count * t.cost_ms
        m.count += cls.count
        member.append(index[key])
    for m in merged:
        for opts in m.options + [m.full]:
            for o in opts:
                o.noise /= max(m.count, 1)
                o.cost_ms /= max(m.count, 1)
    return merged, member


def spread_solution(classes: list[BlockClass], member: list[int], sol: Solution) -> Solution:
    """A merged problem's solution given to its member classes: each takes its merged
    class's per-site choice, and the merged class's whole-block counts go to the members
    whose per-site choice adds the most noise (moving those blocks saves the most), then
    whose whole block costs the least over it, ties to the lower class index."""
    picks = [list(sol[0][m]) for m in member]
    fulls = no_whole_blocks(classes)

    def order(k: int, c: int):
        opts = [classes[k].options[i][o] for i, o in enumerate(picks[k])]
        return (-sum(o.noise for o in opts), classes[k].full[c].cost_ms - sum(o.cost_ms for o in opts), k)

    for m, counts in enumerate(sol[1]):
        mine = [k for k, owner in enumerate(member) if owner == m]
        for c, n in enumerate(counts):
            for k in sorted(mine, key=lambda k: order(k, c)):
                take = min(n, classes[k].count - sum(fulls[k]))
                fulls[k][c] += take
                n -= take
    return picks, fulls
