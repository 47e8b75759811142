"""Workload planning: which worker computes which of a step's M microbatch ids. Pure Python, no torch.

Every worker calls the same function with the same inputs and so computes the same plan; the simulator
imports this module rather than a copy. A plan covers each id in [0, M) exactly once over the members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from unbroken.core.config import Workload


@dataclass(frozen=True)
class Assignment:
    """The microbatch ids each member computes in one step; ``ids[w]`` is sorted, ids are disjoint."""

    step: int
    num_microbatches: int
    members: tuple[int, ...]
    ids: Mapping[int, tuple[int, ...]]
    # ids to compute in MeCeFO's efficient mode (attention skipped in backward, low-rank FFN weight gradient)
    efficient: frozenset[int] = frozenset()

    def ids_for(self, worker: int) -> tuple[int, ...]:
        return self.ids.get(worker, ())

    def owner_of(self) -> dict[int, int]:
        """Microbatch id -> the worker that computes it."""
        return {j: w for w, js in self.ids.items() for j in js}


SPEED_DIGITS = 4  # significant digits of an agreed speed


def agreed_speed(seconds: float) -> float:
    """A member's seconds per microbatch as the group agrees it (``ft.commit``): ``SPEED_DIGITS`` significant
    digits. The planner reads these and the step record carries them, so a record replays its plan exactly; and
    a record's speeds are 6 or 7 characters each, not a measured float's 18 to 20 (most of a step record at scale)."""
    return float(f"{seconds:.{SPEED_DIGITS}g}")


def even_quotas(num_items: int, num_workers: int) -> list[int]:
    """``num_items`` split over ``num_workers`` as evenly as possible, larger quotas first."""
    assert num_workers >= 1 and num_items >= 0
    base, extra = divmod(num_items, num_workers)
    return [base + (1 if r < extra else 0) for r in range(num_workers)]


def throughput_quotas(num_items: int, seconds_per_item: Sequence[float]) -> list[int]:
    """Quotas that minimise max_r q_r * t_r with sum q_r = num_items and, while there are as many items as
    workers, q_r >= 1 (greedy from one each: each further item to the earliest finisher).

    The floor keeps every worker measured: a worker given nothing times nothing, so one momentary slow time
    (a pause, a busy core) would keep it idle for the rest of the run. It costs at most one item of the slowest
    worker; a worker too slow for even that is for ``recovery.slow = "exclude"``. Ties go to the lower index,
    so the result is deterministic for identical inputs.
    """
    assert len(seconds_per_item) >= 1 and num_items >= 0
    assert all(t > 0 for t in seconds_per_item), seconds_per_item
    floor = 1 if num_items >= len(seconds_per_item) else 0
    quotas = [floor] * len(seconds_per_item)
    for _ in range(num_items - sum(quotas)):
        r = min(range(len(quotas)), key=lambda i: ((quotas[i] + 1) * seconds_per_item[i], i))
        quotas[r] += 1
    return quotas


def plan_step(
    step: int,
    members: Sequence[int],
    num_microbatches: int,
    policy: Workload | str = Workload.EVEN,
    seconds_per_microbatch: Mapping[int, float] | None = None,
) -> Assignment:
    """Assign the step's microbatch ids [0, M) to ``members`` (worker ids) in contiguous blocks.

    Args:
        step: the optimizer step (recorded in the plan; the split does not depend on it).
        members: alive worker ids; the order is normalised (sorted) so every caller agrees.
        num_microbatches: M, fixed for the run whatever the number of members.
        policy: ``even`` or ``throughput``.
        seconds_per_microbatch: measured time per microbatch of each member (``throughput`` only);
            members without a measurement get the median of the others.
    """
    return plan_ids(step, members, range(num_microbatches), num_microbatches, policy, seconds_per_microbatch)


def plan_ids(
    step: int,
    members: Sequence[int],
    ids: Sequence[int] | range,
    num_microbatches: int,
    policy: Workload | str = Workload.EVEN,
    seconds_per_microbatch: Mapping[int, float] | None = None,
) -> Assignment:
    """Assign a subset of the step's ids (e.g. the ones a failure lost) over ``members``, as ``plan_step``."""
    policy = Workload(policy)
    ordered = tuple(sorted(set(members)))
    todo = sorted(set(ids))
    assert ordered, "a plan needs at least one member"
    assert all(0 <= j < num_microbatches for j in todo), todo
    if policy is Workload.EVEN or not seconds_per_microbatch:
        quotas = even_quotas(len(todo), len(ordered))
    else:
        known = sorted(t for w, t in seconds_per_microbatch.items() if w in ordered and t > 0)
        fallback = known[len(known) // 2] if known else 1.0
        times = [seconds_per_microbatch.get(w, fallback) or fallback for w in ordered]
        quotas = throughput_quotas(len(todo), times)
    assignment: dict[int, tuple[int, ...]] = {}
    start = 0
    for worker, quota in zip(ordered, quotas, strict=True):
        assignment[worker] = tuple(todo[start : start + quota])
        start += quota
    assert start == len(todo)
    return Assignment(step=step, num_microbatches=num_microbatches, members=ordered, ids=assignment)


def missing_ids(held_counts: Sequence[float | int]) -> list[int]:
    """The step's ids that no member holds, from the SUM-reduced per-id counts of the members' work."""
    assert all(c in (0, 1) for c in held_counts), f"a microbatch is held twice: {list(held_counts)}"
    return [j for j, c in enumerate(held_counts) if c == 0]


def recovery_plan(
    step: int,
    members: Sequence[int],
    held_counts: Sequence[float | int],
    policy: Workload | str = Workload.EVEN,
    seconds_per_microbatch: Mapping[int, float] | None = None,
) -> Assignment:
    """After a membership change: spread the ids nobody holds over the members (ReCoVer's in-step recovery).

    Survivors keep what they computed; the dead workers' ids (and any a survivor had not reached yet) are
    assigned again, so over the whole step every id is computed and counted exactly once.
    """
    return plan_ids(step, members, missing_ids(held_counts), len(held_counts), policy, seconds_per_microbatch)


def next_alive(ring: Sequence[int], worker: int, alive: Sequence[int]) -> int:
    """The first alive worker after ``worker`` in ring order (MeCeFO's neighbour), skipping dead ones."""
    order = sorted(set(ring))
    assert worker in order and alive, (worker, order, alive)
    start = order.index(worker)
    for k in range(1, len(order) + 1):
        candidate = order[(start + k) % len(order)]
        if candidate in alive:
            return candidate
    raise AssertionError("unreachable: alive is a non-empty subset of the ring")


def _neighbours(ring: Sequence[int], dead: set[int], alive: set[int]) -> dict[int, int]:
    """``next_alive`` for every worker in ``dead`` at once, in one walk around the ring."""
    order = sorted(set(ring))
    result: dict[int, int] = {}
    pending: list[int] = []
    for candidate in order + order:  # twice round, so the dead at the end find the alive at the start
        if candidate in alive:
            for worker in pending:
                result[worker] = candidate
            pending = []
        elif candidate in dead and candidate not in result:
            pending.append(candidate)
    assert set(result) == dead, (dead, result)
    return result


def mecefo_plan(
    step: int,
    ring: Sequence[int],
    members: Sequence[int],
    num_microbatches: int,
    todo: Sequence[int] | range | None = None,
    spread: bool = False,
) -> Assignment:
    """MeCeFO's assignment: every id keeps its failure-free owner (the ``even`` plan over the whole ring of
    configured workers); the ids of a dead owner go to its neighbour, the next alive worker in ring order.

    The neighbour computes its own and the adopted ids in efficient mode (the paper's Neighbor-Do-Both).
    With ``spread`` (our hybrid), the orphaned ids are spread evenly over all members instead, and only they
    run in efficient mode. ``todo`` restricts the plan to the ids still to compute in this step (after an
    in-step failure); ids computed before it stay as they were, exact. Several dead workers, including
    adjacent ones, are handled: each orphan goes to the first alive successor of its owner.
    """
    alive = tuple(sorted(set(members)))
    alive_set = set(alive)
    assert alive and alive_set <= set(ring), (alive, ring)
    base = plan_step(step, ring, num_microbatches).owner_of()
    todo = sorted(set(range(num_microbatches) if todo is None else todo))
    ids: dict[int, list[int]] = {w: [] for w in alive}
    orphans = []
    for j in todo:  # one pass: O(M + ring), so cluster-scale simulations can call it every step
        if base[j] in alive_set:
            ids[base[j]].append(j)
        else:
            orphans.append(j)
    if spread:
        for worker, extra in plan_ids(step, alive, orphans, num_microbatches).ids.items():
            ids[worker] += extra
        efficient = frozenset(orphans)
    else:
        neighbour_of = _neighbours(ring, {base[j] for j in orphans}, alive_set)
        adopters = set()
        for j in orphans:
            ids[neighbour_of[base[j]]].append(j)
            adopters.add(neighbour_of[base[j]])
        efficient = frozenset(j for w in adopters for j in ids[w])
    return Assignment(
        step=step,
        num_microbatches=num_microbatches,
        members=alive,
        ids={w: tuple(sorted(js)) for w, js in ids.items()},
        efficient=efficient,
    )
