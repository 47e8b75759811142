"""``unbroken.core.plan`` behind caches, for the simulator: the planner the trainer runs, never a copy."""

from __future__ import annotations

from unbroken.core import plan as planlib


class Planner:
    """``unbroken.core.plan`` behind caches. The even policies' plans are computed on canonical labels and
    relabelled (``plan_ids`` sorts its members and ids and assigns contiguous blocks, so its plan depends on
    them only through their order); MeCeFO's plans depend on ring positions and are computed as they are."""

    def __init__(self, num_microbatches: int, ring: int) -> None:
        self.M = num_microbatches
        self.ring = tuple(range(ring))
        self._steady: dict[int, planlib.Assignment] = {}
        self._spread: dict[tuple[int, int], planlib.Assignment] = {}
        self._nonempty: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}
        self._mecefo: dict[tuple[tuple[int, ...], tuple[int, ...], bool], planlib.Assignment] = {}
        self.calls = 0  # calls into unbroken.core.plan

    def steady(self, num_members: int) -> planlib.Assignment:
        """``plan_step`` over members 0..n-1 (the k-th smallest member id computes ``ids[k]``)."""
        if num_members not in self._steady:
            self.calls += 1
            self._steady[num_members] = planlib.plan_step(0, range(num_members), self.M)
        return self._steady[num_members]

    def spread(self, num_members: int, num_ids: int) -> planlib.Assignment:
        """``plan_ids`` of ids 0..num_ids-1 over members 0..n-1 (ReCoVer's in-step redistribution)."""
        key = (num_members, num_ids)
        if key not in self._spread:
            self.calls += 1
            self._spread[key] = planlib.plan_ids(0, range(num_members), range(num_ids), self.M)
        return self._spread[key]

    def spread_nonempty(self, num_members: int, num_ids: int) -> list[tuple[int, tuple[int, ...]]]:
        """The (member, ids) entries of ``spread`` that have ids (at most num_ids of the num_members)."""
        key = (num_members, num_ids)
        if key not in self._nonempty:
            self._nonempty[key] = [(k, ids) for k, ids in self.spread(num_members, num_ids).ids.items() if ids]
        return self._nonempty[key]

    def mecefo(self, members: tuple[int, ...], todo: tuple[int, ...] | None, spread: bool) -> planlib.Assignment:
        key = (members, todo or (), spread)
        if key not in self._mecefo:
            self.calls += 1
            self._mecefo[key] = planlib.mecefo_plan(0, self.ring, members, self.M, todo, spread=spread)
        return self._mecefo[key]

    def assignment(self, step: int, members: list[int]) -> planlib.Assignment:
        """The relabelled steady plan of ``members``: equal to ``plan.plan_step(step, members, M)``."""
        canon = self.steady(len(members))
        ordered = sorted(members)
        ids = {ordered[k]: canon.ids[k] for k in range(len(ordered))}
        return planlib.Assignment(step, self.M, tuple(ordered), ids)

    def recovery(self, step: int, members: list[int], todo: list[int]) -> planlib.Assignment:
        """The relabelled redistribution: equal to ``plan.plan_ids(step, members, todo, M)``."""
        ordered, ids = sorted(members), sorted(todo)
        canon = self.spread(len(ordered), len(ids))
        out = {ordered[k]: tuple(ids[j] for j in canon.ids[k]) for k in range(len(ordered))}
        return planlib.Assignment(step, self.M, tuple(ordered), out)
