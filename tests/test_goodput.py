"""The goodput account (unbroken.core.goodput): a hand-worked timeline whose every second is known, a restart
policy's relaunch, and the account of a real run with kills and a rejoin against its own recovery records."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from runner import EXACT, ONE_THREAD, RECOVERY_STEPS, ROOT, train

from unbroken.cli import main
from unbroken.core.config import load_config
from unbroken.core.goodput import Bucket, Goodput, Tracker, account
from unbroken.core.records import RecordKind, make, read_records, sessions
from unbroken.sim.replay import MIN_COST_S, replay

pytestmark = pytest.mark.timeout(60)

TOKENS = 128  # every step's


class Timeline:
    """Records of a run made by hand: steps one after the other, each ``gap`` after the previous commit."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.records: list[dict[str, Any]] = [make(RecordKind.COORDINATOR, start, incarnation="a", restored_epoch=0,
                                                   address="-", status="-")]  # fmt: skip
        self.step = 0

    def at(self, kind: RecordKind, offset: float = 0.0, **fields: Any) -> None:
        self.records.append(make(kind, self.now + offset, **fields))

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def commit(self, seconds: float, alive: int = 4, **fields: Any) -> None:
        """A step of ``seconds`` from now; its events are recorded by ``events(start)`` before it commits."""
        self.now += seconds
        record = {
            "step": self.step,
            "loss": 1.0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "step_time_s": seconds,
            "tokens": TOKENS,
            "alive": alive,
            "epoch": 1,
            "microbatches": 4,
            "committed": True,
            "recomputed": 0,
            "dropped": 0,
            "recoveries": 0,
            "efficient": 0,
        }
        record.update(fields)
        self.records.append(make(RecordKind.STEP, self.now, **record))
        self.step += 1


def test_a_hand_worked_run_puts_every_second_where_it_went() -> None:
    """Steps of 1.0 s, 0.1 s apart (the cadence): the ideal step is 1.1 s. Every deviation is placed by hand."""
    t = Timeline()
    t.wait(2.0)  # launch to the first step: start
    t.commit(1.5)  # the first step: 0.4 s of warm-up beyond the ideal 1.1, start again
    for _ in range(2):
        t.wait(0.1)
        t.commit(1.0)
    t.wait(0.1)
    t.at(RecordKind.EVAL, 0.4, step=2, val_loss=1.0, val_ppl=math.e)
    t.wait(0.5)  # 0.5 s beyond the cadence, an evaluation in it
    t.commit(1.0)
    t.at(RecordKind.CHECKPOINT, 0.35, step=4, path="-", seconds=0.3)
    t.wait(0.4)  # 0.3 of it the checkpoint's, 0.0 left beyond the cadence: 0.3 checkpoint, -0.0 unattributed
    # A kill in step 4, declared 0.2 s after its delivery; the group re-formed in 0.05 s; one microbatch
    # recomputed: the step took 1.6 s and the usual 0.1 before it, 0.6 beyond the ideal: 0.2 + 0.05 measured,
    # 0.35 recomputing.
    t.at(RecordKind.FAILURE, 0.8, worker=2, why="killed", epoch=2, detection_s=0.2)
    t.at(RecordKind.MEMBERSHIP, 0.8, epoch=2, members=[0, 1, 3], reason="died: 2", elapsed_s=1.0)
    t.at(RecordKind.RECOVERY, 1.0, step=4, from_epoch=1, epoch=2, alive=3, reform_s=0.05, missing=[2],
         time_reformed=t.now + 0.95, time_recovered=t.now + 1.0, state_bytes=0)  # fmt: skip
    t.commit(1.6, alive=3, recoveries=1, recomputed=1)
    t.wait(0.1)
    t.commit(1.3, alive=3)  # three workers do four's work: 0.3 s workers_down
    t.wait(0.1)
    # Worker 2 joins in step 6: formed in 0.02 s, the state sent in 0.4 s; 0.6 beyond the ideal, 0.18 unexplained.
    t.at(RecordKind.MEMBERSHIP, 0.0, epoch=3, members=[0, 1, 2, 3], reason="joined: 2", elapsed_s=1.0)
    t.at(RecordKind.RECOVERY, 0.5, step=6, from_epoch=2, epoch=3, alive=4, reform_s=0.02, missing=[0, 1, 2, 3],
         time_reformed=t.now + 0.1, time_recovered=t.now + 0.5, state_bytes=1000)  # fmt: skip
    t.commit(1.6, recoveries=1)
    t.wait(0.1)
    t.commit(1.0, committed=False, skipped=True)  # a non-finite gradient: 1.1 s for nothing
    t.wait(0.1)
    # Worker 0 three times slower than the median member: it waits 0.6 s for it, of 0.5 s beyond the ideal.
    t.commit(1.5, quotas={"0": 1, "1": 1, "2": 1, "3": 1}, speeds={"0": 0.9, "1": 0.3, "2": 0.3, "3": 0.3})
    t.at(RecordKind.FINAL, 0.2, step=9, checksums={}, identical=True, checkpoint="-")

    g = account(t.records)
    assert g.ideal_step_s == pytest.approx(1.1)  # the median clean step (1, 2, 3, 8) and the cadence
    assert g.tokens == 8 * TOKENS  # step 7 was skipped
    assert g.wall_s == pytest.approx(t.now + 0.2 - 100.0)
    expected = {
        Bucket.START: 2.0 + 0.4,
        Bucket.EVALUATION: 0.5,
        Bucket.CHECKPOINT: 0.3,
        Bucket.DETECTION: 0.2,
        Bucket.REFORMATION: 0.05 + 0.02,
        Bucket.RECOMPUTE: 0.35,
        Bucket.WORKERS_DOWN: 0.3,
        Bucket.TRANSFER: 0.4,
        Bucket.NONFINITE: 1.1,
        Bucket.SLOW: 0.5,
        Bucket.UNATTRIBUTED: 0.18 + 0.2,  # the join's unexplained rest; the tail after the last commit
    }
    got = {b: s for b, s in g.buckets.items() if abs(s) > 1e-9}
    assert got == pytest.approx(expected)
    assert g.badput_s == pytest.approx(g.wall_s - g.tokens / g.ideal_tokens_per_s)
    assert [b for b, _ in g.top(3)] == [Bucket.START, Bucket.NONFINITE, Bucket.EVALUATION]
    assert "goodput" in g.line() and "start 2.40 s" in g.line()


def test_a_restart_policy_relaunch_counts_the_down_time_and_the_steps_trained_again() -> None:
    t = Timeline()
    t.wait(1.0)
    for _ in range(4):
        t.commit(1.0)
        t.wait(0.1)
    # Killed in step 4; the job stops and relaunches from the checkpoint of step 2: steps 2 and 3 again.
    t.wait(2.0)
    t.at(RecordKind.STOPPED, reason="restart")
    t.wait(3.0)  # down between the sessions
    t.at(RecordKind.COORDINATOR, incarnation="b", restored_epoch=0, address="-", status="-")
    t.at(RecordKind.RESTART, 0.5, workers=[0, 1, 2, 3], stop_and_relaunch_s=3.5)
    t.at(RecordKind.RESUME, 0.6, step=2, path="-")
    t.wait(1.5)  # the relaunch's start
    t.step = 2
    for _ in range(3):
        t.commit(1.0)
        t.wait(0.1)

    g = account(t.records)
    assert g.ideal_step_s == pytest.approx(1.1)
    assert g.tokens == 5 * TOKENS
    assert g.buckets[Bucket.START] == pytest.approx(1.0)
    # Steps 2 and 3 of the first session (each 1.0 s and the 0.1 s before it), its 2.1 s after its last step,
    # the 3.0 s between the sessions, the relaunch's 1.5 s before its first step.
    assert g.buckets[Bucket.RESTART] == pytest.approx(2.2 + 2.1 + 3.0 + 1.5)
    # Each session's first step took 1.0 s, 0.1 less than the ideal (the cadence before it is the start's).
    assert g.buckets[Bucket.UNATTRIBUTED] == pytest.approx(-0.2)
    assert g.badput_s == pytest.approx(g.wall_s - g.tokens / g.ideal_tokens_per_s)


def test_a_join_between_two_steps_and_a_step_known_only_as_republished_are_accounted() -> None:
    """A join's re-formation and state transfer that happen between two steps are measured as inside one; a
    step whose only record is a republished one (its leader did not take part in its commit: no tokens or
    timing of its own) still committed the usual tokens, in the time around its record. Seen in clean runs 16 and
    55 (the recovery fixture's run)."""
    t = Timeline()
    t.at(RecordKind.MEMBERSHIP, epoch=1, members=[0, 1, 2], reason="start", elapsed_s=0.0)
    t.wait(1.0)
    for _ in range(4):
        t.commit(1.0, alive=3)
        t.wait(0.1)
    t.at(RecordKind.MEMBERSHIP, epoch=2, members=[0, 1, 2, 3], reason="joined: 3", elapsed_s=0.0)
    t.records.append(make(RecordKind.STEP, t.now, step=t.step, loss=1.0, lr=1e-3, grad_norm=1.0,
                          step_time_s=math.nan, tokens=0, alive=4, epoch=2, microbatches=4, committed=True,
                          recomputed=0, dropped=0, recoveries=0, efficient=0, republished=True))  # fmt: skip
    t.step += 1
    t.wait(0.9)  # the join: the group re-formed (0.3 s), then the state sent (0.5 s)
    t.at(RecordKind.RECOVERY, step=t.step, from_epoch=1, epoch=2, alive=4, reform_s=0.3, missing=[0, 1, 2, 3],
         time_reformed=t.now - 0.5, time_recovered=t.now, state_bytes=1000)  # fmt: skip
    t.commit(1.0)
    g = account(t.records)
    assert g.tokens == 6 * TOKENS
    assert g.buckets[Bucket.REFORMATION] == pytest.approx(0.3)
    assert g.buckets[Bucket.TRANSFER] == pytest.approx(0.5)
    # The republished step's tokens were committed in the time around its record: that time holds their ideal
    # time, not badput (the buckets still add up to the wall time less the tokens' ideal time; clean run 55).
    assert g.badput_s == pytest.approx(g.wall_s - g.tokens / g.ideal_tokens_per_s)


def test_a_joins_state_transfer_counts_from_the_step_that_waited_for_it() -> None:
    """Worker 3's group formed 0.4 s into step 4, while the survivors still computed it: the state after step 4
    could only be sent once step 4 was committed. Step 5 took 0.5 s more than the ideal 1.1 s, 0.4 s of it until
    the state was received: that is the transfer, not the 1.1 s since the group formed (which would overdraw the
    step by 0.6 s and take it off ``unattributed``)."""
    t = Timeline()
    t.at(RecordKind.MEMBERSHIP, epoch=1, members=[0, 1, 2], reason="start", elapsed_s=0.0)
    t.wait(1.0)
    for _ in range(4):
        t.commit(1.0)
        t.wait(0.1)
    t.at(RecordKind.MEMBERSHIP, 0.3, epoch=2, members=[0, 1, 2, 3], reason="joined: 3", elapsed_s=0.0)
    formed = t.now + 0.4
    t.commit(1.0)
    t.wait(0.1)
    t.at(RecordKind.RECOVERY, 0.4, step=5, from_epoch=1, epoch=2, alive=4, reform_s=0.0, missing=[0, 1, 2, 3],
         time_reformed=formed, time_recovered=t.now + 0.4, state_bytes=1000)  # fmt: skip
    t.commit(1.5, recoveries=1)
    g = account(t.records)
    assert g.ideal_step_s == pytest.approx(1.1)
    # the launch to step 0 (1.0 s), the transfer; unattributed: step 0 0.1 s faster than the ideal, step 5's rest
    expected = {b: 0.0 for b in Bucket} | {Bucket.START: 1.0, Bucket.TRANSFER: 0.4, Bucket.UNATTRIBUTED: -0.1 + 0.1}
    assert g.buckets == pytest.approx(expected, abs=1e-9)
    assert g.badput_s == pytest.approx(g.wall_s - g.tokens / g.ideal_tokens_per_s)


# -- what a real run's records say independently of the account's arithmetic ---------------------------------------
def assert_accounted_by_the_timestamps(run: Path, records: list[dict[str, Any]], g: Goodput, committed: int) -> None:
    """The account of a finished one-session run against what its records show without it:

    - every second of the wall (the records' own first and last timestamps) is the committed tokens' ideal time
      (the tokens counted from the config: ``committed`` steps, none dropped) or in a bucket;
    - detection is, for each failure, the time from its kill's delivery (the agent's ``injected`` record, written
      before the signal) to its declaration (the ``failure`` record);
    - transfer is each join's state sent, up to its recovery record's ``time_recovered``, from its ``time_reformed``
      or, where the group formed ahead (while the survivors still computed), from the start of the step or of the
      gap between steps that its record falls in (the survivors were computing until then, not sending);
    - each re-formation (a duration on a worker's monotonic clock, which no pair of records gives) is taken in full,
      and began after what caused it: the epoch it recovered into was made by a kill delivered (``injected``) or
      an admission (``admitted``, recorded before the epoch is published), so it lasted no longer than from that
      record to its group's formation (``time_reformed``), up to what the kernel's slew of the wall clock against
      the monotonic one can make of that interval (at most 500 ppm).

    Float rounding: a step's start, its commit less its time, is rounded to half an ulp of the timestamps; sums of
    seconds add nothing comparable. Every record's timestamp takes part in at most one such rounding."""
    assert len(sessions(records)) == 1
    times = [r["time"] for r in records if isinstance(r.get("time"), int | float)]
    tolerance = len(times) * math.ulp(max(times))
    wall = max(times) - min(times)
    cfg = load_config(run / "config.toml")
    tokens = committed * cfg.train.microbatches * cfg.data.microbatch_size * cfg.data.seq_len
    assert g.tokens == tokens
    assert g.wall_s == pytest.approx(wall, abs=tolerance)
    assert g.badput_s + tokens / g.ideal_tokens_per_s == pytest.approx(wall, abs=tolerance)

    injected = {r["event"]: r["time"] for r in records if r["type"] == RecordKind.INJECTED}
    failures = [r for r in records if r["type"] == RecordKind.FAILURE]
    assert failures and all(f.get("event") in injected for f in failures), (failures, injected)
    detected = sum(f["time"] - injected[f["event"]] for f in failures)
    assert g.buckets[Bucket.DETECTION] == pytest.approx(detected, abs=tolerance)

    recoveries = [r for r in records if r["type"] == RecordKind.RECOVERY]
    joins = [r for r in recoveries if r["state_bytes"]]
    assert joins and all(r["time_reformed"] <= r["time_recovered"] <= r["time"] for r in recoveries), recoveries
    transferred = sum(r["time_recovered"] - max(r["time_reformed"], _interval_start(records, r["time"])) for r in joins)
    assert g.buckets[Bucket.TRANSFER] == pytest.approx(transferred, abs=tolerance)
    assert g.buckets[Bucket.REFORMATION] == pytest.approx(sum(r["reform_s"] for r in recoveries), abs=tolerance)
    caused = _epoch_causes(records)
    for r in recoveries:
        began = min(caused[e] for e in range(r["from_epoch"] + 1, r["epoch"] + 1))
        assert r["reform_s"] <= (r["time_reformed"] - began) * (1 + 500e-6), (r, began)


def _interval_start(records: list[dict[str, Any]], t: float) -> float:
    """Where the interval of the timeline holding time ``t`` began: the latest step start (its commit less its
    time) or commit before ``t``."""
    steps = [r for r in records if r["type"] == RecordKind.STEP and math.isfinite(r["step_time_s"])]
    return max(x for r in steps for x in (r["time"] - r["step_time_s"], r["time"]) if x < t)


def _epoch_causes(records: list[dict[str, Any]]) -> dict[int, float]:
    """Epoch -> the timestamp of the record of what made it (see ``assert_accounted_by_the_timestamps``): the
    delivery of the kill of a worker it removed, the admission of a worker it added (the last before it)."""
    injected = {r["event"]: r["time"] for r in records if r["type"] == RecordKind.INJECTED}
    killed = {f["worker"]: injected[f["event"]] for f in records if f["type"] == RecordKind.FAILURE}
    memberships = [r for r in records if r["type"] == RecordKind.MEMBERSHIP]
    causes = {}
    for before, after in zip(memberships, memberships[1:], strict=False):
        removed, added = set(before["members"]) - set(after["members"]), set(after["members"]) - set(before["members"])
        admitted = [
            max(
                r["time"]
                for r in records
                if r["type"] == RecordKind.ADMITTED and r["worker"] == w and r["time"] <= after["time"]
            )
            for w in added
        ]
        causes[after["epoch"]] = min([*(killed[w] for w in removed), *admitted])
    return causes


def test_a_real_run_with_kills_and_a_rejoin_is_accounted_by_its_own_records(recovery_runs: dict[str, Path]) -> None:
    """The recovery fixture's exact run: two kills, their re-formations and a rejoin with a state transfer,
    accounted against what the records' timestamps show (``assert_accounted_by_the_timestamps``)."""
    run = recovery_runs["exact_failures"]
    records = read_records(run)
    g = account(records)
    assert len([r for r in records if r["type"] == RecordKind.FAILURE]) == 2
    assert_accounted_by_the_timestamps(run, records, g, committed=RECOVERY_STEPS)
    for bucket in (Bucket.START, Bucket.CHECKPOINT, Bucket.EVALUATION, Bucket.SLOW):
        assert g.buckets[bucket] > 0, bucket
    assert 0 < g.ratio < 1


def test_the_timestamps_check_fires_on_a_second_lost_or_in_the_wrong_bucket(recovery_runs: dict[str, Path]) -> None:
    """``assert_accounted_by_the_timestamps`` fails an account of the same run that lost a millisecond, one that
    moved a millisecond between buckets (each measured bucket), one that counted a step too many, and records whose
    re-formation would have begun before what caused it."""
    run = recovery_runs["exact_failures"]
    records = read_records(run)
    g = account(records)
    doctored = [replace(g, buckets={**g.buckets, Bucket.UNATTRIBUTED: g.buckets[Bucket.UNATTRIBUTED] + 1e-3})]
    for bucket in (Bucket.DETECTION, Bucket.TRANSFER, Bucket.REFORMATION):
        moved = {**g.buckets, bucket: g.buckets[bucket] + 1e-3}
        moved[Bucket.UNATTRIBUTED] -= 1e-3
        doctored.append(replace(g, buckets=moved))
    for wrong in doctored:
        with pytest.raises(AssertionError):
            assert_accounted_by_the_timestamps(run, records, wrong, committed=RECOVERY_STEPS)
    with pytest.raises(AssertionError):
        assert_accounted_by_the_timestamps(run, records, g, committed=RECOVERY_STEPS - 1)
    first = next(r for r in records if r["type"] == RecordKind.RECOVERY)
    early = [{**r, "reform_s": r["time_reformed"] - min(_epoch_causes(records).values()) + 1.0} if r is first else r
             for r in records]  # fmt: skip
    with pytest.raises(AssertionError):
        assert_accounted_by_the_timestamps(run, early, account(early), committed=RECOVERY_STEPS)


def test_the_live_tracker_gives_the_account_so_far_every_n_committed_steps() -> None:
    t = Timeline()
    t.wait(1.0)
    for _ in range(7):
        t.commit(1.0)
        t.wait(0.1)
    t.records.insert(3, make(RecordKind.USER, 102.5, note="not kept"))
    tracker = Tracker(3, t.records[:2])  # a restarted coordinator: the coordinator record and step 0 so far
    due = [(r["step"], fields) for r in t.records[2:] if (fields := tracker.add(r)) is not None]
    assert [step for step, _ in due] == [2, 5]  # the 3rd and 6th committed steps
    assert due[-1][1] == {"step": 5, **account(t.records[: t.records.index(next(
        r for r in t.records if r.get("step") == 5 and r["type"] == "step")) + 1]).fields()}  # fmt: skip
    assert all(m.kind is not RecordKind.USER for s in tracker.facts.sessions for m in s.marks)  # not folded
    assert Tracker(0).add(t.records[1]) is None


# A kill mid-backward with a restart 0.5 s later (it rejoins at a step boundary, receiving the state), worker 0
# 4x slower over steps 4-19 (so the rejoin lands mid-run however long a cold start takes here), a NaN gradient
# in step 24 (the step is skipped on every member), and a checkpoint every 10 steps.
SCHEDULE = "kill:worker=2,step=3,phase=backward,rejoin=0.5; slow:worker=0,factor=4,steps=4-19; nan:worker=1,step=24"


@pytest.mark.timeout(240)
def test_a_run_with_a_kill_a_rejoin_a_checkpoint_and_a_skipped_step_is_accounted(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    run = tmp_path / "run"
    # 6 microbatches on 3 workers: the kill's microbatches make its step a round longer (2 each, then 3 each on
    # the 2 left); with 4, both take 2 rounds.
    overrides = [EXACT, ONE_THREAD, "--train.steps=30", "--checkpoint.every=10", "--metrics.goodput_every=5"]
    overrides.append("--train.microbatches=6")
    result = train(run, data_cache_dir, *overrides, f"--failures.schedule={SCHEDULE}", workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(run)
    (failure,) = [r for r in records if r["type"] == "failure"]
    recoveries = [r for r in records if r["type"] == "recovery"]
    (skip,) = [r for r in records if r["type"] == "nonfinite_skip"]

    g = account(records)
    assert_accounted_by_the_timestamps(run, records, g, committed=29)  # 30 steps, one skipped
    skipped = next(r for r in records if r["type"] == "step" and r["step"] == skip["step"])
    assert g.buckets[Bucket.NONFINITE] >= skipped["step_time_s"]  # the whole skipped step, and the gap before it
    checkpoints = [r for r in records if r["type"] == "checkpoint"]
    assert len(checkpoints) >= 3 and g.buckets[Bucket.CHECKPOINT] > 0
    for bucket in (Bucket.START, Bucket.SLOW, Bucket.WORKERS_DOWN):
        assert g.buckets[bucket] > 0, bucket
    # Recomputing is what the kill's step took beyond its ideal and the failure's measured times: non-zero
    # exactly when that step was longer than those (the ideal, a median of loaded steps, may absorb one round).
    steps = [r for r in records if r["type"] == "step"]
    k = next(i for i, r in enumerate(steps) if r.get("recomputed"))
    killed, before = steps[k], steps[k - 1]
    usual = min(max(0.0, killed["time"] - killed["step_time_s"] - before["time"]), g.cadence_s)
    busy = [n * killed["speeds"][w] for w, n in killed["quotas"].items() if w in killed["speeds"]]
    slow_wait = max(busy) - statistics.median(busy)  # claimed first by ``slow``
    its_recovery = sum(r["reform_s"] for r in recoveries if r["step"] == killed["step"])
    beyond = killed["step_time_s"] + usual - g.ideal_step_s - failure["detection_s"] - its_recovery - slow_wait
    assert (g.buckets[Bucket.RECOMPUTE] > 0) == (beyond > 1e-9), (g.buckets[Bucket.RECOMPUTE], beyond)

    # The coordinator's live records: one every 5 committed steps, each the account of the records before it.
    live = [r for r in records if r["type"] == "goodput"]
    assert [r["step"] for r in live] == [
        r["step"] for r in records if r["type"] == "step" and r["committed"] and not r.get("republished")
    ][4::5]


def test_the_status_page_stacks_every_bucket_but_the_unattributed() -> None:
    script = (ROOT / "unbroken" / "control" / "status" / "static" / "status.js").read_text()
    stacked = re.findall(r'\["(\w+)", "#[0-9a-f]{6}"\]', script)
    assert sorted(stacked) == sorted(str(b) for b in Bucket if b is not Bucket.UNATTRIBUTED)


def test_a_real_run_replayed_by_the_simulator_is_compared_bucket_by_bucket(
    recovery_runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``unbroken simulate --replay``: the exact run's two kills and its rejoin, costs fitted from its records.
    The simulator commits what the run committed (recover keeps every microbatch of every step), its
    failure-free step is the run's ideal one (microbatch time fitted from it, the 4 workers sharing 2 cores as
    they did), and the re-formation and recompute the kills cost in the run cost in the simulation too.

    Detection is counted two ways: the run's account takes each kill's measured detection in full, the simulator
    only what holds the survivors up, none when they compute for longer after the kill than it takes to see it
    (a kill mid-backward while the others still have work). So the simulator is given the run's detection time
    and charges at most that per death."""
    run = recovery_runs["exact_failures"]
    result = replay(run, cores=2)
    real, sim = result.real, result.sim.policies[0]
    assert sim.committed_tokens == real.tokens
    assert result.sim.failure_free_step_s == pytest.approx(real.ideal_step_s)
    simulated = result.sim_buckets()
    assert real.buckets[Bucket.DETECTION] > 0  # a kill is seen after it happens
    detections = [r["detection_s"] for r in read_records(run, "failure")]
    assert result.costs["detect_s"] == pytest.approx(max(MIN_COST_S, statistics.median(detections)))
    assert 0 <= simulated[Bucket.DETECTION] <= sim.failures * result.costs["detect_s"] + 1e-9
    for bucket in (Bucket.REFORMATION, Bucket.RECOMPUTE):
        # A group formed ahead of need (on the watcher's thread, while the step computed) re-forms in no time on
        # the critical path, and a lost microbatch can cost no extra round: each may be 0 in the run.
        assert simulated[bucket] > 0 or real.buckets[bucket] == 0, bucket
    assert main(["simulate", "--replay", str(run), "--cores", "2"]) == 0
    table = capsys.readouterr().out
    assert f"| committed tokens | {real.tokens:,} | {sim.committed_tokens:,} |" in table
    assert all(f"| {b} (s) |" in table for b in (Bucket.DETECTION, Bucket.REFORMATION, Bucket.RECOMPUTE))


def test_a_replayed_run_whose_groups_re_formed_in_no_time_gives_the_simulator_the_smallest_cost(
    recovery_runs: dict[str, Path], tmp_path: Path
) -> None:
    """Every recovery's ``reform_s`` 0 (each group formed before the step needed it: seen in a clean run) is a
    measurement, not an error: the simulator, which takes only positive costs, is given the smallest one."""
    run = tmp_path / "run"
    shutil.copytree(recovery_runs["exact_failures"], run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    zeroed = [json.dumps({**r, "reform_s": 0.0}) if r.get("type") == "recovery" else line
              for line, r in ((line, json.loads(line)) for line in lines)]  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(zeroed) + "\n")
    result = replay(run, cores=2)
    assert result.costs["reform_s"] == MIN_COST_S and result.real.buckets[Bucket.REFORMATION] == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--replay", "/nonexistent/run"], "not a run directory"),
        (["configs/sim/recover_512.toml", "--replay", "/nonexistent/run"], "one of them"),
        ([], "one of them"),
    ],
    ids=["no-run", "both", "neither"],
)
def test_replay_bad_input_is_one_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line
