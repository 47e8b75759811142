"""Host heartbeats (``comm.heartbeats = "host"``, ``control.hostbeat``): the board's format, the agent's pass
against a real coordinator store, and a job of two agents whose workers' beats only their agents send, with a
worker stopped and an agent killed from outside. The oracle of the job is the failure-free run, bitwise."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from runner import (
    CONTROL_COMMON,
    CONTROL_STEPS,
    TINY,
    agent_worker_pid,
    committed,
    control_pace,
    free_port,
    same_final,
    two_hosts,
    unbroken,
    wait_for,
)

from unbroken.control.member.client import CoordinatorClient
from unbroken.control.member.hostbeat import (
    BEHIND_INTERVALS,
    HOST_BEAT_ENV,
    NO_WORKER,
    BeatBoard,
    HostBeats,
    WorkerBeat,
    pass_stamp,
)
from unbroken.control.store import keys
from unbroken.control.store.connect import open_store
from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.records import read_records, step_losses
from unbroken.lab.faultdriver import process_state

TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(TIMEOUT_S)
LONG_INTERVAL_S = TIMEOUT_S / BEHIND_INTERVALS  # so long that no agent counts as behind within a test here


def test_a_board_round_trips_between_the_agent_and_its_workers() -> None:
    beats = HostBeats(interval_s=0.05, op_timeout_s=1.0, slots=3)
    try:
        live, ended = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["true"])
        ended.wait()
        values = [beats.env_for_new_process() for _ in range(3)]
        assert [v.split(":", 1)[0] for v in values] == ["0", "0", "0"]  # none bound: the first slot each time
        beats.bind(values[0], live)
        beats.bind(beats.env_for_new_process(), ended)
        assert beats.env_for_new_process().startswith("1:")  # slot 0 is held while its process lives
        beats.bind(beats.env_for_new_process(), live)
        beats.bind(beats.env_for_new_process(), live)
        with pytest.raises(RuntimeError, match="all 3 slots are held by live processes"):
            beats.env_for_new_process()
        live.kill()
        live.wait()
        values = [beats.env_for_new_process()]  # its slots are free again, emptied
        assert values[0].startswith("0:")
        values.append(beats.env_for_new_process())
        worker = WorkerBeat.from_env(values[1])
        assert worker is not None and worker.slot == 0
        assert beats.board.read(0) == (NO_WORKER, 0)
        seen: dict[int, int] = {}
        worker.beat()  # before its id is known: counted, passed on for nobody
        assert beats.moved(seen) == []
        worker.claim(7)
        worker.beat()
        assert beats.board.read(0) == (7, 2)
        assert beats.moved(seen) == [7] and beats.moved(seen) == []  # once per change
        worker.beat()
        assert beats.moved(seen) == [7]
        assert worker.agent_call_since() is None
        beats.board.call_began(123.5)
        beats.board.call_began(124.5)  # the first failing call is the one kept
        assert worker.agent_call_since() == 123.5
        beats.board.call_ended()
        assert worker.agent_call_since() is None
        assert worker.agent_behind(0.25)  # never passed anything on: the worker sends its own
        look_began = time.monotonic()
        assert not worker.passed_since(look_began)
        beats.board.passed(look_began)
        # Behind once the last pass is more than 2 intervals old: with intervals of half this module's timeout,
        # a pass made during the test never is, and one made 0.6 s ago always is for intervals of 0.25 s.
        assert not worker.agent_behind(LONG_INTERVAL_S)
        assert worker.passed_since(look_began) and not worker.passed_since(time.monotonic())
        beats.board.passed(time.monotonic() - 0.6)
        assert worker.agent_behind(0.25) and not worker.agent_behind(LONG_INTERVAL_S)
    finally:
        beats.close()
    assert not Path(beats.board.path).exists()
    assert WorkerBeat.from_env("") is None


def test_what_is_not_a_board_is_refused_with_one_line(tmp_path: Path) -> None:
    for value in ("board", "x:/nowhere", "-1:/nowhere"):
        with pytest.raises(ValueError, match="expected SLOT:PATH"):
            WorkerBeat.from_env(value)
    other = tmp_path / "other"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="is not a beat board"):
        BeatBoard.attach(str(other))
    with pytest.raises(ValueError, match="is not a beat board"):
        (tmp_path / "short").write_bytes(b"\0" * 8)
        BeatBoard.attach(str(tmp_path / "short"))


def test_an_agent_that_cannot_reach_its_coordinator_says_since_when_on_the_board(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where nothing listens, the agent's attempts fail: the board keeps the time of the first one (what a worker's
    takeover check reads), not each attempt's. Each failed attempt logs one warning: the board is read again after
    3 more."""
    beats = HostBeats(interval_s=0.05, op_timeout_s=1.0)

    def attempts() -> int:
        return sum("host heartbeats: cannot reach the coordinator" in r.getMessage() for r in caplog.records)

    try:
        before = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="unbroken.control.member.hostbeat"):
            beats.follow(f"127.0.0.1:{free_port()}", new_token())
            wait_for(lambda: beats.board.call_since() is not None, 10, "a failed attempt on the board")
            since = beats.board.call_since()
            assert since is not None and before <= since <= time.monotonic()
            seen = attempts()
            wait_for(lambda: attempts() >= seen + 3, 60, "3 more failed attempts")
        assert beats.board.call_since() == since
        assert beats.board.passed_at() is None
    finally:
        beats.close()


def test_a_pass_stamp_always_grows() -> None:
    stamps = [pass_stamp(0)]
    for _ in range(1000):
        stamps.append(pass_stamp(stamps[-1]))
    assert all(b > a for a, b in zip(stamps, stamps[1:], strict=False))
    assert pass_stamp(2**62) == 2**62 + 1


def test_a_worker_s_first_beat_does_not_wait_for_its_agent(tmp_path: Path) -> None:
    """The coordinator counts a member's silence from its admission, so a worker sends its own beats until its
    agent has passed one of them on, even where the agent's last pass is recent. Here the agent passes once and
    then ends (as one whose call is stuck): worker 0's key must appear before the agent would count as behind,
    which only the worker's own ``add`` can do (before host heartbeats sent the first beat too, it could only
    appear after that)."""
    env = {**os.environ, TOKEN_ENV: new_token()}
    port, run = free_port(), tmp_path / "run"
    interval_s = 20.0  # the worker's beats: the agent counts as behind 2 intervals after its last pass
    coordinator = unbroken("coordinator", TINY, "--workers", "1", "--port", str(port), "--run-dir", str(run),
                           "--comm.join_timeout_s=100", f"--comm.heartbeat_timeout_s={3 * interval_s}",
                           env=env, log=tmp_path / "coordinator.log")  # fmt: skip
    beats = HostBeats(interval_s=0.05, op_timeout_s=2.0)
    client = None
    try:
        address = f"127.0.0.1:{port}"
        worker = WorkerBeat.from_env(beats.env_for_new_process())
        assert worker is not None
        beats.follow(address, env[TOKEN_ENV])
        wait_for(lambda: beats.board.passed_at() is not None, 60, "the agent's first pass")
        beats.close()
        wait_for(lambda: _threads("host-beats-") == 0, 10, "the agent's thread to end")
        passed = beats.board.passed_at()
        assert passed is not None
        behind_at = passed + BEHIND_INTERVALS * interval_s
        client = CoordinatorClient(
            address, 0, heartbeat_interval_s=interval_s, heartbeat_timeout_s=3 * interval_s, token=env[TOKEN_ENV],
            host_beat=worker,
        )  # fmt: skip
        store, tunnel = open_store(address, token=env[TOKEN_ENV])
        # The coordinator writes 0 at the admission (its count of the member's silence starts there); a beat
        # moves it, and with the agent gone only the worker's own add can. The agent is not behind yet once it
        # has moved: the add was the first beat's, not one sent because the agent was behind (its last pass is
        # fixed, so once behind it stays behind).
        wait_for(lambda: store.add(keys.heartbeat(0), 0) > 0, 120, "worker 0's first beat")
        assert not worker.agent_behind(interval_s), f"the key moved after {behind_at} (the agent behind)"
        tunnel.close()
    finally:
        if client is not None:
            client.close()
        beats.close()
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait()


BEATER = """
import sys, time
from unbroken.control.member.hostbeat import WorkerBeat
beat = WorkerBeat.from_env()
beat.claim(int(sys.argv[1]))
print("beating", flush=True)
while True:
    beat.beat()
    time.sleep(0.02)
"""


def _threads(prefix: str) -> int:
    """This process's live threads whose name starts with ``prefix``."""
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_the_agent_passes_on_the_beats_of_its_live_workers_only(tmp_path: Path) -> None:
    """Two processes beat on a board (workers 5 and 9); the agent's thread writes their heartbeat keys in the
    store of a real coordinator. Once worker 9's process is stopped (SIGSTOP) its key no longer moves while 5's
    does; a stopped agent thread (``close``) stops both."""
    env = {**os.environ, TOKEN_ENV: new_token()}
    port, run = free_port(), tmp_path / "run"
    coordinator = unbroken("coordinator", TINY, "--workers", "2", "--port", str(port), "--run-dir", str(run),
                           "--comm.join_timeout_s=100", env=env, log=tmp_path / "coordinator.log")  # fmt: skip
    guards_before = _threads("store-call-guard")
    beats = HostBeats(interval_s=0.05, op_timeout_s=2.0)
    workers: list[subprocess.Popen[bytes]] = []
    slots: dict[int, int] = {}  # worker id -> its slot on the board
    try:
        address = f"127.0.0.1:{port}"

        def reachable() -> bool:
            try:
                open_store(address, timeout_s=1.0, token=env[TOKEN_ENV])[1].close()
                return True
            except (OSError, RuntimeError):
                return False

        wait_for(reachable, 60, "the coordinator")
        store, tunnel = open_store(address, token=env[TOKEN_ENV])
        beats.follow(address, env[TOKEN_ENV])
        for wid in (5, 9):
            child_env = {**env, HOST_BEAT_ENV: beats.env_for_new_process()}
            slots[wid] = int(child_env[HOST_BEAT_ENV].partition(":")[0])
            workers.append(
                subprocess.Popen([sys.executable, "-c", BEATER, str(wid)], env=child_env, stdout=subprocess.PIPE)
            )
            beats.bind(child_env[HOST_BEAT_ENV], workers[-1])
        for proc in workers:
            assert proc.stdout is not None and proc.stdout.readline() == b"beating\n"

        def value(wid: int) -> int:
            return int(store.get(keys.heartbeat(wid))) if store.check([keys.heartbeat(wid)]) else 0

        def counted(wid: int) -> int:
            return beats.board.read(slots[wid])[1]

        def beats_passed_on(wid: int) -> None:
            """Return once ``wid`` has beaten since the call and a look of the agent begun after that beat is over
            (the board's note of the last look that went through): every beat counted before that look began has
            been passed on, so a key read before the call has been written since, with a larger stamp."""
            count = counted(wid)
            wait_for(lambda: counted(wid) > count, 60, f"a beat of worker {wid}")
            beaten = time.monotonic()
            wait_for(lambda: (beats.board.passed_at() or 0) >= beaten, 60, f"a look after worker {wid}'s beat")

        def moves(wid: int) -> bool:
            """Whether the agent passes ``wid``'s beats on (its key moves through a pass after a beat)."""
            before = value(wid)
            beats_passed_on(wid)
            return value(wid) > before

        wait_for(lambda: value(5) > 0 and value(9) > 0, 30, "both keys written")
        assert value(5) > 10**15  # the agent's stamp (microseconds since the epoch), not a worker's own count
        assert moves(5) and moves(9)
        workers[1].send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(workers[1].pid) == "T", 10, "worker 9 stopped")
        # A look that began before the stop may still pass on worker 9's last beats, and so may the first look
        # that begins after it (the count it finds may differ from the one before); every later look finds no
        # change. The board says when the last look that went through began: once that is after the stop, the
        # first look after it is over.
        stopped_at = time.monotonic()
        wait_for(lambda: (beats.board.passed_at() or 0) >= stopped_at, 10, "a pass begun after the stop")
        frozen = value(9)
        for _ in range(3):  # passes that moved worker 5's key leave worker 9's where the stop left it
            assert moves(5) and value(9) == frozen
        beats.close()
        wait_for(lambda: _threads("host-beats-") == 0, 10, "the agent's thread to end")
        wait_for(lambda: _threads("store-call-guard") == guards_before, 10, "the thread's call guard to end")
        # No agent is left to pass worker 5's beats on: its key stays put through beats it goes on counting.
        left, count = value(5), counted(5)
        wait_for(lambda: counted(5) >= count + 3, 60, "3 more beats of worker 5")
        assert value(5) == left
        tunnel.close()
    finally:
        beats.close()
        for proc in workers:
            proc.kill()
            proc.wait()
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait()


def test_two_hosts_beating_through_their_agents_survive_a_stopped_worker_and_a_killed_agent(
    tmp_path: Path, data_cache_dir: Path, control_reference: Path, seed: int
) -> None:
    """Two agents of 2 workers each, ``comm.heartbeats = "host"``: the workers' heartbeat keys hold their agents'
    stamps. At a random step, from outside, worker 1 (of agent 0) is stopped (SIGSTOP) and agent 1 alone is
    killed (``kill -9`` of its process, its workers left running). Agent 0 goes on passing worker 0's beats but
    not worker 1's, which the coordinator removes for silence; workers 2 and 3 find their agent behind and send
    their own beats (their keys move by ones again), so nobody takes them for dead. The run ends with workers 0,
    2 and 3, bitwise the failure-free run."""
    env = {**os.environ, TOKEN_ENV: new_token()}
    port, run = free_port(), tmp_path / "run"
    # 5 s of silence, not 2, as in test_control: a starved moment of this shared machine is not a death.
    overrides = [*CONTROL_COMMON, f"--data.cache_dir={data_cache_dir}", "--comm.heartbeat_timeout_s=5"]
    overrides += ["--comm.heartbeats=host", f"--failures.schedule={control_pace(4)}"]
    coordinator, agents = two_hosts(tmp_path, run, port, overrides, env)
    stop_at = random.Random(seed).randint(3, 12)
    stopped: int | None = None
    try:
        wait_for(lambda: committed(run) >= 2, 120, "step 2")
        store, tunnel = open_store(f"127.0.0.1:{port}", token=env[TOKEN_ENV])
        beats = [int(store.get(keys.heartbeat(w))) for w in range(4)]
        tunnel.close()
        assert all(b > 10**15 for b in beats), beats  # written by the agents, not counted by the workers
        wait_for(lambda: committed(run) >= stop_at, 120, f"step {stop_at} (seed {seed})")
        stopped = agent_worker_pid(agents[0], 1)
        os.kill(stopped, signal.SIGSTOP)
        os.kill(agents[1].pid, signal.SIGKILL)  # the agent only: its workers run on
        wait_for(lambda: any(f["worker"] == 1 for f in read_records(run, "failure")), 60, "worker 1 found silent")
        # A stamp is the time its look began, in microseconds since the epoch; a worker's own add moves its key by
        # one. Agent 1 died a heartbeat timeout (5 s) before ``now`` at least: every stamp it wrote is below it, and
        # worker 2's adds since (one a beat) cannot take its key to it. Agent 0 lives: a look of it that begins
        # after ``now`` writes worker 0's key a stamp above it.
        now = time.time_ns() // 1000
        store, tunnel = open_store(f"127.0.0.1:{port}", token=env[TOKEN_ENV])

        def key(w: int) -> int:
            return int(store.get(keys.heartbeat(w)))

        wait_for(lambda: key(0) >= now, 60, f"a stamp of agent 0 after {now} (seed {seed})")
        seen = [key(2)]
        for _ in range(3):  # worker 2's key moves, and only by its own adds
            wait_for(lambda: key(2) != seen[-1], 60, f"worker 2's key to move from {seen[-1]} (seed {seed})")
            seen.append(key(2))
        tunnel.close()
        assert all(a < b for a, b in zip(seen, seen[1:], strict=False)) and seen[-1] < now, (seen, now, seed)
        assert coordinator.wait(timeout=200) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):  # its agent may have ended it at the run's end
                os.kill(stopped, signal.SIGKILL)
        for p in (coordinator, *agents):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in agents:
            p.wait()
    failures = {f["worker"]: f["why"] for f in read_records(run, "failure")}
    assert list(failures) == [1] and failures[1].startswith("no heartbeat"), failures
    memberships = [tuple(m["members"]) for m in read_records(run, "membership")]
    assert memberships[0] == (0, 1, 2, 3) and memberships[-1] == (0, 2, 3)
    final = read_records(run, "final")[0]
    assert final["identical"] and sorted(final["checksums"]) == ["0", "2", "3"]
    assert step_losses(run) == step_losses(control_reference)
    same_final(control_reference, run, CONTROL_STEPS)
