"""The worker's side of the control plane, each collaborator of ``CoordinatorClient`` alone against a real store
(``control.member``): the registration, the metrics outbox, the heartbeat sender, the news watch and the
reconnection. The client as a whole is tested against real coordinators in test_coordinator.py, test_control.py,
test_newsrelay.py and test_hostbeat.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from runner import wait_for
from torch.distributed import TCPStore

from unbroken.control.member.heartbeat import STALL_HEADER, Heartbeat
from unbroken.control.member.hostbeat import BeatBoard, WorkerBeat
from unbroken.control.member.outbox import MetricsOutbox
from unbroken.control.member.reconnect import HeldStore, Reconnection
from unbroken.control.member.registration import Refused, register
from unbroken.control.member.watch import NewsWatch
from unbroken.control.store import keys
from unbroken.control.store.connect import serve_store
from unbroken.control.store.gateway import Gateway, Tunnel, new_token
from unbroken.core.records import RecordKind, decode, make

pytestmark = pytest.mark.timeout(60)


@dataclass
class Served:
    """A store served as a coordinator serves it: the master handle, and a gateway in front for token holders."""

    store: TCPStore
    address: str  # the gateway's
    token: str
    port: int  # the store's own (no tunnel)

    def client(self) -> TCPStore:
        """A plain client connection to the store (no tunnel)."""
        return TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False)


@contextlib.contextmanager
def served(incarnation: str = "first") -> Iterator[Served]:
    store, port = serve_store(timeout_s=10.0)
    public = socket.socket()
    public.bind(("127.0.0.1", 0))
    public.listen(64)
    token = new_token()
    gateway = Gateway(public, ("127.0.0.1", port), token, handshake_timeout_s=600.0)
    store.set(keys.INCARNATION, incarnation)
    try:
        yield Served(store, f"127.0.0.1:{public.getsockname()[1]}", token, port)
    finally:
        gateway.close()


def nothing_listens() -> str:
    """An address where nothing listens (a port bound and closed again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


class _Broken:
    """A connection whose every call fails, as one to a coordinator that died does."""

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Connection reset by peer")

        return call


# -- registration ------------------------------------------------------------------------------------------------
def _answer(master: TCPStore, seq: int, worker_id: int, late: bool, refusal: str | None = None) -> dict[str, Any]:
    """As the coordinator: read registration ``seq``'s request and admit it as ``worker_id`` (or refuse it)."""
    master.wait([keys.register(seq)])
    request = json.loads(master.get(keys.register(seq)))
    if refusal is not None:
        master.set(keys.refused(worker_id), refusal)
    master.set(keys.register_late(seq), "1" if late else "0")
    master.set(keys.register_id(seq), str(worker_id))
    return request


def test_a_registration_sends_its_request_and_reads_the_coordinator_s_answer() -> None:
    """A new worker's request carries its fingerprint, its start cost and a promoted spare's index; a returning
    one (its coordinator replaced) carries no start cost; the admitted id and the joiner's flag are the
    coordinator's; a refusal is ``Refused`` with the coordinator's one line."""
    with served() as s:
        requests: list[dict[str, Any]] = []

        def coordinator() -> None:
            requests.append(_answer(s.store, 1, 5, late=True))
            requests.append(_answer(s.store, 2, 5, late=False))
            requests.append(_answer(s.store, 3, 6, late=False, refusal="its numerics differ from the job's"))

        answering = threading.Thread(target=coordinator)
        answering.start()
        worker = s.client()
        assert register(worker, None, False, {"torch": "2.x"}, spare=2) == (5, True)
        assert register(worker, 5, True, {"torch": "2.x"}) == (5, False)
        with pytest.raises(Refused, match="its numerics differ from the job's"):
            register(worker, 6, False, {})
        answering.join()
    new, returning, _ = requests
    assert new["worker_id"] == -1 and new["spare"] == 2 and new["fingerprint"] == {"torch": "2.x"}
    assert {"start_s", "start_cpu_s", "forked"} <= new.keys() and not new["returning"]
    assert returning["worker_id"] == 5 and returning["returning"] and "spare" not in returning
    assert not {"start_s", "start_cpu_s", "forked"} & returning.keys()


# -- metrics delivery --------------------------------------------------------------------------------------------
def _delivered(master: TCPStore) -> list[int]:
    """The ``n`` of each record in the store, in the order of their sequence numbers."""
    count = master.add(keys.METRICS_SEQ, 0)
    records = [decode(master.get(keys.metrics(seq)).decode()) for seq in range(1, count + 1)]
    return [r["n"] for r in records if r is not None]


def _deliver_until_closed(outbox: MetricsOutbox, store: TCPStore) -> None:
    while outbox.deliver(store, 0.01):
        pass


def test_the_outbox_delivers_in_order_and_keeps_the_record_a_failed_connection_had_in_hand() -> None:
    """Records reach the store in the order they were queued, a flush marks that point, a record whose delivery
    failed goes first on the next connection, and the recent ones can be sent again (a coordinator that replaced
    a dead one may not have them); the close ends the delivery after what was queued before it."""
    with served() as s:
        outbox = MetricsOutbox()
        store = s.client()
        for n in range(3):
            outbox.put(make(RecordKind.USER, 0.0, n=n))
        while len(_delivered(s.store)) < 3:
            assert outbox.deliver(store, 0.0)
        assert _delivered(s.store) == [0, 1, 2]
        outbox.put(make(RecordKind.USER, 0.0, n=3))
        with pytest.raises(RuntimeError):
            outbox.deliver(_Broken(), 0.0)  # type: ignore[arg-type]
        outbox.put(make(RecordKind.USER, 0.0, n=4))
        assert outbox.deliver(store, 0.0) and _delivered(s.store) == [0, 1, 2, 3]  # the one in hand first
        outbox.resend_recent()
        outbox.close()
        _deliver_until_closed(outbox, store)
        assert _delivered(s.store) == [0, 1, 2, 3, 4, 0, 1, 2, 3]


def test_a_flush_waits_for_the_sender_and_gives_up_once_the_worker_is_lost() -> None:
    """A flush returns True once the sender has delivered everything queued before it, and False, without a
    sender, once the worker is lost."""
    with served() as s:
        outbox = MetricsOutbox()
        outbox.put(make(RecordKind.USER, 0.0, n=0))
        lost = threading.Event()
        assert not outbox.flush(lost.is_set, timeout_s=0.0)  # nobody delivers: the time is up
        lost.set()
        assert not outbox.flush(lost.is_set, timeout_s=60.0)
        sender = threading.Thread(target=_deliver_until_closed, args=(outbox, s.client()))
        sender.start()
        outbox.put(make(RecordKind.USER, 0.0, n=1))
        assert outbox.flush(lambda: False, timeout_s=60.0)
        assert _delivered(s.store) == [0, 1]
        outbox.close()
        sender.join()


# -- heartbeats --------------------------------------------------------------------------------------------------
def test_a_beat_goes_to_the_store_until_the_agent_has_passed_one_on_and_again_while_it_is_behind() -> None:
    """Under host heartbeats each beat counts on the board; the worker's own ``add`` goes too until the agent has
    passed on a beat counted after the worker's first, and again once the agent's last pass is older than two
    intervals. Without a board every beat is an ``add``."""
    board = BeatBoard.create(slots=1)
    try:
        worker = WorkerBeat(board, 0)
        worker.claim(3)
        beat = Heartbeat(interval_s=3600.0, timeout_s=7200.0, host_beat=worker)
        with served() as s:
            store, key = s.client(), keys.heartbeat(3)
            beat.beat(store, key)
            assert board.read(0) == (3, 1) and s.store.add(key, 0) == 1  # the agent never passed any
            board.passed(time.monotonic())  # a look that began after the first count
            beat.beat(store, key)
            assert board.read(0) == (3, 2) and s.store.add(key, 0) == 1  # the agent's pass is recent
            beat.interval_s = 0.001
            time.sleep(0.01)  # the agent's last pass is now older than two intervals
            beat.beat(store, key)
            assert board.read(0) == (3, 3) and s.store.add(key, 0) == 2
            alone = Heartbeat(interval_s=3600.0, timeout_s=7200.0)
            alone.beat(store, key)
            assert s.store.add(key, 0) == 3
    finally:
        board.close()
        shutil.rmtree(os.path.dirname(board.path))


def test_a_beat_is_unanswered_since_the_agent_s_calls_began_failing() -> None:
    board = BeatBoard.create(slots=1)
    try:
        beat = Heartbeat(interval_s=1.0, timeout_s=2.0, host_beat=WorkerBeat(board, 0))
        assert beat.unanswered_since() is None
        board.call_began(123.0)
        assert beat.unanswered_since() == 123.0
        beat.since = 100.0  # the worker's own call under way since earlier
        assert beat.unanswered_since() == 100.0
        board.call_ended()
        beat.since = None
        assert beat.unanswered_since() is None
    finally:
        board.close()
        shutil.rmtree(os.path.dirname(board.path))


def test_a_late_beat_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A beat late by most of the timeout logs (the stacks, or a line saying they were logged lately), once per
    late beat; a beat on time logs nothing."""
    beat = Heartbeat(interval_s=3600.0, timeout_s=7200.0)
    with caplog.at_level(logging.WARNING, logger="unbroken.control.member.heartbeat"):
        beat.log_if_late()
        assert "heartbeat late" not in caplog.text
        beat.done = time.monotonic() - 7200.0
        beat.log_if_late()
        beat.log_if_late()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("heartbeat late by"), lines
    assert STALL_HEADER.split("{")[0] in lines[0] or "logged every thread's stack lately" in lines[0]


def test_the_sender_beats_and_delivers_the_records_until_the_outbox_closes() -> None:
    with served() as s:
        beat, outbox = Heartbeat(interval_s=0.05, timeout_s=1.0), MetricsOutbox()
        sender = threading.Thread(target=beat.run, args=(s.client(), 4, outbox))
        sender.start()
        for n in range(5):
            outbox.put(make(RecordKind.USER, 0.0, n=n))
        assert outbox.flush(lambda: False, timeout_s=60.0)
        wait_for(lambda: s.store.add(keys.heartbeat(4), 0) >= 2, 60, "two beats")
        outbox.close()
        sender.join(timeout=60)
        assert not sender.is_alive()
        assert _delivered(s.store) == [0, 1, 2, 3, 4]


# -- the news watch ----------------------------------------------------------------------------------------------
def _publish(master: TCPStore, epoch: int, members: list[int], reform: bool = False) -> str:
    record = json.dumps({"epoch": epoch, "members": members, "reason": "test", "reform": reform})
    master.set(keys.epoch(epoch), record)
    master.set(keys.EPOCH, str(epoch))
    return record


def _ring(master: TCPStore, held: str = "") -> None:
    """Ring the workers' doorbell as the coordinator does (``Coordinator.announce``)."""
    n = master.add(keys.doorbell_seq(keys.NEWS), 1)
    master.set(keys.doorbell(keys.NEWS, n), held)


def test_the_news_watch_notes_each_removal_the_exclusion_and_tells_of_the_newest_epoch_only() -> None:
    """From epoch 1 (members 0, 1, 2) to 5: epoch 2 removes 1, epoch 3 re-forms (every member counts as removed
    from the old group), epoch 4 was never published (a coordinator restarted), epoch 5 removes worker 0, which
    is then excluded. ``on_epoch`` hears of epoch 5 alone."""
    with served() as s:
        _publish(s.store, 1, [0, 1, 2])
        _publish(s.store, 2, [0, 2])
        _publish(s.store, 3, [0, 2], reform=True)
        _publish(s.store, 5, [2])
        told: list[tuple[int, tuple[int, ...]]] = []
        watch = NewsWatch(0, 1, frozenset({0, 1, 2}), None, threading.Event())
        watch.on_epoch = lambda epoch, members: told.append((epoch, members))
        watch.advance(s.client(), 5)
        assert watch.removals == [(2, frozenset({1})), (3, frozenset({0, 2})), (5, frozenset({0}))]
        assert watch.excluded and watch.latest_epoch == 5 and told == [(5, (2,))]
        assert watch.removed_since(2, (0, 2)) and not watch.removed_since(5, (2,))
        joiner = NewsWatch(7, 1, frozenset({0, 1, 2}), None, threading.Event())
        joiner.advance(s.client(), 2)
        assert not joiner.excluded  # never a member: an epoch without it does not exclude it


def test_the_news_watch_sees_an_epoch_and_the_stop_as_the_coordinator_rings_them() -> None:
    with served() as s:
        s.store.set(keys.EPOCH, "0")
        s.store.add(keys.doorbell_seq(keys.NEWS), 0)
        stopping = threading.Event()
        watch = NewsWatch(0, 0, frozenset(), None, stopping)
        errors: list[Exception] = []

        def run() -> None:
            try:
                watch.run(s.client(), "first")
            except Exception as e:
                errors.append(e)

        watcher = threading.Thread(target=run)
        watcher.start()
        _ring(s.store, _publish(s.store, 1, [0, 1]))
        wait_for(lambda: watch.latest_epoch == 1, 60, "epoch 1")
        assert watch.stopped is None and watch.seen_members == frozenset({0, 1})
        s.store.set(keys.STOP, "enough")
        _ring(s.store)
        wait_for(lambda: watch.stopped == "enough", 60, "the stop")
        stopping.set()
        _ring(s.store)  # ends the watch's wait
        watcher.join(timeout=60)
        assert not watcher.is_alive() and not errors
        watch.note_stop("lost")
        assert watch.stopped == "enough"  # the first reason is kept


# -- reconnection ------------------------------------------------------------------------------------------------
class _Member:
    """What the reconnection asks of its client, recorded."""

    def __init__(self, answer: str | None = None) -> None:
        self.answer = answer
        self.readmitted: list[str] = []
        self.resumed: list[int] = []
        self.lost: list[str] = []
        self.stores: list[Any] = [_Broken()]

    def readmit(self, address: str, store: TCPStore, tunnel: Tunnel) -> str | None:
        self.readmitted.append(address)
        self.stores.append(store)
        return self.answer

    def reconnection(self, addresses: list[str], token: str, hold_s: float = 60.0) -> Reconnection:
        return Reconnection(
            addresses, token, hold_s, 5.0, threading.Event(), self.readmit, self.resumed.append, self.lost.append
        )


def test_a_worker_no_coordinator_answers_for_hold_s_is_lost() -> None:
    member = _Member()
    address = nothing_listens()
    reconnection = member.reconnection([address], new_token(), hold_s=0.2)
    reconnection.connection_failed()
    assert reconnection.wait_lost(60.0) == "coordinator"
    assert member.lost == [f"no coordinator at {address} answered within 0 s"] and not member.readmitted


def test_a_connection_cut_while_its_coordinator_still_answers_is_lost_as_cut() -> None:
    member = _Member()
    with served("first") as s:
        reconnection = member.reconnection([s.address], s.token)
        reconnection.incarnation = "first"
        reconnection.connection_failed()
        assert reconnection.wait_lost(60.0) == "cut"
    assert member.lost == ["this worker's connection to the coordinator was cut"] and not member.readmitted


def test_another_incarnation_is_joined_and_a_held_call_is_made_again_on_it() -> None:
    """A training-thread call that fails on the old connection waits while the reconnection finds the
    coordinator's successor (the first address: nothing listens there any more), re-registers and resumes on a
    new generation; the call is then made on the new connection."""
    member = _Member()
    with served("second") as s:
        s.store.set(keys.EPOCH, "7")
        reconnection = member.reconnection([nothing_listens(), s.address], s.token)
        reconnection.incarnation = "first"
        held = HeldStore(lambda: member.stores[-1], reconnection)
        assert int(held.get(keys.EPOCH)) == 7
    assert member.readmitted == [s.address] and member.resumed == [1] and not member.lost
    assert reconnection.incarnation == "second" and reconnection.generation == 1 and reconnection.lost is None


def test_a_successor_that_admits_the_worker_under_another_id_loses_it() -> None:
    member = _Member(answer="the new coordinator admitted this worker as 9, not 2")
    with served("second") as s:
        reconnection = member.reconnection([s.address], s.token)
        reconnection.incarnation = "first"
        held = HeldStore(lambda: member.stores[-1], reconnection)
        with pytest.raises(RuntimeError):
            held.get(keys.EPOCH)
    assert reconnection.lost == "cut" and member.lost == [member.answer] and not member.resumed
