"""Failure schedules (parsing, validation, seeded random scenarios), the recovery accounting property, and how a
worker at an injection point wakes the agent that delivers the signal."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.control.host.agent import Agent
from unbroken.control.host.command import WorkerCommand
from unbroken.control.host.processes import wait_for_exit
from unbroken.core.failures import (
    FailureKind,
    FailureSchedule,
    Phase,
    build_schedule,
    random_schedule,
    scenario_timing,
)
from unbroken.core.plan import plan_step, recovery_plan

pytestmark = pytest.mark.timeout(60)


def test_parse_and_describe_round_trip() -> None:
    text = "kill:worker=2,step=10,phase=backward; hang:worker=1,step=5; slow:worker=1,factor=3,steps=5-20"
    schedule = FailureSchedule.parse(text)
    kill, hang, slow = schedule.events
    assert (kill.kind, kill.worker, kill.step, kill.phase) == (FailureKind.KILL, 2, 10, Phase.BACKWARD)
    assert (hang.kind, hang.phase, hang.rejoin_after_s) == (FailureKind.HANG, Phase.START, None)
    assert (slow.factor, slow.step, slow.last_step) == (3.0, 5, 20)
    assert FailureSchedule.parse(schedule.describe()) == schedule
    assert schedule.injection(2, 10, Phase.BACKWARD) == kill
    assert schedule.injection(2, 10, Phase.FORWARD) is None
    assert schedule.slow_factor(1, 7) == 3.0 and schedule.slow_factor(1, 21) == 1.0
    assert FailureSchedule.parse("kill:worker=0,step=1", default_rejoin_s=4.0).events[0].rejoin_after_s == 4.0


def test_a_slow_down_by_a_factor_by_added_seconds_or_both() -> None:
    schedule = FailureSchedule.parse(
        "slow:worker=1,seconds=0.2,steps=5-20; slow:worker=2,factor=2,seconds=0.1,steps=1-3; "
        "slow:worker=2,factor=3,steps=3-4"
    )
    assert FailureSchedule.parse(schedule.describe()) == schedule
    assert (schedule.slow_factor(1, 5), schedule.slow_seconds(1, 5), schedule.slow_seconds(1, 21)) == (1.0, 0.2, 0.0)
    assert (schedule.slow_factor(2, 2), schedule.slow_seconds(2, 2)) == (2.0, 0.1)
    assert (schedule.slow_factor(2, 3), schedule.slow_seconds(2, 3)) == (3.0, 0.1)  # the largest of each applies
    assert (schedule.slow_factor(2, 4), schedule.slow_seconds(2, 4)) == (3.0, 0.0)


def test_only_kill_coordinator_targets_the_coordinator() -> None:
    """A ``scale`` event names no worker either; the launcher must not read it as a coordinator kill."""
    scale, coordinator = FailureSchedule.parse("scale:step=2,microbatch=1,factor=1e9; kill:coordinator,step=3").events
    assert not scale.targets_coordinator and coordinator.targets_coordinator
    assert [e.describe() for e in (scale, coordinator)] == [
        "scale:step=2,microbatch=1,factor=1e+09",
        "kill:coordinator,step=3",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kill", "malformed"),
        ("kill:step=3", "names no worker"),
        ("kill:worker=1", "names no step"),
        ("kill:worker=x,step=1", "not an integer"),
        ("kill:worker=1,step=1,speed=3", "unknown key 'speed'"),
        ("slow:worker=1,factor=0.5,steps=1-2", "factor >= 1"),
        ("slow:worker=1,factor=2,steps=5-2", "FIRST <= LAST"),
        ("slow:worker=1,steps=1-2", "factor= or seconds="),
        ("slow:worker=1,seconds=-0.5,steps=1-2", ">= 0"),
        ("hang:worker=1,step=1,rejoin=-1", ">= 0"),
    ],
)
def test_malformed_events(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FailureSchedule.parse(text)


def test_validation_against_the_run() -> None:
    FailureSchedule.parse("kill:worker=0,step=1,rejoin=2; kill:worker=1,step=3").validate(2, 10)
    with pytest.raises(ValueError, match="kills every worker at step 3"):
        FailureSchedule.parse("kill:worker=0,step=3,rejoin=1; kill:worker=1,step=3,rejoin=1").validate(2, 10)


def test_random_scenarios_are_seeded_and_survivable() -> None:
    a = random_schedule(4, 500, mtbf_s=20.0, mttr_s=30.0, step_time_s=1.0, seed=7)
    assert a == random_schedule(4, 500, mtbf_s=20.0, mttr_s=30.0, step_time_s=1.0, seed=7)
    assert a != random_schedule(4, 500, mtbf_s=20.0, mttr_s=30.0, step_time_s=1.0, seed=8)
    assert len(a.events) > 5 and all(e.rejoin_after_s == 30.0 for e in a.events)
    a.validate(4, 500)
    b = build_schedule("kill:worker=1,step=3", 0.0, 50.0, 1, 1.0, 4, 300)
    assert b.events[0].describe() == "kill:worker=1,step=3,phase=backward"


def test_mecefo_scenarios_map_hours_onto_steps() -> None:
    # 400 steps stand for 64 hours (6.25 steps an hour); the paper's cluster of 32 ranks fails every 2 h
    # (low), so each rank every 64 h and our 4 workers together every 16 h = 100 steps; back after 4 h = 25 steps
    assert scenario_timing("low", 400, 64.0, 1.0, 4) == (100.0, 25.0)
    assert scenario_timing("high", 400, 64.0, 0.5, 4) == (12.5, 6.25)  # in seconds at 0.5 s per step
    assert scenario_timing("high", 400, 64.0, 1.0, 8) == (12.5, 12.5)  # twice the workers, twice the failures
    counts = {}
    for name in ("low", "mid", "high"):
        schedule = build_schedule("", 0.0, 0.0, 3, 1.0, 4, 400, name, 64.0)
        assert schedule == build_schedule("", 0.0, 0.0, 3, 1.0, 4, 400, name, 64.0)  # seeded
        assert all(e.rejoin_after_s == scenario_timing(name, 400, 64.0, 1.0, 4)[1] for e in schedule.events)
        counts[name] = sum(len(build_schedule("", 0.0, 0.0, seed, 1.0, 4, 400, name, 64.0).events) for seed in range(4))
    # expected 4, 8 and 16 failures a run
    assert 0 < counts["low"] < counts["mid"] < counts["high"], counts
    with pytest.raises(ValueError, match="scenario = 'extreme' is unknown; allowed: low, mid, high"):
        scenario_timing("extreme", 400, 64.0, 1.0, 4)


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 32), n=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_recovery_accounting_counts_every_id_exactly_once(m: int, n: int, seed: int) -> None:
    """Workers die at random points of their work (and others join); survivors keep what they computed and
    the ids nobody holds are re-planned. At the end every id is held by exactly one member."""
    rng = random.Random(seed)
    members = list(range(n))
    next_id = n
    held: dict[int, list[int]] = {w: [] for w in members}
    plan = plan_step(0, members, m)
    todo = {w: list(plan.ids_for(w)) for w in members}
    for _ in range(rng.randint(0, 6)):  # membership changes during the step
        for w in members:  # everyone got some way through its work
            k = rng.randint(0, len(todo[w]))
            held[w] += todo[w][:k]
        dead = set(rng.sample(members, rng.randint(0, len(members) - 1)))
        members = [w for w in members if w not in dead]
        if rng.random() < 0.3:
            held[next_id] = []
            members.append(next_id)
            next_id += 1
        counts = [sum(held[w].count(j) for w in members) for j in range(m)]
        plan = recovery_plan(
            0, members, counts, rng.choice(["even", "throughput"]), {w: rng.uniform(0.1, 2) for w in members}
        )
        todo = {w: list(plan.ids_for(w)) for w in members}
    for w in members:
        held[w] += todo[w]
    final = sorted(j for w in members for j in held[w])
    assert final == list(range(m))


def test_a_worker_at_an_injection_point_wakes_its_agent_which_otherwise_just_waits(tmp_path: Path) -> None:
    """An agent with a failure schedule hands its workers a pipe (``INJECT_FD_ENV``): a worker that reached an
    injection point writes to it (``ft.inject.wake_agent``) and the agent's wait for an exit ends at once (it
    then looks at the store). Nothing else ends that wait early: both workers here stay alive, so a wait of
    600 s (past this test's bound) returns only through the pipe; without a schedule there is no pipe."""
    script = "import time; from unbroken.ft.inject import wake_agent; time.sleep(0.5); wake_agent(); time.sleep(600)"
    agent = Agent([0], WorkerCommand((sys.executable, "-c", script)), dict(os.environ), tmp_path, injections=True)
    assert Agent([0], WorkerCommand((sys.executable, "-c", "pass")), dict(os.environ), tmp_path).wake_fds() == ()
    agent.start_all()
    try:
        assert not agent.faults.drain_wakes()
        wait_for_exit(agent.processes(), 600.0, agent.wake_fds())
        assert agent.workers[0].poll() is None  # the worker woke it, it did not exit
        assert agent.faults.drain_wakes() and not agent.faults.drain_wakes()  # one wake, taken once
    finally:
        agent.workers[0].kill()
        agent.workers[0].wait()
