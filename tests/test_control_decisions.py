"""The control plane's decisions to give up, each taken by real processes and asserted by what it leaves: the records
written, the exit statuses, the processes that remain. No wall-clock bound: a wait ends when its condition holds or
the test's timeout fails it; the configured timeouts are made small so that each decision comes soon.

- a collective that stalls twice with no majority left, or that keeps timing out on every member: the run stops;
- a host that never joins: the coordinator stops the run at its join deadline and says how many joined;
- a coordinator lost for good: the workers stop by themselves; one restarted later whose members never come back
  stops the run and records them as failed; the goodput account puts the time lost in its ``coordinator`` bucket;
- the launcher of ``unbroken train`` killed: the coordinator stops the job and every process it started ends;
- an alert webhook that refuses or answers badly: the failure is logged, the run goes on, the next alert goes out.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from runner import (
    CONTROL_COMMON,
    EXACT,
    ONE_THREAD,
    TINY,
    committed,
    control_pace,
    free_port,
    in_process_coordinator,
    run_command,
    train,
    train_cmd,
    unbroken,
    worker_pids,
)

from unbroken.control.status.alerts import Alerter, AlertKind
from unbroken.control.store import keys
from unbroken.control.store.connect import connect_store, report_timeout
from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.config import MetricsConfig
from unbroken.core.exits import EXIT_COORDINATOR_LOST, EXIT_STOPPED
from unbroken.core.goodput import Bucket, account
from unbroken.core.records import RecordKind, make, read_records, sessions, step_losses
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(240)

FIXTURE_RUNS = {"abandoned": 1}  # the module fixture below: one job (two coordinators, one agent)


def _until(condition: Callable[[], bool], *running: Any) -> None:
    """Wait until ``condition()`` holds, each of ``running`` (processes) still running meanwhile."""
    while not condition():
        for proc in running:
            assert proc.poll() is None, f"process {proc.pid} ended (status {proc.returncode}) before the awaited moment"
        threading.Event().wait(0.05)


def _kinds(records: list[dict[str, Any]]) -> list[RecordKind]:
    return [RecordKind(r["type"]) for r in records]


# -- a stalled collective ---------------------------------------------------------------------------------------
def test_a_member_that_stalls_twice_with_no_majority_left_stops_the_run_keeping_the_last_checkpoint(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """Two workers; worker 1 blocks inside step 5's reduction while its heartbeats go on, for longer than the run
    lasts. Worker 0's collective times out and the coordinator re-forms the two; worker 1 stalls the re-formed group
    too, and excluding it would leave no majority of the two the stall began with: the coordinator stops the run
    (``stall`` decision ``stop``), the launcher exits 1 with that line, and the checkpoint of step 4 is the last."""
    out = tmp_path / "stall"
    schedule = "--failures.schedule=stall:worker=1,step=5,seconds=3600"
    result = train(out, data_cache_dir, EXACT, ONE_THREAD, "--comm.op_timeout_s=2", schedule, workers=2)
    reason = "after excluding [1] no majority of [0, 1] would be left; stopping (the last checkpoint is kept)"
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"unbroken: error: {reason}"
    stalls = read_records(out, RecordKind.STALL)
    # A collective that timed out earlier on a loaded machine may have re-formed the group before step 5: whatever
    # came before, the last two decisions are these.
    retry, stop = stalls[-2:]
    assert (retry["decision"], stop["decision"], stop["suspects"]) == ("re-form", "stop", [1]), stalls
    memberships = read_records(out, RecordKind.MEMBERSHIP)
    assert (memberships[-1]["epoch"], memberships[-1]["reform"]) == (retry["epoch"] + 1, True) == (stop["epoch"], True)
    assert memberships[-1]["members"] == [0, 1]  # nobody was excluded
    assert [r["reason"] for r in read_records(out, RecordKind.STOPPED)] == [reason]
    assert not read_records(out, RecordKind.FAILURE) and not read_records(out, RecordKind.FINAL)
    assert sorted(step_losses(out)) == list(range(5))  # step 5 never committed
    saved = ckpt.load_latest(out)
    assert saved is not None and saved.step == 4
    problems, leftovers = ckpt.verify_all(out)
    assert not problems and not leftovers


def test_collectives_that_time_out_on_every_member_twice_stop_the_run(tmp_path: Path) -> None:
    """Every member reports a timed-out collective although every heartbeat arrives (a link that fails them all):
    the coordinator re-forms the group, and when every member of the re-formed group reports again there is nobody to
    exclude, so it stops the run. The failure schedule has no fault that times out every member, so the members'
    reports are written into a real coordinator's store by hand, as ``report_timeout`` writes them."""
    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        store = connect_store(coordinator.address, token=token)
        for wid in (0, 1):
            store.add(keys.heartbeat(wid), 0)  # as at admission
        coordinator.publish((0, 1), "start")
        for _ in range(2):
            for wid in (0, 1):
                report_timeout(store, coordinator.epoch, wid)
            coordinator.watch.read(coordinator.members)
            assert coordinator.watch.timeouts(coordinator.epoch, coordinator.members) == {0, 1}
            coordinator._judge_stall()  # every member reported: decided at once
        stopped = store.get(keys.STOP).decode()
    run = tmp_path / "run"
    assert [(r["epoch"], r["decision"], r["suspects"]) for r in read_records(run, RecordKind.STALL)] == [
        (1, "re-form", []),
        (2, "stop", []),
    ]
    assert [(m["epoch"], m["members"], m["reform"]) for m in read_records(run, RecordKind.MEMBERSHIP)] == [
        (1, [0, 1], False),
        (2, [0, 1], True),
    ]
    assert stopped == (
        "collectives keep timing out among [0, 1] although every heartbeat arrives; stopping (the last checkpoint is "
        "kept)"
    )


# -- the start ----------------------------------------------------------------------------------------------------
def test_a_host_that_never_joins_stops_the_run_at_the_join_deadline_saying_how_many_joined(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """A coordinator of 4 workers and one agent of 2 (the other host never comes): at ``comm.join_timeout_s`` the
    coordinator stops the run with the line that says how many joined (its ``admitted`` records), before any epoch;
    the agent's workers stop with that line (not with their own bound on the wait for an epoch, which ran out
    first until it was given the time a coordinator's decision takes to reach a worker), and the agent exits 1."""
    env = {**os.environ, TOKEN_ENV: new_token()}
    port, run, join_s = free_port(), tmp_path / "run", 3
    coordinator = unbroken("coordinator", TINY, "--workers", "4", "--port", str(port), "--run-dir", str(run),
                           f"--data.cache_dir={data_cache_dir}", f"--comm.join_timeout_s={join_s}", env=env,
                           log=tmp_path / "coordinator.log")  # fmt: skip
    started = [coordinator]
    with _ended(started):
        _until(lambda: "coordinator listening" in (tmp_path / "coordinator.log").read_text(), coordinator)
        agent = unbroken("agent", "--coordinator", f"127.0.0.1:{port}", "--workers", "2", env=env,
                         log=tmp_path / "agent.log")  # fmt: skip
        started.append(agent)
        assert coordinator.wait() == 1, (tmp_path / "coordinator.log").read_text()[-3000:]
        agent_status = agent.wait()
    records = read_records(run)
    stop = _kinds(records).index(RecordKind.STOPPED)
    joined = [r["worker"] for r in records[:stop] if r["type"] == RecordKind.ADMITTED]
    reason = f"only {len(joined)} of 4 workers joined within {join_s} s"
    assert records[stop]["reason"] == reason and set(joined) <= {0, 1}
    assert RecordKind.MEMBERSHIP not in _kinds(records)
    assert agent_status != 0, (tmp_path / "agent.log").read_text()[-3000:]
    for wid in joined:
        assert f"stopping: {reason}" in (run / "logs" / f"worker-{wid}.log").read_text()


@contextlib.contextmanager
def _ended(procs: list[Any]) -> Iterator[None]:
    """Kill the session of each of ``procs`` (as it is on the way out) still running then: a test that failed
    leaves no job behind."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# -- a coordinator lost for good, and one restarted whose members never come back ----------------------------
@dataclass(frozen=True)
class Abandoned:
    run: Path
    logs: Path  # the coordinators' and the agent's
    statuses: dict[str, int]  # "first" (the coordinator killed), "agent", "restarted"


@pytest.fixture(scope="module")
def abandoned(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Abandoned:
    """A coordinator and an agent of 2 workers started by hand; once step 2 is committed the coordinator is killed
    and nothing replaces it: the workers train on for ``coordinator.hold_s`` (1 s), then stop, the leader saving
    the last committed step. Then a coordinator is started again on the run (``--restore``, as a launcher starts a
    successor): it waits ``coordinator.rejoin_window_s`` (1 s) for the members of the last epoch, who are gone."""
    base = tmp_path_factory.mktemp("abandoned")
    run, env, port = base / "run", {**os.environ, TOKEN_ENV: new_token()}, free_port()
    common = [*CONTROL_COMMON, f"--data.cache_dir={data_cache_dir}", f"--failures.schedule={control_pace(2)}",
              "--coordinator.hold_s=1", "--coordinator.rejoin_window_s=1"]  # fmt: skip
    where = ["--workers", "2", "--port", str(port), "--run-dir", str(run)]
    first = unbroken("coordinator", TINY, *where, *common, env=env, log=base / "coordinator-0.log")
    agent = unbroken("agent", "--coordinator", f"127.0.0.1:{port}", "--workers", "2", env=env, log=base / "agent.log")
    with _ended([first, agent]):
        _until(lambda: committed(run) >= 2, first, agent)
        first.kill()
        statuses = {"first": first.wait(), "agent": agent.wait()}
    restarted = unbroken("coordinator", TINY, *where, "--resume", "--restore", *common, env=env,
                         log=base / "coordinator-1.log")  # fmt: skip
    with _ended([restarted]):
        statuses["restarted"] = restarted.wait()
    return Abandoned(run, base, statuses)


def test_a_restarted_coordinator_whose_members_never_come_back_records_them_failed_and_stops(
    abandoned: Abandoned,
) -> None:
    """The workers of a coordinator killed for good stop by themselves (``EXIT_COORDINATOR_LOST``, the state of the
    last committed step saved). The coordinator started again later restores the last epoch, waits the rejoin window
    for its members, and as none comes back publishes an epoch of no members, records each as failed and stops the
    run (exit 1): ``unbroken status`` then shows no worker alive, not the last epoch's members."""
    run, statuses = abandoned.run, abandoned.statuses
    assert statuses["first"] == -signal.SIGKILL
    agent_log = (abandoned.logs / "agent.log").read_text()
    assert statuses["agent"] == 1, agent_log[-3000:]
    assert f"exit statuses of the workers: 0: {EXIT_COORDINATOR_LOST}, 1: {EXIT_COORDINATOR_LOST}" in agent_log
    assert statuses["restarted"] == 1, (abandoned.logs / "coordinator-1.log").read_text()[-3000:]
    records = read_records(run)
    (lost,) = read_records(run, RecordKind.COORDINATOR_LOST)
    saved = ckpt.load_latest(run)
    assert saved is not None and saved.step == lost["step"] == committed(run) + 1
    starts = [i for i, r in enumerate(records) if r["type"] == RecordKind.COORDINATOR]
    assert len(starts) == 2 and records[starts[0]]["restored_epoch"] == 0
    last_epoch = read_records(run, RecordKind.MEMBERSHIP)[-2]
    assert (records[starts[1]]["restored_epoch"], last_epoch["members"]) == (last_epoch["epoch"], [0, 1])
    after = records[starts[1] + 1 :]
    assert _kinds(after) == [RecordKind.MEMBERSHIP, RecordKind.FAILURE, RecordKind.FAILURE, RecordKind.STOPPED,
                             RecordKind.GATEWAY]  # fmt: skip
    membership, *failures, stopped, _ = after
    assert (membership["epoch"], membership["members"]) == (last_epoch["epoch"] + 1, [])
    assert membership["reason"] == "coordinator restarted: nobody came back; 0, 1 did not"
    assert [(f["worker"], f["why"]) for f in failures] == [
        (w, "did not come back to the restarted coordinator") for w in (0, 1)
    ]
    assert stopped["reason"] == "no worker came back to the restarted coordinator"
    shown = run_command([sys.executable, "-m", "unbroken", "status", str(run), "--json"], capture_output=True,
                        text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-3000:]
    snapshot = json.loads(shown.stdout)
    assert snapshot["run"]["members"] == [] and {w["id"]: w["state"] for w in snapshot["workers"]} == {
        0: "dead",
        1: "dead",
    }


def test_the_time_a_lost_coordinator_cost_is_in_the_goodput_coordinator_bucket(abandoned: Abandoned) -> None:
    """After the last committed step the job only stopped and waited for a coordinator: that tail of the session (the
    restarted coordinator continues it) holds the ``coordinator_lost`` record and the successor's, so all of it but
    the checkpoints written there goes to ``coordinator``, none of it elsewhere. Without those two records the same
    seconds go to another bucket (the checker tells them apart)."""
    records = read_records(abandoned.run)
    assert len(sessions(records)) == 1
    last_commit = max(r["time"] for r in records if r["type"] == RecordKind.STEP)
    end = max(r["time"] for r in records)
    tail = [r for r in records if r["time"] > last_commit]
    checkpoints = sum(r["seconds"] for r in tail if r["type"] == RecordKind.CHECKPOINT)
    assert RecordKind.COORDINATOR_LOST in _kinds(tail) and RecordKind.COORDINATOR in _kinds(tail)
    lost = account(records)
    assert lost.buckets[Bucket.COORDINATOR] == pytest.approx(end - last_commit - checkpoints, rel=1e-9)
    assert lost.buckets[Bucket.COORDINATOR] > 0
    unexplained = [r for r in records if not _coordinator_loss(r)]
    other = account(unexplained)
    assert other.buckets[Bucket.COORDINATOR] == 0.0
    assert other.badput_s == pytest.approx(lost.badput_s, rel=1e-9)  # the same seconds, put elsewhere


def _coordinator_loss(record: dict[str, Any]) -> bool:
    return record["type"] == RecordKind.COORDINATOR_LOST or (
        record["type"] == RecordKind.COORDINATOR and bool(record["restored_epoch"])
    )


# -- the launcher's death -----------------------------------------------------------------------------------------
def _reap_all(log: str, argv: list[str]) -> None:
    """Run ``argv`` as a child of this process, a child subreaper (every descendant whose parent dies becomes its
    child), and print each process it reaps as a JSON line (pid, exit status) until it has no child left. Run in
    a process of its own (``REAPER``): the pytest process must not be a subreaper (it would inherit every orphan of
    the other tests)."""
    import ctypes
    import json
    import os
    import subprocess

    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    with open(log, "ab") as out:
        started = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    print(json.dumps({"started": started.pid}), flush=True)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        print(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}), flush=True)


REAPER = inspect.getsource(_reap_all) + "\nimport sys\n_reap_all(sys.argv[1], sys.argv[2:])\n"


def _children(pid: int) -> set[int]:
    """The child processes of ``pid`` (those of each of its threads)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            found.update(int(c) for c in (task / "children").read_text().split())
    return found


def test_when_the_launcher_is_killed_the_coordinator_stops_the_job_and_every_process_it_started_ends(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """``unbroken train`` is SIGKILLed mid-run. Its coordinator sees its parent gone and stops the job ("the
    launcher died", exit 1); the workers read the stop and leave (``EXIT_STOPPED``); the zygote dies with the
    launcher (its parent-death signal). Every process the launcher started ends: the process above it, a child
    subreaper that inherits them, reaps each and ends only when none is left."""
    token, out = new_token(), tmp_path / "run"
    cmd = train_cmd(data_cache_dir, TINY, "--out", str(out), *CONTROL_COMMON, f"--failures.schedule={control_pace(2)}",
                    workers=2)  # fmt: skip
    # Started, not forked by the launchpad: the workers carry the token in /proc/PID/environ (``worker_pids``).
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(tmp_path / "launcher.log"), *cmd],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, TOKEN_ENV: token})  # fmt: skip
    assert reaper.stdout is not None
    try:
        launcher = json.loads(reaper.stdout.readline())["started"]
        _until(lambda: committed(out) >= 2, reaper)
        workers = worker_pids(token)
        coordinator = json.loads((out / "coordinator.json").read_text())["pid"]
        started = _children(launcher)  # the launcher is a subreaper: every process it started is its child
        assert sorted(workers) == [0, 1] and {coordinator, *workers.values()} < started, (started, workers)
        os.kill(launcher, signal.SIGKILL)
        ended = {line["pid"]: line["status"] for line in map(json.loads, reaper.stdout)}
        assert reaper.wait() == 0
    finally:
        if reaper.poll() is None:
            reaper.kill()
            reaper.wait()
    assert ended[launcher] == -signal.SIGKILL
    assert set(ended) == started | {launcher}  # none left behind, and no other
    assert ended[coordinator] == 1, (out / "logs" / "coordinator.log").read_text()[-3000:]
    assert {wid: ended[pid] for wid, pid in workers.items()} == {0: EXIT_STOPPED, 1: EXIT_STOPPED}
    zygote = started - {coordinator, *workers.values()}
    assert {ended[pid] for pid in zygote} == {-signal.SIGKILL}
    assert [r["reason"] for r in read_records(out, RecordKind.STOPPED)] == ["the launcher died"]
    assert not read_records(out, RecordKind.FINAL)


# -- the alert webhook --------------------------------------------------------------------------------------------
class Hook:
    """An HTTP endpoint on this host that keeps each request's JSON body and answers the first with ``first`` (raw
    bytes; b"" hangs up without answering) and every other with 204. ``listen()`` starts taking connections: until
    then the port is bound but refuses them."""

    def __init__(self, first: bytes) -> None:
        self.first, self.bodies = first, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def listen(self) -> None:
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(4096)
                head, body = head.split(b"\r\n\r\n", 1)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
                    b"content-length:"))  # fmt: skip
                while len(body) < length:
                    body += conn.recv(4096)
                self.bodies.append(json.loads(body))
                conn.sendall(self.first if len(self.bodies) == 1 else NO_CONTENT)

    def close(self) -> None:
        self.sock.close()


FAILED = "metrics.alert_webhook {url} failed"
NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
ANSWERS = {
    "an error status": b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n",
    "not http": b"no HTTP here\r\n\r\n",
    "hangs up": b"",
}


@pytest.mark.parametrize("first", ["refused", *ANSWERS])
def test_a_webhook_that_fails_is_logged_and_the_next_alert_still_goes_out(
    first: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The webhook refuses the first alert's connection, or answers it with an error status, with something that is
    not HTTP, or not at all: the failure is logged (one line), and the next alert still goes out."""
    caplog.set_level(logging.ERROR, logger="unbroken.control.status.alerts")
    hook = Hook(ANSWERS.get(first, NO_CONTENT))
    failed = FAILED.format(url=hook.url)
    alerter = Alerter(MetricsConfig(alert_webhook=hook.url), "/runs/z")
    try:
        if first != "refused":
            hook.listen()
        alerter.write(make(RecordKind.FAILURE, 1.0, worker=1, why="process killed by SIGKILL", epoch=2))
        if first == "refused":
            _until(lambda: any(failed in r.getMessage() for r in caplog.records))  # the refusal came first
            hook.listen()
        alerter.write(make(RecordKind.STOPPED, 2.0, reason="every worker died"))
        alerter.close()
    finally:
        hook.close()
    assert [failed in r.getMessage() for r in caplog.records] == [True]
    sent = [AlertKind.FAILURE] if first != "refused" else []
    assert [b["alert"] for b in hook.bodies] == [*sent, AlertKind.STOPPED]


def test_a_run_goes_on_when_its_webhook_answers_badly(tmp_path: Path, data_cache_dir: Path) -> None:
    """A real run of 3 workers, two of them killed, with a webhook that answers the first failure's alert with
    something that is not HTTP: the coordinator logs it, the second failure's alert still reaches the webhook, and
    the run finishes."""
    hook = Hook(ANSWERS["not http"])
    hook.listen()
    out = tmp_path / "run"
    schedule = "--failures.schedule=kill:worker=1,step=2; kill:worker=2,step=4"
    try:
        result = train(out, data_cache_dir, f"--metrics.alert_webhook={hook.url}", schedule, workers=3)
    finally:
        hook.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_records(out, RecordKind.FINAL)
    assert [(b["alert"], b["record"]["worker"]) for b in hook.bodies] == [
        (AlertKind.FAILURE, 1),
        (AlertKind.FAILURE, 2),
    ]
    log = (out / "logs" / "coordinator.log").read_text()
    assert log.count(FAILED.format(url=hook.url)) == 1, log[-3000:]
