"""The coordinator's collaborators, each alone: the stall judge fed reports, the fail-slow actions, the admission's
last call and ids, a restarted coordinator's wait, the error judge on a real store. Each decision is asserted with
the inputs that make it and the ones that must not (no clock: the judges take ``now``)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from unbroken.control.coordinator.errors import ErrorJudge
from unbroken.control.coordinator.join import JOIN_QUIET_S, JOIN_WAIT_MAX_S, Admission
from unbroken.control.coordinator.restore import Restore
from unbroken.control.coordinator.slow import FailSlowActions
from unbroken.control.coordinator.stall import StallAction, StallJudge
from unbroken.control.coordinator.watch import Watch
from unbroken.control.store import keys
from unbroken.control.store.connect import raised_failure, report_error, report_timeout
from unbroken.control.store.durable import State, Worker
from unbroken.core.config import ParallelConfig
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import ErrorPhase, RecordKind, WorkerError

pytestmark = pytest.mark.timeout(60)

HB = 4.0  # the heartbeat timeout the judges are built with: a re-form waits half of it, an exclusion all of it
ONE = ReplicaLayout.of(ParallelConfig())
PAIRS = ReplicaLayout(2)  # replicas of two ranks: workers 0-1, 2-3, 4-5


def _store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


# -- the stall judge ----------------------------------------------------------------------------------------------
def test_a_first_timeout_re_forms_the_same_members_once_every_member_reported_or_half_a_timeout_passed() -> None:
    judge = StallJudge(HB, ONE)
    assert judge.due(1, (0, 1), set(), 0.0) is None and not judge.pending(1)  # no report: nothing to decide
    assert judge.due(1, (0, 1), {0}, 10.0) is None and judge.pending(1)  # one of two: the window runs from now
    assert judge.due(1, (0, 1), {0}, 10.0 + HB / 2 - 0.01) is None
    assert judge.due(1, (0, 1), {0}, 10.0 + HB / 2) == {0}
    assert StallJudge(HB, ONE).due(1, (0, 1), {0, 1}, 10.0) == {0, 1}  # everybody reported: no window
    decision = judge.decide(1, (0, 1), {0})
    assert (decision.action, decision.members, decision.suspects, decision.excluded) == (
        StallAction.REFORM,
        (0, 1),
        (1,),
        (),
    )
    assert decision.line == "a collective of epoch 1 timed out (reported by [0]); re-forming"
    assert decision.fields() == {"epoch": 1, "reported": [0], "suspects": [1], "decision": "re-form"}


def test_a_member_that_stalls_the_re_formed_group_too_is_excluded_after_a_whole_timeout() -> None:
    judge = StallJudge(HB, ONE)
    judge.decide(1, (0, 1, 2), {0, 2})  # epoch 2 re-forms the three
    assert judge.retrying(2) and not judge.retrying(3)
    assert judge.due(2, (0, 1, 2), {0, 2}, 0.0) is None
    assert judge.due(2, (0, 1, 2), {0, 2}, HB / 2) is None  # a member only slow reports late: not excluded yet
    assert judge.due(2, (0, 1, 2), {0, 2}, HB) == {0, 2}
    decision = judge.decide(2, (0, 1, 2), {0, 2})
    assert (decision.action, decision.members, decision.excluded) == (StallAction.EXCLUDE, (0, 2), (1,))
    assert decision.line == "stalled twice: 1"
    assert decision.failure_why() == "stalled in the collectives of epochs 1 and 2"
    assert not judge.retrying(2)  # excluded: the next timeout starts afresh with a re-form
    assert judge.decide(3, (0, 2), {0}).action is StallAction.REFORM


def test_a_second_stall_that_leaves_no_majority_or_nobody_to_exclude_stops_the_run() -> None:
    judge = StallJudge(HB, ONE)
    judge.decide(1, (0, 1), {0})
    stop = judge.decide(2, (0, 1), {0})
    assert (stop.action, stop.members, stop.excluded) == (StallAction.STOP, (0, 1), ())
    assert (
        stop.line == "after excluding [1] no majority of [0, 1] would be left; stopping (the last checkpoint is kept)"
    )
    everyone = StallJudge(HB, ONE)
    everyone.decide(1, (0, 1, 2), {0, 1, 2})
    stop = everyone.decide(2, (0, 1, 2), {0, 1, 2})
    assert stop.action is StallAction.STOP
    assert stop.line == (
        "collectives keep timing out among [0, 1, 2] although every heartbeat arrives; stopping (the last "
        "checkpoint is kept)"
    )


def test_a_stall_in_an_epoch_that_is_not_the_re_formed_one_re_forms_again() -> None:
    """A join published between the re-formation and the next timeout: the new epoch never re-formed anything."""
    judge = StallJudge(HB, ONE)
    judge.decide(1, (0, 1, 2), {0, 2})  # epoch 2 re-forms
    assert judge.decide(3, (0, 1, 2, 3), {0, 2, 3}).action is StallAction.REFORM


def test_a_stalled_rank_takes_its_whole_replica_out() -> None:
    judge = StallJudge(HB, PAIRS)
    members = (0, 1, 2, 3, 4, 5)
    judge.decide(1, members, {0, 1, 2, 4, 5})
    decision = judge.decide(2, members, {0, 1, 2, 4, 5})  # rank 3 stalled twice: replica 1 (workers 2, 3) goes
    assert (decision.action, decision.excluded, decision.members) == (StallAction.EXCLUDE, (2, 3), (0, 1, 4, 5))


def test_the_watch_reads_the_timeout_reports_again_when_their_count_moves() -> None:
    store = _store()
    watch = Watch(store, HB)
    for wid in (0, 1):
        watch.admitted(wid)
    watch.read((0, 1))
    assert watch.timeouts(1, (0, 1)) == set()
    report_timeout(store, 1, 0)
    report_timeout(store, 2, 1)  # another epoch's: not this one's
    watch.read((0, 1))
    assert watch.timeouts(1, (0, 1)) == {0}
    assert watch.timeouts(2, (0, 1)) == {1}


# -- the fail-slow actions ------------------------------------------------------------------------------------------
def test_fail_slow_exclusions_spare_the_leader_and_bar_a_return_only_when_configured() -> None:
    members = (0, 1, 2)
    actions = FailSlowActions(ONE, slow_rejoin=False, members=lambda: members)
    actions.exclude(0, "fail-slow")  # the leader: never excluded here
    actions.exclude(2, "fail-slow: 3.00x")
    actions.exclude(7, "fail-slow")  # not a member
    assert actions.barred == {2: "worker 2 was excluded as fail-slow and recovery.slow_rejoin = false"}
    assert actions.removals((0, 1)) == {}  # 2 left meanwhile: forgotten
    actions.exclude(2, "fail-slow: 3.00x")
    assert actions.removals(members) == {2: "fail-slow: 3.00x"}
    assert actions.removals(members) == {}  # handed out once
    kept = FailSlowActions(PAIRS, slow_rejoin=True, members=lambda: (0, 1, 2, 3))
    kept.exclude(1, "fail-slow")  # replica 1: its first rank, worker 2
    assert kept.removals((0, 1, 2, 3)) == {2: "fail-slow"} and kept.barred == {}


def test_a_workload_switch_is_published_once_each_way() -> None:
    actions = FailSlowActions(ONE, slow_rejoin=True, members=lambda: (0, 1))
    assert actions.workload_due() is None
    actions.rebalance(True)
    assert actions.workload_due() == "workload throughput (a worker is fail-slow)"
    assert actions.workload_override == "throughput" and actions.workload_due() is None
    actions.rebalance(False)
    assert actions.workload_due() == "workload back to the config's" and actions.workload_override == ""


# -- the admission ------------------------------------------------------------------------------------------------
def _admission(store: TCPStore, records: list[tuple[RecordKind, dict[str, Any]]], restore: Restore) -> Admission:
    def emit(kind: RecordKind, **fields: Any) -> None:
        records.append((kind, fields))

    return Admission(store, PAIRS, False, emit, lambda: None, Watch(store, HB), restore, {})


def _register(store: TCPStore, request: dict[str, Any]) -> int:
    """As a worker registers: take a number, then write the request."""
    n = store.add(keys.REGISTER_SEQ, 1)
    store.set(keys.register(n), json.dumps(request))
    return n


def test_registrations_get_ids_and_joiners_wait_for_the_last_call_and_their_whole_replica() -> None:
    store, records = _store(), []
    admission = _admission(store, records, Restore())
    firsts = [_register(store, {"worker_id": w, "host": "h"}) for w in (0, 1, 0)]  # 0 twice: a duplicate
    assert admission.admit_new(0, ()) == [0, 1, 2]
    assert [store.get(keys.register_id(n)).decode() for n in firsts] == ["0", "1", "2"]
    assert [f["worker"] for kind, f in records if kind is RecordKind.ADMITTED] == [0, 1, 2]
    # Running (epoch 1, members 0 and 1): worker 2's replica (2, 3) is not complete until 3 registers.
    assert admission.ready([2], (0, 1), 100.0) == []
    assert admission.ready([], (0, 1), 100.0 + JOIN_QUIET_S) == []  # the last call, but replica 1 is incomplete
    _register(store, {"worker_id": -1, "host": "h"})
    assert admission.admit_new(1, (0, 1)) == [3]
    assert admission.ready([3], (0, 1), 100.5) == []  # a registration just now: the last call waits
    assert admission.ready([], (0, 1), 100.5 + JOIN_QUIET_S) == [2, 3]  # registrations quiet for JOIN_QUIET_S
    assert admission.ready([], (0, 1, 2, 3), 200.0) == []
    assert admission.next_id() == 4


def test_a_steady_trickle_of_joiners_is_taken_in_once_the_first_has_waited_the_longest() -> None:
    store, records = _store(), []
    admission = _admission(store, records, Restore())
    now = 0.0
    for _ in range(8):  # workers 0-7, one every half a quiet period: the registrations are never quiet
        _register(store, {"worker_id": -1, "host": "h"})
        assert admission.ready(admission.admit_new(1, (90, 91)), (90, 91), now) == []
        now += JOIN_QUIET_S / 2
    assert now < JOIN_WAIT_MAX_S
    _register(store, {"worker_id": -1, "host": "h"})  # worker 8, its replica-mate 9 not yet registered
    assert admission.ready(admission.admit_new(1, (90, 91)), (90, 91), JOIN_WAIT_MAX_S) == list(range(8))


def test_a_promoted_spare_is_taken_in_at_once() -> None:
    store, records = _store(), []
    admission = _admission(store, records, Restore())
    for w in (2, 3):
        _register(store, {"worker_id": w, "host": "h", "spare": 0})
    joined = admission.admit_new(1, (0, 1))
    assert admission.ready(joined, (0, 1), 50.0) == [2, 3]


def test_a_restarted_coordinator_takes_back_the_members_that_return_and_records_who_did_not() -> None:
    prior = State(epoch=4, members=(0, 1, 2, 3), committed_step=9, admitted={w: Worker("h", 1) for w in range(4)},
                  next_worker_id=4)  # fmt: skip
    assert not Restore.of(prior, restore=False, window_s=5.0).waiting  # a new launch waits for nobody
    restore = Restore.of(prior, restore=True, window_s=5.0)
    assert restore.waiting and restore.epoch == 4 and restore.committed_step == 9
    store, records = _store(), []
    admission = _admission(store, records, restore)
    for w in (0, 1, 2):
        _register(store, {"worker_id": w, "host": "h", "returning": True})
    _register(store, {"worker_id": -1, "host": "h"})  # a newcomer: the ids handed out before are not reused
    assert admission.admit_new(4, ()) == [4]
    assert restore.returned == {0, 1, 2} and not restore.due(restore.until - 1.0) and restore.due(restore.until + 1)
    end = restore.end(PAIRS, [4])
    assert (end.members, end.gone) == ((0, 1, 4), (2, 3))  # 2 came back without 3: replica 1 is not whole
    assert end.reason == "coordinator restarted: 0, 1 came back; 2, 3 did not"
    assert not restore.waiting


# -- the error judge ----------------------------------------------------------------------------------------------
def _error(worker: int, step: int, phase: ErrorPhase = ErrorPhase.MICROBATCH) -> WorkerError:
    return WorkerError(worker, "ValueError", "bad", "/x/train.py", 12, "loss_fn", phase, step, 3, "Traceback")


def test_an_error_is_a_death_once_and_the_same_error_on_another_worker_stops_the_run_naming_a_saver(
    tmp_path: Path,
) -> None:
    store, written, stops = _store(), [], []

    def stop(line: str) -> bool:
        stops.append(line)
        return True

    judge = ErrorJudge(store, written.append, stop, ONE, tmp_path)
    report_error(store, _error(1, step=5))
    assert not judge.judge((0, 1, 2, 3))  # once: a failing host, and worker 1 is dead
    assert judge.removals((0, 1, 2, 3)) == {1: raised_failure(_error(1, step=5).headline())}
    assert judge.removals((0, 2, 3)) == {}  # handed out once
    report_error(store, _error(2, step=6))  # the same place at another step: not the same work
    assert not judge.judge((0, 2, 3))
    report_error(store, _error(0, step=6))  # worker 2's error again, on worker 0: a bug
    assert judge.judge((0, 3))
    assert stops == [judge.bug] and judge.bug is not None
    assert judge.bug.endswith("on workers 2, 0: the same error on 2 workers: a bug, not a failure"), judge.bug
    assert judge.saver == 3 and store.get(keys.STOP_SAVER) == b"3"  # the lowest member that did not raise
    assert [r["type"] for r in written] == [RecordKind.ERROR] * 3
    # A restarted coordinator (its own store) goes on with the run's errors: the first repeat stops it.
    fresh, restarted = _store(), []
    again = ErrorJudge(fresh, restarted.append, stop, ONE, tmp_path, written)
    report_error(fresh, _error(3, step=6))
    assert again.judge((3,)) and again.bug is not None and "on workers 2, 0, 3:" in again.bug
