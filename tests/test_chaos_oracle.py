"""Every check of the chaos oracle fires (unbroken/lab/chaos.py): a real finished run (the session's ``tiny_run``),
copied and doctored so that it breaks exactly one invariant, is reported with exactly that violation; what depends on
the machine's speed (a detection, a wait between commits) is measured, never a violation. The hang watchdog stops a
run that commits nothing, and the churn's leak check fires on a real process that leaks each resource.
(The fault driver's decisions: tests/test_chaos.py.)"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unbroken.control.store.connect import exit_reason, process_failure, raised_failure
from unbroken.core.config import CommConfig
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import METRICS_FILE, RecordKind, SpareState, make, read_records
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.lab.chaos import (
    Outcome,
    Reference,
    Trial,
    check_run,
    hang_bound_s,
    leaks,
    outside_detections,
    proc_sample,
    watch,
)

STEPS, MICROBATCHES = 8, 4  # the session's tiny_run: tests/tiny.toml by 2 workers, checkpoints at steps 4 and 8
BOUND_S = 122.0


@pytest.fixture
def run(tiny_run: Path, tmp_path: Path) -> Path:
    """A copy of the session's real run, to doctor."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


@pytest.fixture
def ref(tiny_run: Path) -> Reference:
    """The same run as the failure-free reference: the copy, untouched, breaks nothing."""
    return Reference.of_run(tiny_run, ReplicaLayout(), wall_s=1.0)


def checked(run: Path, ref: Reference, code: int | None = 0) -> Outcome:
    outcome = Outcome(Trial(0, [], {}, "doctored"), code, 1.0, hang_bound_s=BOUND_S)
    check_run(run, outcome, ref, STEPS, MICROBATCHES)
    return outcome


def edit(run: Path, kind: RecordKind, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Rewrite the run's records of ``kind`` with ``change`` (None drops the record), the others as they were."""
    path = run / METRICS_FILE
    lines = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["type"] == kind:
            record = change(record)
        if record is not None:
            lines.append(json.dumps(record))
    path.write_text("".join(f"{line}\n" for line in lines))


def add(run: Path, *records: dict[str, Any]) -> None:
    with open(run / METRICS_FILE, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def at_step(step: int, **fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda r: {**r, **fields} if r["step"] == step else r


def test_the_real_run_breaks_no_invariant(run: Path, ref: Reference) -> None:
    """Without this the tests below would prove nothing: the copy as it is passes every check."""
    assert checked(run, ref).violations == []


def test_a_hang_and_an_exit_status_are_violations(run: Path, ref: Reference) -> None:
    assert checked(run, ref, code=None).violations == [
        f"hang: no step committed for {BOUND_S:.0f} s (the longest wait its timeouts allow)"
    ]
    assert checked(run, ref, code=1).violations == ["exit status 1"]
    assert checked(run, ref, code=-signal.SIGKILL).violations == [f"exit status {-signal.SIGKILL}"]


def test_a_run_without_its_final_record_did_not_finish(run: Path, ref: Reference) -> None:
    edit(run, RecordKind.FINAL, lambda r: None)
    assert checked(run, ref).violations == ["the run did not finish (no final record)"]


def test_workers_that_ended_with_different_parameters(run: Path, ref: Reference) -> None:
    """Worker 1 ends with other parameters than worker 0 (and so than the reference's)."""
    edit(run, RecordKind.FINAL, lambda r: {**r, "checksums": {**r["checksums"], "1": "ab" * 32}, "identical": False})
    final = read_records(run, RecordKind.FINAL)[-1]
    assert checked(run, ref).violations == [
        f"live workers hold different parameters: {final['checksums']}",
        "final parameters differ from the failure-free reference",
    ]


def test_workers_that_agree_on_parameters_other_than_the_references(run: Path, ref: Reference) -> None:
    edit(run, RecordKind.FINAL, lambda r: {**r, "checksums": dict.fromkeys(r["checksums"], "ab" * 32)})
    assert checked(run, ref).violations == ["final parameters differ from the failure-free reference"]


def test_a_worker_or_a_waiting_spare_that_crashed(run: Path, ref: Reference) -> None:
    """A worker killed by the campaign's SIGKILL is no crash; one that aborted is; so is a spare that ended by a
    signal of its own while it waited."""
    t = read_records(run, RecordKind.FINAL)[-1]["time"]
    killed = make(RecordKind.FAILURE, t, worker=0, why=process_failure(exit_reason(-signal.SIGKILL)), epoch=2)
    add(run, killed)
    assert checked(run, ref).violations == []
    aborted = make(RecordKind.FAILURE, t, worker=1, why=process_failure(exit_reason(-signal.SIGABRT)), epoch=3)
    add(run, aborted)
    assert checked(run, ref).violations == [f"worker 1 crashed: {aborted['why']}"]
    edit(run, RecordKind.FAILURE, lambda r: None)
    add(run, make(RecordKind.FAILURE, t, worker=0, why=raised_failure("RuntimeError: a bug"), epoch=2))
    assert checked(run, ref).violations == ["worker 0 crashed: raised RuntimeError: a bug"]
    edit(run, RecordKind.FAILURE, lambda r: None)
    why = exit_reason(-signal.SIGSEGV)
    add(run, make(RecordKind.SPARE, t, spare=0, state=SpareState.EXITED, worker=-1, pid=1, why=why))
    assert checked(run, ref).violations == [f"spare 0 crashed while it waited: {why}"]


def test_a_step_never_committed(run: Path, ref: Reference) -> None:
    edit(run, RecordKind.STEP, lambda r: None if r["step"] == 5 else r)
    assert checked(run, ref).violations == ["steps never committed: [5]"]


@pytest.mark.parametrize(
    ("counted", "once", "dropped"),
    [
        (4, False, 0),  # one microbatch counted twice, another never: the total is right
        (5, True, 0),  # a microbatch id that is not the step's counted (its count vector one too long)
        (4, True, 1),  # a microbatch dropped (the drop policy), however the others were counted
    ],
)
def test_a_microbatch_not_counted_exactly_once(
    run: Path, ref: Reference, counted: int, once: bool, dropped: int
) -> None:
    edit(run, RecordKind.STEP, at_step(3, counted=counted, counted_once=once, dropped=dropped))
    assert checked(run, ref).violations == [
        f"step 3: microbatches counted {counted} of 4 (once each: {once}, dropped: {dropped})"
    ]


def test_a_loss_that_differs_from_the_references(run: Path, ref: Reference) -> None:
    loss = ref.losses[6] + 2**-40
    edit(run, RecordKind.STEP, at_step(6, loss=loss))
    assert checked(run, ref).violations == [f"step 6: loss {loss!r} != failure-free {ref.losses[6]!r}"]


def test_a_damaged_checkpoint(run: Path, ref: Reference) -> None:
    """A byte of the step-4 checkpoint flipped (the final one is whole)."""
    path = ckpt.checkpoint_path(run, 4)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert checked(run, ref).violations == ["damaged checkpoint step_00000004: step_00000004.pt fails its checksum"]


def test_a_final_checkpoint_that_is_gone(run: Path, ref: Reference) -> None:
    ckpt.checkpoint_path(run, STEPS).unlink()
    ckpt.checkpoint_path(run, STEPS).with_suffix(".json").unlink()
    violations = checked(run, ref).violations
    assert len(violations) == 1 and violations[0].startswith("final checkpoint: manifest step_00000008.json"), (
        violations
    )


def resave(run: Path, ref: Reference, change: Callable[[dict[str, Any]], None]) -> None:
    """The final checkpoint rewritten as the reference's with ``change`` made to its state: whole and verified, only
    different."""
    state = ckpt.verify(ref.run_dir, STEPS)
    change(state)
    ckpt.save_checkpoint(run, STEPS, state, keep=3)


def test_a_final_checkpoint_that_differs_from_the_references(run: Path, ref: Reference) -> None:
    def parameter(state: dict[str, Any]) -> None:
        state["model"]["norm.weight"][0] += 1.0

    def moment(state: dict[str, Any]) -> None:
        state["optimizer"]["state"][0]["exp_avg"][0] += 1.0

    def scale(state: dict[str, Any]) -> None:
        state["ft"]["scale"] = 2.0**20

    resave(run, ref, lambda state: None)
    assert checked(run, ref).violations == []  # rewritten as it was: nothing differs
    resave(run, ref, parameter)
    assert checked(run, ref).violations == [
        "final checkpoint: parameter norm.weight differs from the failure-free run's"
    ]
    resave(run, ref, moment)
    assert checked(run, ref).violations == ["final checkpoint: optimizer state /state/0/exp_avg differs"]
    resave(run, ref, scale)
    assert checked(run, ref).violations == ["final checkpoint: the exact mode's fixed-point scale differs"]


def test_a_slow_detection_and_a_long_wait_between_commits_are_measured_not_violations(
    run: Path, ref: Reference
) -> None:
    """They depend on the machine's speed and load: the campaign reports them, whatever they are."""
    t = read_records(run, RecordKind.FINAL)[-1]["time"]
    why = process_failure(exit_reason(-signal.SIGKILL))
    add(run, make(RecordKind.FAILURE, t, worker=1, why=why, epoch=2, event="kill:worker=1,step=3", detection_s=300.0))
    edit(run, RecordKind.STEP, lambda r: {**r, "time": r["time"] + 500.0} if r["step"] >= 4 else r)
    outcome = checked(run, ref)
    assert outcome.violations == []
    assert outcome.max_detection_s == 300.0 and outcome.detections == [
        {"worker": 1, "fault": "kill:worker=1,step=3", "detection_s": 300.0}
    ]
    steps = read_records(run, RecordKind.STEP)
    assert outcome.max_stall_s == steps[4]["time"] - steps[3]["time"] > 500.0


def test_an_outside_faults_detection_is_measured_from_its_signal_to_the_epoch_that_removed_its_worker() -> None:
    """The driver's log against the coordinator's records: a kill is detected at the epoch record that removed the
    worker (written before the failure record, which names it); a stop too short to be noticed has no detection,
    and the worker's later death belongs to the driver's next signal to it; a waiting spare is no member."""
    faults = [
        {"time": 10.0, "kind": "kill", "worker": 1},
        {"time": 10.5, "kind": "stop", "spare": 0},
        {"time": 11.0, "kind": "stop", "worker": 2},  # 0.3 s: never noticed
        {"time": 14.0, "kind": "kill", "worker": 2},
        {"time": 20.0, "kind": "kill", "worker": 1},  # the restarted worker 1, again
    ]
    memberships = [
        {"epoch": 2, "members": [0, 2], "time": 10.2},
        {"epoch": 3, "members": [0, 1, 2], "time": 12.0},  # worker 1 restarted
        {"epoch": 4, "members": [0, 2], "time": 13.0},  # and excluded, by no fault of the driver
        {"epoch": 5, "members": [0], "time": 14.1},
        {"epoch": 6, "members": [0, 1], "time": 15.0},
        {"epoch": 7, "members": [0], "time": 20.4},
    ]
    failures = [
        {"worker": 1, "epoch": 2, "time": 10.25},
        {"worker": 1, "epoch": 4, "time": 13.05},
        {"worker": 2, "epoch": 5, "time": 14.15},
        {"worker": 1, "epoch": 7, "time": 20.45},
    ]
    found = [
        (d["worker"], d["fault"], round(d["detection_s"], 6)) for d in outside_detections(faults, failures, memberships)
    ]
    assert found == [(1, "outside kill", 0.2), (2, "outside kill", 0.1), (1, "outside kill", 0.4)]


@pytest.mark.timeout(60)
def test_a_run_that_commits_nothing_within_its_timeouts_is_hung_and_stopped(tmp_path: Path) -> None:
    """``watch`` gives up on a run that goes longer than its configured timeouts allow without a new step (here a
    process that writes nothing, with timeouts of a fraction of a second), and stops it; a run that ends is its
    exit status."""
    comm = CommConfig(op_timeout_s=0.3, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.2, join_timeout_s=0.3)
    assert hang_bound_s(comm) == pytest.approx(0.5)
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert watch(silent, tmp_path, hang_bound_s(comm)) is None
        assert silent.poll() is not None  # stopped, not left running
    finally:
        silent.kill()
        silent.wait()
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert watch(ended, tmp_path, 3600.0) == 3


# The churn's leak check, on a real process that does, at each "change", what it is told, and holds on to it.
HOLDER = """
import os, socket, sys, threading, time
held = []
for line in sys.stdin:
    what = line.split()
    if what[0] == "socket":
        held.append(socket.socket())
    elif what[0] == "file":
        held.append(open(os.devnull))
    elif what[0] == "thread":
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    elif what[0] == "memory":
        held.append(bytearray(os.urandom(int(what[1]) * 1024)))
    elif what[0] == "spike":  # taken and given back before the process is at rest
        socket.socket().close()
    print("done", flush=True)
"""
ROUNDS, CHANGES = 3, 4  # chaos.CHURN_ROUNDS rounds of a few changes each
STATE_KIB = 1024


def at_rest(command: Callable[[int, int], str]) -> list[dict[str, int]]:
    """The samples, after each round, of a process told ``command(round, change)`` at each change of the rounds."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    quiet = []
    try:
        for r in range(ROUNDS):
            for change in range(CHANGES):
                proc.stdin.write(command(r, change) + "\n")
                proc.stdin.flush()
                assert proc.stdout.readline() == "done\n"
            sample = proc_sample(proc.pid)
            assert sample is not None
            quiet.append(sample)
    finally:
        proc.kill()
        proc.wait()
    return quiet


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("leak", "found"),
    [
        (lambda r, c: "socket", ["fds", "sockets"]),  # a socket is a descriptor too
        (lambda r, c: "file", ["fds"]),
        (lambda r, c: "thread", ["threads"]),
        (lambda r, c: f"memory {STATE_KIB // 2}", ["rss_kib"]),  # two states' worth a round
        (lambda r, c: "spike", []),  # transients
        (lambda r, c: "thread" if (r, c) == (1, 0) else "nothing", []),  # a thread started once and kept is no leak
        (lambda r, c: f"memory {4 * STATE_KIB}" if (r, c) == (1, 0) else "nothing", []),  # nor a buffer kept once
    ],
    ids=["socket", "file", "thread", "memory", "spikes", "one-thread", "one-buffer"],
)
def test_the_churns_leak_check_fires_on_each_resource_that_grows_with_the_changes(
    leak: Callable[[int, int], str], found: list[str]
) -> None:
    findings = leaks(at_rest(leak), STATE_KIB)
    assert [line.split()[0] for line in findings] == found, findings
