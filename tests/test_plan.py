"""The planner: every microbatch id assigned exactly once, deterministically, under both policies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.plan import Policy, even_quotas, plan_step, throughput_quotas

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=200, deadline=None)
@given(
    members=st.sets(st.integers(0, 63), min_size=1, max_size=16),
    m=st.integers(1, 64),
    step=st.integers(0, 10_000),
    policy=st.sampled_from(list(Policy)),
    speeds=st.lists(st.floats(0.01, 10.0), min_size=16, max_size=16),
)
def test_every_id_exactly_once(members: set[int], m: int, step: int, policy: Policy, speeds: list[float]) -> None:
    times = {w: speeds[i % len(speeds)] for i, w in enumerate(sorted(members))}
    plan = plan_step(step, sorted(members, reverse=True), m, policy, times)
    ids = [j for w in plan.members for j in plan.ids_for(w)]
    assert sorted(ids) == list(range(m))
    assert set(plan.ids) == members
    # the same inputs in any order give the same plan (every worker computes it independently)
    assert plan_step(step, sorted(members), m, policy, times) == plan


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
