"""A host's news relay (``control.newsrelay``): the frames' wire format, the relay against a real coordinator's
store and gateway, and workers' clients that take their news from it and go back to the store when it is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner import TINY, in_process_coordinator, wait_for
from torch.distributed import TCPStore

from unbroken.control.member.client import CoordinatorClient
from unbroken.control.member.news import (
    Frame,
    FrameKind,
    News,
    NewsRelay,
    RelayedNews,
    RelayGone,
    decode_frame,
    encode_frame,
    look,
    next_news,
)
from unbroken.control.store import keys
from unbroken.control.store.connect import bind_listen_socket, connect_store, read_json, report_death, request_stop
from unbroken.control.store.gateway import new_token

pytestmark = pytest.mark.timeout(120)


def test_every_frame_survives_its_round_trip_and_garbage_is_refused() -> None:
    record = {"epoch": 7, "members": [0, 2, 3], "reason": "worker 1 died"}
    for frame in (
        Frame(FrameKind.EPOCH, "inc-a", 7, record),
        Frame(FrameKind.STOP, "inc-a", reason="the run was interrupted"),
        Frame(FrameKind.HELLO, "inc-b"),
    ):
        data = encode_frame(frame)
        (length,) = struct.unpack(">I", data[:4])
        assert length == len(data) - 4
        assert decode_frame(data[4:]) == frame
    for garbage in (b"not json", b'{"kind": "epoch"}', b'{"kind": "news", "incarnation": "a"}',
                    b'{"kind": "epoch", "incarnation": "a", "epoch": 8, "record": {"epoch": 7}}'):  # fmt: skip
        with pytest.raises(ValueError):
            decode_frame(garbage)


def test_the_relay_passes_on_each_epoch_and_the_stop_of_the_coordinator_it_follows(tmp_path: Path) -> None:
    """Workers connected before and after an epoch get it (a late one gets the newest first), in order, with the
    record the coordinator published; a worker of another coordinator is told the relay is not its own; the
    relay's end tells every worker to watch the store."""
    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        store = connect_store(coordinator.address, token=token)
        relay = NewsRelay(op_timeout_s=2.0)
        try:
            relay.follow(coordinator.address, token)
            early = _subscribe(relay, coordinator.incarnation)
            coordinator.publish((0, 1), "start")
            first = early.next()
            assert (first.kind, first.epoch) == (FrameKind.EPOCH, coordinator.epoch)
            assert first.record == read_json(store, keys.epoch(coordinator.epoch))
            late = _subscribe(relay, coordinator.incarnation)
            assert late.next() == first  # the newest epoch, at once
            coordinator.publish((0,), "worker 1 died")
            for worker in (early, late):
                frame = worker.next()
                assert (frame.epoch, frame.record["members"]) == (coordinator.epoch, [0])  # type: ignore[index]
            coordinator.stop("enough")
            assert [w.next() for w in (early, late)] == [
                Frame(FrameKind.STOP, coordinator.incarnation, reason="enough")
            ] * 2
            stranger = _subscribe(relay, "another coordinator's")
            with pytest.raises(RelayGone, match="follows coordinator"):
                stranger.next()
            relay.close()
            for worker in (early, late):
                with pytest.raises(RelayGone, match="closed"):
                    worker.next()
            assert not os.path.exists(relay.path)
        finally:
            relay.close()


def test_a_relay_that_loses_its_coordinator_drops_its_workers(tmp_path: Path) -> None:
    """A relay whose coordinator's store fails drops its workers (and turns new ones away) instead of leaving them
    on news that no longer comes."""
    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        relay = NewsRelay(op_timeout_s=1.0)
        try:
            relay.follow(coordinator.address, token)
            worker = _subscribe(relay, coordinator.incarnation)
            coordinator.publish((0,), "start")
            assert worker.next().kind is FrameKind.EPOCH
            coordinator.gateway.close()  # the coordinator's port answers no more
            with pytest.raises(RelayGone):
                worker.next()
            wait_for(lambda: not relay.following, 60, "the relay giving up its coordinator")
            with pytest.raises(RelayGone, match="closed"):
                RelayedNews(relay.path, coordinator.incarnation).next()
        finally:
            relay.close()


def _subscribe(relay: NewsRelay, incarnation: str) -> RelayedNews:
    """A worker's connection, once the relay follows its coordinator (until then it turns workers away)."""
    wait_for(lambda: relay.following, 60, "the relay following the coordinator")
    return RelayedNews(relay.path, incarnation)


@contextlib.contextmanager
def _coordinator(tmp_path: Path, workers: int) -> Iterator[tuple[str, str]]:
    """A real coordinator (a child process) for ``workers`` workers: its address and the job's token."""
    from unbroken.control.coordinator.loop import spawn_coordinator
    from unbroken.core.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    dump_config(load_config(TINY), run)
    token = new_token()
    sock = bind_listen_socket("127.0.0.1", 0)
    proc, address = spawn_coordinator(sock, run, workers, False, {**os.environ, "UNBROKEN_TOKEN": token})
    sock.close()
    try:
        yield address, token
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_workers_take_their_news_from_the_relay_and_from_the_store_once_it_is_gone(tmp_path: Path) -> None:
    """Two workers' clients of a real coordinator with a relay: a death's epoch reaches the survivor through the
    relay; with the relay closed, the survivor watches the store and still sees the stop."""
    with _coordinator(tmp_path, 2) as (address, token):
        relay = NewsRelay(op_timeout_s=2.0)
        relay.follow(address, token)
        clients: list[CoordinatorClient] = []
        try:
            clients = [CoordinatorClient(address, w, token=token, news_relay=relay.path) for w in (0, 1)]
            wait_for(lambda: all(c.latest_epoch >= 1 for c in clients), 60, "the first epoch")
            wait_for(lambda: all(c.relayed for c in clients), 60, "both clients on the relay")
            survivor = clients[0]
            store = connect_store(address, token=token)
            report_death(store, 1, "killed by SIGKILL")
            wait_for(lambda: survivor.news.seen_members == frozenset({0}), 60, "the epoch without worker 1")
            assert survivor.relayed  # it came through the relay, which is still its watcher's
            assert survivor.removed_since(1, (1,))
            relay.close()
            wait_for(lambda: not survivor.relayed, 60, "the survivor leaving the closed relay")
            request_stop(store, "enough")
            wait_for(lambda: survivor.stopped == "enough", 60, "the stop, from the store")
        finally:
            for client in clients:
                client.close()
            relay.close()


def test_a_worker_whose_relay_is_silent_takes_the_news_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay that accepted its workers and then says nothing (its agent stopped with SIGSTOP: the kernel
    still accepts connections for it) must not leave them without news: after ``NEWS_WAIT_S`` without a frame a
    worker looks at the store, and finding news the relay did not pass on, watches the store from then on. Here
    the first epoch, then a death's, reach both workers that way."""
    from unbroken.control.member import watch as watch_module

    monkeypatch.setattr(watch_module, "NEWS_WAIT_S", 1.0)
    path = str(tmp_path / "stopped-agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent, _coordinator(tmp_path, 2) as (address, token):
        silent.bind(path)
        silent.listen(16)  # never accepted, never answered
        clients = [CoordinatorClient(address, w, token=token, news_relay=path) for w in (0, 1)]
        try:
            wait_for(lambda: all(c.latest_epoch >= 1 for c in clients), 60, "the first epoch, from the store")
            report_death(connect_store(address, token=token), 1, "killed by SIGKILL")
            wait_for(lambda: clients[0].news.seen_members == frozenset({0}), 60, "the epoch without worker 1")
            assert not clients[0].relayed
        finally:
            for client in clients:
                client.close()


def test_a_worker_gives_a_relay_a_moment_behind_the_store_its_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay watches the store as its workers would, so a worker's quiet look can find news that the relay
    has yet to pass on (at 1,024 members a worker that had connected ``NEWS_WAIT_S`` before the first epoch looked
    while its relay was still sending it, and left the relay for good). Such news must be given the grace: here
    the relay passes the first epoch on only once worker 0 has looked and found it in the store; the worker takes
    it from the relay and stays on it (the next epoch comes that way too)."""
    from unbroken.control.member import watch as watch_module

    monkeypatch.setattr(watch_module, "NEWS_WAIT_S", 2.0)  # the quiet period, and the grace after it
    on_relay: list[CoordinatorClient] = []
    looked_ahead = threading.Event()  # worker 0's quiet look found the first epoch in the store
    real_look = watch_module.look

    def look(store: TCPStore) -> News:
        news = real_look(store)
        if news.newest >= 1 and on_relay and store is on_relay[0].connections.news_store:
            looked_ahead.set()
        return news

    monkeypatch.setattr(watch_module, "look", look)
    path = str(tmp_path / "late-agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late, _coordinator(tmp_path, 2) as (address, token):
        late.bind(path)
        late.listen(1)
        store = connect_store(address, token=token)
        incarnation = store.get(keys.INCARNATION).decode()
        on_relay.append(CoordinatorClient(address, 0, token=token, news_relay=path))
        clients = [*on_relay]
        try:
            conn, _ = late.accept()
            with conn:
                conn.sendall(encode_frame(Frame(FrameKind.HELLO, incarnation)))
                clients.append(CoordinatorClient(address, 1, token=token))  # the first epoch is published
                wait_for(lambda: store.check([keys.epoch(1)]), 60, "the first epoch")
                first = read_json(store, keys.epoch(1))
                frame = encode_frame(Frame(FrameKind.EPOCH, incarnation, 1, first))
                assert looked_ahead.wait(60), "worker 0's quiet look did not find the first epoch in the store"
                conn.sendall(frame)  # within the grace of the look that found it
                wait_for(lambda: clients[0].latest_epoch >= 1, 60, "the first epoch, from the relay")
                second = {**first, "epoch": 2, "reason": "a test's second epoch"}
                conn.sendall(encode_frame(Frame(FrameKind.EPOCH, incarnation, 2, second)))
                wait_for(lambda: clients[0].latest_epoch >= 2, 60, "the second epoch, from the relay alone")
                assert clients[0].relayed
        finally:
            for client in clients:
                client.close()
    assert "did not pass on" not in caplog.text


class _CountedStore:
    """A store whose calls over the network are counted (the timeout's setting is the client's own)."""

    def __init__(self, store: TCPStore) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        if name in {"get", "multi_get", "check", "wait", "add", "set"}:
            self.calls += 1
        return getattr(self.store, name)


def test_a_watcher_has_each_epoch_in_one_store_call_and_looks_after_a_stop_or_a_quiet_wait(tmp_path: Path) -> None:
    """``next_news`` against a real coordinator's store, through its gateway: an epoch's news is one call (a get
    that waits for the next ring and returns the published record), a stop's ring (it holds nothing) is followed
    by a look, and so is a wait that ends without news; the store's own timeout is left as it was."""
    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        store = _CountedStore(connect_store(coordinator.address, token=token))
        op_timeout = store.timeout
        news = look(store)
        assert (news.newest, news.record) == (0, None)
        got: list[News] = []
        watcher = threading.Thread(target=lambda: got.append(next_news(store, news, 60)))
        calls = store.calls
        watcher.start()
        coordinator.publish((0,), "start")
        watcher.join(timeout=60)
        (first,) = got
        assert store.calls == calls + 1
        assert (first.rung, first.newest) == (news.rung + 1, coordinator.epoch)
        assert first.record == read_json(store, keys.epoch(coordinator.epoch))
        coordinator.stop("enough")
        stopped = next_news(store, first, 60)
        assert (stopped.rung, stopped.newest, stopped.record) == (first.rung + 1, first.newest, None)
        quiet = next_news(store, stopped, 0.2)
        assert quiet == look(store) == stopped
        assert store.timeout == op_timeout
