"""The planner: every microbatch id assigned exactly once, deterministically, under both policies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.core.config import Workload
from unbroken.core.plan import (
    SPEED_DIGITS,
    agreed_speed,
    even_quotas,
    mecefo_plan,
    next_alive,
    plan_step,
    throughput_quotas,
)

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=200, deadline=None)
@given(
    members=st.sets(st.integers(0, 63), min_size=1, max_size=16),
    m=st.integers(1, 64),
    step=st.integers(0, 10_000),
    policy=st.sampled_from(list(Workload)),
    speeds=st.lists(st.floats(0.01, 10.0), min_size=16, max_size=16),
)
def test_every_id_exactly_once(members: set[int], m: int, step: int, policy: Workload, speeds: list[float]) -> None:
    times = {w: speeds[i % len(speeds)] for i, w in enumerate(sorted(members))}
    plan = plan_step(step, sorted(members, reverse=True), m, policy, times)
    ids = [j for w in plan.members for j in plan.ids_for(w)]
    assert sorted(ids) == list(range(m))
    assert set(plan.ids) == members
    # the same inputs in any order give the same plan (every worker computes it independently)
    assert plan_step(step, sorted(members), m, policy, times) == plan


@settings(max_examples=300, deadline=None)
@given(seconds=st.floats(1e-6, 1e4))
def test_an_agreed_speed_keeps_its_digits_and_is_short(seconds: float) -> None:
    """A speed as the group agrees it: within half a unit of its last significant digit, agreed again unchanged
    (a member that receives the agreed speeds in the state plans what the others plan), and written short."""
    agreed = agreed_speed(seconds)
    assert abs(agreed - seconds) <= 0.5 * 10.0 ** (1 - SPEED_DIGITS) * seconds
    assert agreed_speed(agreed) == agreed
    assert len(json.dumps(agreed)) <= SPEED_DIGITS + 7  # "0.0009531", "1.234e-05", "1234.0"


def test_even_quotas() -> None:
    assert even_quotas(8, 3) == [3, 3, 2]
    assert even_quotas(2, 4) == [1, 1, 0, 0]
    assert plan_step(0, [5, 1], 5).ids == {1: (0, 1, 2), 5: (3, 4)}


def test_throughput_gives_a_slow_worker_fewer() -> None:
    quotas = throughput_quotas(16, [1.0, 1.0, 3.0, 1.0])
    assert sum(quotas) == 16
    assert quotas[2] < min(quotas[0], quotas[1], quotas[3])
    plan = plan_step(3, [0, 1, 2, 3], 16, "throughput", {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0})
    assert len(plan.ids_for(2)) == quotas[2]


def test_throughput_gives_every_worker_one_while_there_are_enough_so_none_goes_unmeasured() -> None:
    """A worker whose last time was a momentary 8x (measured as a moving average, and only while it computes)
    would get nothing of 8 and never be timed again: it keeps one, at the cost of one of its slow items."""
    assert throughput_quotas(8, [1.0, 8.0, 4.0]) == [6, 1, 1]
    assert throughput_quotas(8, [1.0, 1.0, 4.0]) == [4, 3, 1]  # 4, 4, 0 without the floor: as fast, never timed
    assert throughput_quotas(2, [1.0, 8.0, 4.0]) == [2, 0, 0]  # fewer items than workers: no floor
    assert throughput_quotas(3, [1.0, 8.0, 4.0]) == [1, 1, 1]


@settings(max_examples=300, deadline=None)
@given(
    ring_size=st.integers(1, 12),
    dead=st.sets(st.integers(0, 11), max_size=11),
    m=st.integers(1, 40),
    done=st.sets(st.integers(0, 39), max_size=40),
    spread=st.booleans(),
)
def test_mecefo_every_id_once_and_orphans_to_neighbours(
    ring_size: int, dead: set[int], m: int, done: set[int], spread: bool
) -> None:
    ring = list(range(ring_size))
    alive = [w for w in ring if w not in dead] or [ring[-1]]
    todo = [j for j in range(m) if j not in done]
    plan = mecefo_plan(3, ring, alive, m, todo, spread=spread)
    assigned = sorted(j for w in plan.members for j in plan.ids_for(w))
    assert assigned == todo  # computed ids are never planned again; the rest exactly once
    base = plan_step(3, ring, m).owner_of()
    owner = plan.owner_of()
    orphans = {j for j in todo if base[j] not in alive}
    for j in todo:
        if base[j] in alive:
            assert owner[j] == base[j]  # a survivor keeps its failure-free ids
        elif not spread:
            assert owner[j] == next_alive(ring, base[j], alive)
    if spread:
        assert plan.efficient == orphans
    else:
        adopters = {owner[j] for j in orphans}
        assert plan.efficient == {j for j in todo if owner[j] in adopters}
    assert plan.efficient <= set(todo)


def test_mecefo_without_failures_is_the_even_plan() -> None:
    for spread in (False, True):
        plan = mecefo_plan(0, [0, 1, 2, 3], [0, 1, 2, 3], 8, spread=spread)
        assert plan.ids == plan_step(0, [0, 1, 2, 3], 8).ids and not plan.efficient


def test_mecefo_neighbour_skips_dead_workers() -> None:
    # workers 1 and 2 dead: both orphan sets go to worker 3, which runs everything it holds efficiently
    plan = mecefo_plan(0, [0, 1, 2, 3], [0, 3], 8)
    assert plan.ids == {0: (0, 1), 3: (2, 3, 4, 5, 6, 7)}
    assert plan.efficient == {2, 3, 4, 5, 6, 7}
    assert next_alive([0, 1, 2, 3], 3, [1, 2]) == 1  # the ring wraps around
    spread = mecefo_plan(0, [0, 1, 2, 3], [0, 3], 8, spread=True)
    assert sorted(len(ids) for ids in spread.ids.values()) == [4, 4] and spread.efficient == {2, 3, 4, 5}
