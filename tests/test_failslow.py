"""The fail-slow rule (unbroken.control.coordinator.failslow) on step records with seeded noise: a persistent slow-down
is found within its documented window and only then, one-off slow steps and short slow spells never are, a recovered
worker is said to be, the threshold rises with the members' noise, and an excess time per microbatch within one
preemption is never slow (each bound shown at its derived boundary). The policies on real runs: report, rebalance,
exclude (the group's leader rebalanced around instead), and examples/plain_loop.py's millisecond microbatches, idle
and on a loaded machine."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from runner import CONTROL_COMMON, CONTROL_STEPS, ROOT, reference_run, run_command, same_final, train

from unbroken.control.coordinator.failslow import (
    MAD_TO_SIGMA,
    SlowDecision,
    SlowDetector,
    SlowRule,
    SlowState,
    Verdict,
    describe,
    exclusion,
    relative_times,
)
from unbroken.control.coordinator.slow import SlowRecorder
from unbroken.core.config import SlowPolicy, Workload
from unbroken.core.plan import agreed_speed, plan_step
from unbroken.core.records import read_records, step_losses

pytestmark = pytest.mark.timeout(30)

RULE = SlowRule(window=10, windows=3, ratio=1.5, mad_z=3.0)


def steps(n: int, workers: int, factor: dict[int, dict[int, float]], noise: float, seed: int = 0) -> list[dict]:
    """``n`` step records of ``workers`` members, each 0.1 s per microbatch times lognormal noise (sigma
    ``noise``) times ``factor[step][worker]`` where given."""
    rng = random.Random(seed)
    out = []
    for s in range(n):
        speeds = {str(w): 0.1 * rng.lognormvariate(0.0, noise) * factor.get(s, {}).get(w, 1.0) for w in range(workers)}
        out.append({"type": "step", "step": s, "committed": True, "speeds": speeds})
    return out


def verdicts(records: list[dict], rule: SlowRule = RULE) -> list[Verdict]:
    detector = SlowDetector(rule)
    return [v for r in records for v in detector.observe(r)]


def test_a_worker_slow_from_step_35_on_is_fail_slow_within_three_windows_of_whole_slow_ones() -> None:
    slow = {s: {2: 3.0} for s in range(35, 200)}
    (verdict,) = verdicts(steps(200, 4, slow, noise=0.1))
    assert verdict.worker == 2 and verdict.state is SlowState.SLOW and verdict.windows == 3
    # The window 30-39 is half slow (its median may go either way); 40-49, 50-59 and 60-69 are wholly slow.
    assert verdict.step in (59, 69)
    assert verdict.relative == pytest.approx(3.0, rel=0.2) and verdict.threshold == pytest.approx(1.5)


def test_one_off_slow_steps_and_a_slow_spell_shorter_than_two_windows_are_never_fail_slow() -> None:
    rng = random.Random(1)
    pauses = {s: {rng.randrange(4): 20.0} for s in range(0, 300, 3)}  # a GC pause or a checkpoint every 3 steps
    assert verdicts(steps(300, 4, pauses, noise=0.1)) == []
    for start in (40, 45, 51):  # 19 slow steps, (windows - 1) x window - 1, wherever they fall
        spell = {s: {1: 5.0} for s in range(start, start + 19)}
        assert verdicts(steps(300, 4, spell, noise=0.1)) == [], start
    spell = {s: {1: 5.0} for s in range(45, 65)}  # 20: the last half of one window, a whole one, half the next
    found = [(v.state, v.step) for v in verdicts(steps(300, 4, spell, noise=0.1))]
    assert found == [(SlowState.SLOW, 69), (SlowState.RECOVERED, 99)]  # well in 70-79, 80-89 and 90-99


def test_a_fail_slow_worker_that_gets_well_again_is_said_to_have_recovered_after_as_many_windows() -> None:
    slow = {s: {0: 4.0} for s in range(20, 80)}
    found = verdicts(steps(150, 4, slow, noise=0.1))
    assert [(v.worker, v.state, v.step) for v in found] == [(0, SlowState.SLOW, 49), (0, SlowState.RECOVERED, 109)]
    # One window that looks well (another member's pause threw the yardstick) recovers nobody: the streak of
    # well windows starts again at the next slow one, so it takes `windows` in a row.
    blip = {s: ({0: 4.0, 1: 10.0, 2: 10.0} if 60 <= s < 70 else {0: 4.0}) for s in range(20, 150)}
    found = verdicts(steps(150, 4, blip, noise=0.1))
    assert [(v.worker, v.state, v.step) for v in found] == [(0, SlowState.SLOW, 49)]


def test_a_member_given_no_microbatch_measured_nothing_and_is_neither_judged_nor_a_yardstick() -> None:
    step = {"speeds": {"0": 0.1, "1": 0.2, "2": 0.05}, "quotas": {"0": 4, "1": 4, "2": 0}}
    assert relative_times(step) == pytest.approx({0: 0.5, 1: 2.0})
    # Rebalanced away from (no microbatch), a fail-slow worker is neither found well again nor judged at all.
    detector = SlowDetector(SlowRule(window=4, windows=2))
    slow = steps(8, 3, {s: {2: 4.0} for s in range(8)}, noise=0.0)
    idle = [{**r, "step": 8 + i, "quotas": {"0": 4, "1": 4, "2": 0}} for i, r in enumerate(steps(8, 3, {}, 0.0))]
    found = [(v.worker, v.state, v.step) for r in slow + idle for v in detector.observe(r)]
    assert found == [(2, SlowState.SLOW, 7)] and detector.slow == {2}


def test_with_two_members_the_other_one_is_the_yardstick() -> None:
    assert relative_times({"speeds": {"0": 0.3, "1": 0.1}}) == pytest.approx({0: 3.0, 1: 1 / 3})
    (verdict,) = verdicts(steps(60, 2, {s: {1: 3.0} for s in range(60)}, noise=0.1))
    assert (verdict.worker, verdict.step) == (1, 29)


def test_the_threshold_rises_with_the_members_noise() -> None:
    noisy = steps(600, 6, {}, noise=0.4, seed=3)  # everyone wanders: relative times spread widely
    assert verdicts(noisy) == []
    bare = SlowRule(window=10, windows=3, ratio=1.01, mad_z=0.0, floor_s=0.0)  # without the noise term (nor floor)
    assert verdicts(noisy, bare) != []
    (verdict,) = verdicts(steps(60, 6, {s: {5: 6.0} for s in range(60)}, noise=0.4, seed=3))
    assert verdict.worker == 5 and verdict.threshold > RULE.ratio


def test_excluding_pays_off_when_the_time_saved_over_the_steps_left_exceeds_one_recovery() -> None:
    """6 microbatches on 3 members at 0.1 s each, worker 2 at 0.4 s: a step takes 2 x 0.4 = 0.8 s with it and
    ceil(6 / 2) x 0.1 = 0.3 s without; leaving costs its 2 microbatches, one each on the others: 0.1 s."""
    step = {"step": 29, "speeds": {"0": 0.1, "1": 0.1, "2": 0.4}, "quotas": {"0": 2, "1": 2, "2": 2}}
    estimate = exclusion(step, 2, steps_left=30)
    assert estimate is not None
    assert (estimate.step_s, estimate.step_without_s, estimate.cost_s) == pytest.approx((0.8, 0.3, 0.1))
    assert estimate.saving_s == pytest.approx(15.0) and estimate.pays_off
    last = exclusion(step, 2, steps_left=0)  # the run's last step: nothing left to save
    assert last is not None and not last.pays_off
    rebalanced = {**step, "quotas": {"0": 3, "1": 3, "2": 0}}  # the workload already routes around it
    estimate = exclusion(rebalanced, 2, steps_left=30)
    assert estimate is not None and estimate.saving_s == 0.0 and not estimate.pays_off
    assert exclusion({"speeds": {"2": 0.4}, "quotas": {"2": 6}}, 2, 30) is None  # nobody else would be left
    assert exclusion({"speeds": step["speeds"]}, 2, 30) is None  # no quotas in the record


def timed(n: int, workers: int, seconds: Callable[[int, int], float]) -> list[dict]:
    """``n`` step records of ``workers`` members, member w's seconds per microbatch in step s ``seconds(s, w)``."""
    return [
        {"type": "step", "step": s, "committed": True, "speeds": {str(w): seconds(s, w) for w in range(workers)}}
        for s in range(n)
    ]


def test_microbatches_of_1_ms_that_lose_up_to_one_preemption_a_step_never_make_a_member_fail_slow() -> None:
    """examples/plain_loop.py's grain (about 1 ms a microbatch), 3 members, 150 steps: worker 0 (the leader) loses
    up to one preemption (uniform below ``floor_s``) in every step, the others wander 5%. Its median relative time
    is about 1 + floor_s / (2 x 1 ms): several times the others', far above ``ratio`` and their spread, and the rule
    without its floor calls it fail-slow; with it, an excess within one preemption a microbatch is never slow."""
    rng = random.Random(7)
    rule = SlowRule()  # this host's floor (failslow.PREEMPTION_S)

    def seconds(step: int, worker: int) -> float:
        return 0.001 * rng.lognormvariate(0.0, 0.05) + (rng.uniform(0.0, rule.floor_s) if worker == 0 else 0.0)

    records = timed(150, 3, seconds)
    assert verdicts(records, rule) == [], "seed 7"
    without = verdicts(records, dataclasses.replace(rule, floor_s=0.0))
    assert [(v.worker, v.state, v.step) for v in without] == [(0, SlowState.SLOW, 29)], "seed 7"


def test_a_3x_slowdown_of_20_ms_microbatches_is_found_through_the_schedulers_noise() -> None:
    """20 ms microbatches, every member losing up to one preemption a step (the noise the floor is for), worker 1
    computing 3x slower from step 0: fail-slow at the end of its third window, step 29."""
    rng = random.Random(8)
    rule = SlowRule()

    def seconds(step: int, worker: int) -> float:
        compute = 0.02 * (3.0 if worker == 1 else 1.0) * rng.lognormvariate(0.0, 0.05)
        return compute + rng.uniform(0.0, rule.floor_s)

    (verdict,) = verdicts(timed(150, 3, seconds), rule)
    assert (verdict.worker, verdict.state, verdict.step) == (1, SlowState.SLOW, 29), "seed 8"
    assert verdict.relative > 2.5 and verdict.threshold == max(
        rule.ratio, 1 + rule.mad_z * verdict.sigma, 1 + rule.floor_s / verdict.microbatch_s
    )


@pytest.mark.parametrize("excess", [0.99, 1.01])
def test_a_member_is_slow_only_past_one_preemption_a_microbatch(excess: float) -> None:
    """No noise: 3 members at 1 ms a microbatch, worker 2 at 1 ms + ``excess`` x ``floor_s``. The members' spread is
    0 and 1 + floor_s / 1 ms is above ``ratio``, so the threshold is the floor's: just under one preemption a
    microbatch is not slow, just over it is."""
    rule = SlowRule()
    found = verdicts(timed(30, 3, lambda s, w: 0.001 + (excess * rule.floor_s if w == 2 else 0.0)), rule)
    assert [(v.worker, v.step) for v in found] == ([(2, 29)] if excess > 1 else [])
    for v in found:
        assert v.sigma == 0 and v.threshold == pytest.approx(1 + rule.floor_s / 0.001)


@pytest.mark.parametrize("side", [-1, 1])
def test_a_member_is_slow_only_past_three_sigmas_of_the_others_spread(side: int) -> None:
    """Five members, one window decides (``windows = 1``). In every step two of workers 0-3 take 0.1 s x (1 - a) and
    two 0.1 s x (1 + a), a = 0.1, alternating; worker 4, always the slowest, takes c x their median, so its relative
    time is c and it sits outside every other member's median. A fast one's yardstick is then the two slow ones
    (relative time (1 - a) / (1 + a)), a slow one's the mean of a fast and a slow one (1 + a): half of the others'
    relative times at each, so their median absolute deviation is half the gap, sigma = 1.4826 x that, and the
    bound 1 + 3 sigma = 1.627 is above ``ratio`` and the floor's 1 + floor_s / 0.1 s. Worker 4 at c a thousandth
    under it is not slow; a thousandth over, it is."""
    a = 0.1
    sigma = MAD_TO_SIGMA * ((1 + a) - (1 - a) / (1 + a)) / 2
    bound = 1 + 3 * sigma
    rule = SlowRule(window=10, windows=1)
    assert bound > max(rule.ratio, 1 + rule.floor_s / 0.1)
    c = bound * (1 + side * 1e-3)

    def seconds(step: int, worker: int) -> float:
        high = {0, 1} if step % 2 else {2, 3}
        return 0.1 * c if worker == 4 else 0.1 * (1 + a if worker in high else 1 - a)

    found = verdicts(timed(10, 5, seconds), rule)
    assert [(v.worker, v.step) for v in found] == ([(4, 9)] if side > 0 else [])
    for v in found:
        assert v.sigma == pytest.approx(sigma) and v.threshold == pytest.approx(bound)


@pytest.mark.parametrize("rule", [SlowRule(4, 2), SlowRule(5, 3)], ids=["4x2", "5x3"])
def test_a_spell_the_launch_check_says_is_found_is_found_by_then(rule: SlowRule) -> None:
    """``SlowRule.found_at`` (what the launch's warning reckons with: a window counts when more than half of it is
    slow) against the detector on noise-free records, a worker 4x slower in steps first-last: where it says a
    step, the detector's verdict comes by that step; where the detector finds nothing, it says None."""
    for first in range(0, 3 * rule.window):
        for last in range(first, 6 * rule.window):
            spell = {s: {1: 4.0} for s in range(first, last + 1)}
            found = [v.step for v in verdicts(steps(8 * rule.window, 3, spell, noise=0.0), rule)[:1]]
            expected = rule.found_at(first, last)
            assert expected is None or (found and found[0] <= expected), (first, last, found, expected)
            assert found or expected is None, (first, last)


class Tee:
    """What a ``SlowRecorder`` writes, kept."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)


def test_under_exclude_the_recorder_hands_over_a_worker_worth_excluding_and_judges_it_afresh() -> None:
    def run(total_steps: int) -> tuple[list[dict], list[int]]:
        tee, excluded = Tee(), []
        rule = SlowRule(window=4, windows=2)
        recorder = SlowRecorder(tee, rule, (), SlowPolicy.EXCLUDE, total_steps, lambda w, why: excluded.append(w))
        for record in steps(16, 3, {s: {2: 4.0} for s in range(16)}, noise=0.0):
            if record["step"] == 8 and excluded:  # removed after its verdict, then (say) restarted, still slow
                recorder.write({"type": "membership", "epoch": 2, "members": [0, 1]})
            recorder.write({**record, "quotas": {"0": 2, "1": 2, "2": 2}})
        return tee.records, excluded

    records, excluded = run(total_steps=100)
    decided = [(r["worker"], r["step"], r["decision"]) for r in records]
    assert decided == [(2, 7, SlowDecision.EXCLUDE), (2, 15, SlowDecision.EXCLUDE)]  # judged afresh once back
    assert excluded == [2, 2] and records[0]["steps_left"] == 92 and records[0]["saving_s"] > records[0]["cost_s"]
    records, excluded = run(total_steps=8)  # step 7 is the last: excluding saves nothing
    assert [(r["worker"], r["step"], r["decision"]) for r in records] == [(2, 7, SlowDecision.KEEP)]
    assert excluded == []


def test_under_exclude_the_leader_is_rebalanced_around_instead_and_never_handed_over() -> None:
    """Worker 0 leads the group (it publishes the records and writes the checkpoints): fail-slow under "exclude",
    where excluding it would pay off, it is rebalanced around (the throughput workload on), not handed over; the
    workload goes back when it has recovered, or when it leaves. Where the config's workload is already
    throughput, it is kept."""

    def run(workload: Workload, leaves: bool = False) -> tuple[list[dict], list[int], list[bool]]:
        tee, excluded, switched = Tee(), [], []
        recorder = SlowRecorder(
            tee, SlowRule(window=4, windows=2), (), SlowPolicy.EXCLUDE, 100,
            lambda w, why: excluded.append(w), switched.append, workload=workload,
        )  # fmt: skip
        recorder.write({"type": "membership", "epoch": 1, "members": [0, 1, 2]})
        for record in steps(24, 3, {s: {0: 4.0} for s in range(8)}, noise=0.0):  # slow in 0-7, well from 8 on
            if leaves and record["step"] == 10:
                recorder.write({"type": "membership", "epoch": 2, "members": [1, 2]})
            recorder.write({**record, "quotas": {"0": 3, "1": 3, "2": 2}})
        return tee.records, excluded, switched

    records, excluded, switched = run(Workload.EVEN)
    decided = [(r["worker"], r["state"], r["step"], r["decision"], r.get("leader")) for r in records]
    assert decided == [(0, "slow", 7, "rebalance", True), (0, "recovered", 15, "rebalance", None)]
    assert excluded == [] and switched == [True, False] and records[0]["saving_s"] > records[0]["cost_s"]
    assert "rebalance instead of exclude" in describe(records[0]) and "never excluded" in describe(records[0])
    records, excluded, switched = run(Workload.EVEN, leaves=True)  # it died at step 10: the workload goes back
    assert [(r["worker"], r["decision"]) for r in records] == [(0, "rebalance")] and switched == [True, False]
    records, excluded, switched = run(Workload.THROUGHPUT)
    assert [(r["decision"], r.get("leader")) for r in records] == [("keep", True), ("report", None)]
    assert excluded == [] and switched == []


def test_under_rebalance_the_recorder_switches_the_throughput_workload_on_and_back_off() -> None:
    switched: list[bool] = []
    tee = Tee()
    recorder = SlowRecorder(tee, SlowRule(window=4, windows=2), (), SlowPolicy.REBALANCE, 100, None, switched.append)
    for record in steps(16, 3, {s: {2: 4.0} for s in range(8)}, noise=0.0):  # slow in 0-7, well from 8 on
        recorder.write(record)
    assert [(r["state"], r["step"], r["decision"]) for r in tee.records] == [
        (SlowState.SLOW, 7, SlowDecision.REBALANCE),
        (SlowState.RECOVERED, 15, SlowDecision.REBALANCE),  # well in 8-11 and 12-15
    ]
    assert switched == [True, False]


@pytest.mark.parametrize(
    "rule", [{"window": 1}, {"windows": 0}, {"ratio": 1.0}, {"mad_z": -1.0}], ids=["window", "windows", "ratio", "z"]
)
def test_a_bad_rule_is_refused(rule: dict) -> None:
    with pytest.raises(ValueError, match="needs window >= 2"):
        SlowRule(**rule)


# The control runs' steps with microbatches of 4 sequences, not 1: a slow worker here is one whose compute takes
# longer (``factor``), and the rule judges the time a microbatch takes, so it must be long beside the noise of a
# loaded machine. Its own failure-free run: the sequences differ from the control reference's.
COMMON = [*CONTROL_COMMON, "--data.microbatch_size=4"]
FIXTURE_RUNS = {"reference": 1}  # conftest adds its time to each test's bound


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    return reference_run(tmp_path_factory, "failslow", data_cache_dir, *COMMON)


# Worker 2 computes 4x slower from step 4 to the end; worker 1 is 20x slower in step 12 alone (a pause).
SLOWDOWN = "slow:worker=2,factor=4,steps=4-39"
SLOWDOWNS = f"{SLOWDOWN}; slow:worker=1,factor=20,steps=12-12"


def slowed_run(tmp_path: Path, data_cache_dir: Path, policy: str, *extra: str, schedule: str = SLOWDOWNS) -> Path:
    """3 workers under ``schedule`` in exact mode, the rule in windows of 4 steps, 2 of them; the run directory."""
    run = tmp_path / "run"
    rule = [f"--recovery.slow={policy}", "--recovery.slow_window=4", "--recovery.slow_windows=2"]
    result = train(run, data_cache_dir, *COMMON, *rule, *extra, f"--failures.schedule={schedule}", workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.mark.timeout(240)
def test_under_report_a_persistently_slow_worker_is_recorded_and_the_run_is_unchanged(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """Windows of 4 steps, 2 of them: worker 2 (slow from step 4) is fail-slow at the end of a window, by the end
    of 12-15 at the latest (its first whole slow window is 4-7, or 8-11 if step 4's speeds are not yet slow in
    the records: a step's speeds are those agreed in its reduction), and at the step the rule gives when
    replayed on the run's own step records (on a loaded machine worker 2 may have been slow in 0-3 as well);
    worker 1's one slow step never makes it fail-slow. ``report`` changes nothing else: the run is bitwise the
    failure-free one."""
    alerts = tmp_path / "alerts.jsonl"
    run = slowed_run(tmp_path, data_cache_dir, "report", f"--metrics.alert_command=sh -c 'cat >> {alerts}'")
    slow = read_records(run, "slow")
    assert [(r["worker"], r["state"], r["decision"]) for r in slow] == [(2, "slow", "report")], slow
    (alert,) = [json.loads(line) for line in alerts.read_text().splitlines()]  # the operator is told
    assert alert["alert"] == "fail_slow" and alert["record"] == slow[0]
    assert slow[0]["step"] in (7, 11, 15) and slow[0]["relative"] > 1.5
    replayed = verdicts(read_records(run, "step"), SlowRule(window=4, windows=2))
    assert [(v.worker, v.state, v.step) for v in replayed] == [(2, SlowState.SLOW, slow[0]["step"])], replayed
    assert step_losses(run) == step_losses(reference)
    same_final(run, reference, CONTROL_STEPS)


@pytest.mark.timeout(240)
def test_under_exclude_a_persistently_slow_worker_is_removed_and_the_run_is_the_failure_free_one(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """The same slowdowns under ``exclude`` (and ``slow_rejoin = false``): worker 2 is fail-slow at the end of a
    window, its exclusion pays off (most of the run is left), and it is removed like a failed worker: a
    failure record that says fail-slow, an epoch without it, no step after that epoch with it, never back.
    Worker 1's one slow step excludes nobody. In exact mode the run is bitwise the failure-free one, as a run
    where worker 2 were killed at that step is."""
    rejoin = ["--recovery.slow_rejoin=false", "--failures.mttr_s=0.5"]  # restarted, and refused once back
    run = slowed_run(tmp_path, data_cache_dir, "exclude", *rejoin)
    slow, *after = read_records(run, "slow")
    assert (slow["worker"], slow["state"], slow["decision"]) == (2, "slow", "exclude"), slow
    # Two members are left, each the other's only yardstick: here, two one-thread workers sharing 2 cores with the
    # coordinator and the launcher, one of them can be 1.5-2x the other's time for seconds on end (CI: worker 1 at
    # 1.86x over steps 13-19, then worker 0 over 20-25), and the rule may say so. Excluding one of two pays off only
    # if it is more than twice as slow (the other computes every microbatch then): it is kept, nobody else leaves.
    assert all(r["worker"] != 2 and r["decision"] != "exclude" for r in after), after
    assert slow["step"] in (7, 11, 15) and slow["saving_s"] > slow["cost_s"] and slow["steps_left"] > 0
    (failure,) = read_records(run, "failure")
    assert failure["worker"] == 2 and failure["why"].startswith("fail-slow"), failure
    (removal,) = [m for m in read_records(run, "membership") if m["reason"] == "died: 2"]
    assert removal["members"] == [0, 1] and removal["time"] > slow["time"]
    later = [r for r in read_records(run, "step") if r["epoch"] >= removal["epoch"]]
    assert later[0]["recoveries"] >= 1  # it left in (or just before) that step: the survivors recovered
    assert len(later) > 1 and all("2" not in r["quotas"] for r in later[1:])
    assert all(m["members"] == [0, 1] for m in read_records(run, "membership") if m["epoch"] >= removal["epoch"])
    refused = read_records(run, "refused")  # its restart came back (unless the run ended first) and was refused
    assert all(r["worker"] == 2 and "slow_rejoin = false" in r["reason"] for r in refused) and len(refused) <= 1
    assert step_losses(run) == step_losses(reference)
    same_final(run, reference, CONTROL_STEPS)


@pytest.mark.timeout(240)
def test_under_rebalance_a_fail_slow_worker_gets_fewer_microbatches_and_the_run_is_unchanged(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """Worker 2's slowdown alone under ``rebalance``: at its verdict the coordinator publishes an epoch of the
    same members with the throughput workload; from it on every step is planned by that workload from the speeds
    the step before agreed (so worker 2, 4x slower, gets fewer than the 2 of the 8 microbatches the even workload
    gives it, 3, 3, 2 before, over those steps). It stays slow to the end, so the workload is never switched back.
    In exact mode the run is bitwise the failure-free one.

    Without worker 1's one-step pause of the other tests: under the throughput workload a worker that paused gets
    one microbatch a step, so its smoothed speed (halved towards the new time per microbatch) takes some five steps
    to come back, over two windows of 4; the other members' yardstick is wide all that time, and in one run (with
    another test file beside it on the 2 cores) worker 2's 2.2x did not clear it in two windows running: judged
    recovered at step 19, the workload switched back, slow again at 27 (docs/goodput.md)."""
    run = slowed_run(tmp_path, data_cache_dir, "rebalance", schedule=SLOWDOWN)
    (slow,) = read_records(run, "slow")
    assert (slow["worker"], slow["state"], slow["decision"]) == (2, "slow", "rebalance"), slow
    memberships = read_records(run, "membership")
    (switch,) = [m for m in memberships if m.get("workload")]
    assert switch["workload"] == "throughput" and switch["members"] == [0, 1, 2] and switch["time"] > slow["time"]
    assert all(m.get("workload") == "throughput" for m in memberships if m["epoch"] > switch["epoch"])
    steps_ = sorted((r for r in read_records(run, "step") if not r.get("republished")), key=lambda r: r["step"])
    before = [r for r in steps_ if r["epoch"] < switch["epoch"] and r["alive"] == 3]
    after = [r for r in steps_ if r["epoch"] >= switch["epoch"]]
    assert before and all(sorted(r["quotas"].values()) == [2, 3, 3] and r["quotas"]["2"] == 2 for r in before)
    # Each step's plan from the speeds of the step before, where its record carries them: a step known only from
    # its republished record (the epoch's leader took the new epoch mid-step and received the state of the step
    # the others committed: r89) has none, and the plan after it is not recomputed from the records.
    by_step = {r["step"]: r for r in steps_}
    checked = 0
    for record in after:
        previous = by_step.get(record["step"] - 1)
        if previous is None:
            continue
        speeds = {int(w): s for w, s in previous["speeds"].items()}
        plan = plan_step(record["step"], [0, 1, 2], 8, Workload.THROUGHPUT, speeds)
        assert record["quotas"] == {str(w): len(plan.ids_for(w)) for w in (0, 1, 2)}, (previous, record)
        checked += 1
    assert checked >= len(after) - (CONTROL_STEPS - len(steps_)), (checked, len(after), len(steps_))
    # the speeds as the group agreed them, to SPEED_DIGITS significant digits: what the planner read
    assert all(s == agreed_speed(s) for r in steps_ for s in r.get("speeds", {}).values()), steps_
    assert after and sum(r["quotas"]["2"] for r in after) < 2 * len(after), [r["quotas"] for r in after]
    assert not read_records(run, "failure")
    assert step_losses(run) == step_losses(reference)
    same_final(run, reference, CONTROL_STEPS)


# -- examples/plain_loop.py: microbatches of about a millisecond (issue 63's acceptance runs) ---------------------
PLAIN = ROOT / "examples" / "plain_loop.py"
PLAIN_STEPS = 150


def plain_run(out: Path, *args: str) -> Path:
    """``unbroken launch --workers 3 examples/plain_loop.py --train.steps=150`` (forked: the claim is not about
    how a worker starts), no failure; the run directory."""
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", "3", "--out", str(out), "--quiet", "--fork"]
    cmd += [f"--train.steps={PLAIN_STEPS}", "--checkpoint.every=0", *args, str(PLAIN)]
    result = run_command(cmd, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.timeout(300)
def test_the_plain_loop_of_three_workers_has_no_fail_slow_worker(tmp_path: Path) -> None:
    """Nobody is slowed: at this grain (a millisecond or a few a microbatch) the members' differences are the
    scheduler's, within one preemption (``floor_s``), and no verdict is recorded."""
    run = plain_run(tmp_path / "run")
    assert len(read_records(run, "step")) >= PLAIN_STEPS
    assert read_records(run, "slow") == []


@pytest.mark.timeout(300)
def test_the_plain_loop_on_a_machine_loaded_by_another_job_never_excludes_its_leader(tmp_path: Path) -> None:
    """The same under ``recovery.slow = "exclude"``, with two processes that burn a CPU each for the run's whole
    length (another job on the machine): their preemptions land on the members unevenly. The leader (worker 0) is
    never excluded: it is in every epoch, no failure is recorded for it, and no ``slow`` record decides to exclude
    it. (On 2 cores at a load of 8, one window in 15 was seen past the floor: a worker preempted twice a
    microbatch for a window; the floor is one preemption, so a verdict under such a load is possible, rare.)"""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        run = plain_run(tmp_path / "run", "--recovery.slow=exclude")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert len(read_records(run, "step")) >= PLAIN_STEPS
    assert all(0 in m["members"] for m in read_records(run, "membership"))
    assert all(f["worker"] != 0 for f in read_records(run, "failure"))
    slow = read_records(run, "slow")
    assert all(r["decision"] != "exclude" for r in slow if r["worker"] == 0), slow


@pytest.mark.timeout(240)
def test_under_exclude_a_slow_leader_is_rebalanced_around_and_the_run_is_the_failure_free_one(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """Worker 0, the group's leader (it publishes the records and writes the checkpoints), 4x slower from step 4
    under ``exclude``: fail-slow at the end of a window (as worker 2 in the tests above), and excluding it would
    pay off, but it is not removed: the ``slow`` record says ``rebalance`` (``leader``), the coordinator publishes
    an epoch of the same members with the throughput workload, and from it on worker 0 gets fewer microbatches
    than its 3 of 8. No failure, every epoch has it, and in exact mode the run is bitwise the failure-free one."""
    run = slowed_run(tmp_path, data_cache_dir, "exclude", schedule="slow:worker=0,factor=4,steps=4-39")
    slow, *after = read_records(run, "slow")
    assert (slow["worker"], slow["state"], slow["decision"], slow.get("leader")) == (0, "slow", "rebalance", True)
    assert slow["step"] in (7, 11, 15) and slow["saving_s"] > slow["cost_s"], slow
    assert all(r["decision"] != "exclude" for r in after), after
    assert not read_records(run, "failure")
    memberships = read_records(run, "membership")
    assert all(m["members"] == [0, 1, 2] for m in memberships), memberships
    (switch,) = [m for m in memberships if m.get("workload")]
    assert switch["workload"] == "throughput" and switch["time"] > slow["time"]
    later = [r for r in read_records(run, "step") if r["epoch"] >= switch["epoch"] and not r.get("republished")]
    assert later and sum(r["quotas"]["0"] for r in later) < 3 * len(later), [r["quotas"] for r in later]
    assert step_losses(run) == step_losses(reference)
    same_final(run, reference, CONTROL_STEPS)
