"""A host's relay of the coordinator's news: one watcher of the epochs and the stop per host, not one per worker.

Every worker keeps a cached view of the membership epochs and of the stop flag (``control.member.watch``). Watched
directly, each epoch change costs the coordinator's gateway one store call per worker, and each worker a call
through its tunnel and the parse of the epoch's record, all at the same instant: at 1,024 members on two cores
half of them had the epoch 0.6 s after a death's report (docs/benchmarks.md, "control-scale"). With a relay,
the host's agent watches once (``NewsRelay``: the same watch of the store a worker keeps, ``next_news``) and pushes
each newest epoch's record, and a stop, to its workers over a Unix socket in a directory only its user can
enter; a worker (``RelayedNews``) reads them from there.

A worker never depends on the relay for correctness. A frame names the coordinator's incarnation, and a worker
takes news only from the coordinator it registered with; epochs the relay skipped (published in quick succession)
are read from the store by the worker, as its own watcher would. A worker whose relay closes its socket, sends what
it cannot read or follows another coordinator goes back to watching the store itself (``watch.NewsWatch``); so
does one whose relay has said nothing for ``NEWS_WAIT_S`` while the store holds news it has still not passed on
``RELAY_GRACE_S`` later (its agent stopped). A relay that loses its coordinator drops its workers the same way. The
relay sends nothing between news: a beat would wake every worker of the host at once for nothing (with 128 clients
in one process, as the control-scale bench runs them, such wakes starved their heartbeats).

Owns the frames' wire format: a 4-byte big-endian length, then a JSON object with ``kind`` (``FrameKind``) and
``incarnation``, and ``epoch`` and ``record`` (an epoch) or ``reason`` (a stop); and the store's news waits
(``look``, ``next_news``) that the relay and a worker's own watch share.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch.distributed import DistStoreError, TCPStore

from unbroken.control.store import keys
from unbroken.control.store.connect import open_store, read_json
from unbroken.control.store.gateway import Tunnel, TunnelError

log = logging.getLogger(__name__)

RELAY_ENV = "UNBROKEN_NEWS_RELAY"  # the path of this host's relay socket, set by the agent for its workers
NEWS_WAIT_S = 60.0  # a watch's store wait ends this often for a look anyway (c10d logs every wait that times out)
# A worker that finds news in the store its relay has not passed on gives the relay this long (at most a quiet
# period) before it watches the store itself: the relay is a watcher of the store too, and may be a moment behind.
RELAY_GRACE_S = 5.0
_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 << 20  # larger than any epoch record (0.7 MB at 100,000 members): anything longer is garbage


class FrameKind(Enum):
    """What a relay's frame carries."""

    EPOCH = "epoch"  # the newest epoch and its record
    STOP = "stop"  # the job is stopping, and why
    HELLO = "hello"  # nothing yet: sent to a worker that connects before the first epoch


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    incarnation: str  # the coordinator's, whose news this is
    epoch: int = 0
    record: dict[str, Any] | None = None
    reason: str = ""


def encode_frame(frame: Frame) -> bytes:
    body: dict[str, Any] = {"kind": frame.kind.value, "incarnation": frame.incarnation}
    if frame.kind is FrameKind.EPOCH:
        body |= {"epoch": frame.epoch, "record": frame.record}
    elif frame.kind is FrameKind.STOP:
        body["reason"] = frame.reason
    payload = json.dumps(body, separators=(",", ":")).encode()
    return _LENGTH.pack(len(payload)) + payload


def decode_frame(payload: bytes) -> Frame:
    """The frame of ``payload`` (the bytes after the length); ValueError if it is not one."""
    try:
        body = json.loads(payload)
        kind = FrameKind(body["kind"])
        incarnation = str(body["incarnation"])
        if kind is FrameKind.EPOCH:
            record = body["record"]
            if not isinstance(record, dict) or int(record["epoch"]) != int(body["epoch"]):
                raise ValueError("its record is not the epoch's")
            return Frame(kind, incarnation, int(body["epoch"]), record)
        if kind is FrameKind.STOP:
            return Frame(kind, incarnation, reason=str(body["reason"]))
        return Frame(kind, incarnation)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a news frame: {e}") from None


@dataclass(frozen=True)
class News:
    """What a watcher knows after one store call."""

    rung: int  # the last ring of the workers' doorbell it has had (a look: the doorbell's count)
    newest: int  # the newest epoch's number it has seen
    record: dict[str, Any] | None  # that epoch's record, when the ring had it (a look has none)


def look(store: TCPStore) -> News:
    """The doorbell's count and the newest epoch's number, in one store call. Both keys exist from the
    coordinator's start, before it admits anyone."""
    rung, newest = store.multi_get([keys.doorbell_seq(keys.NEWS), keys.EPOCH])
    return News(int(rung), int(newest), None)


def next_news(store: TCPStore, news: News, timeout_s: float, stopping: threading.Event | None = None) -> News:
    """The news after ``news`` once there is some, or a fresh ``look`` after ``timeout_s`` without any.

    One store call per epoch change: a get of the next ring's key waits for it (the store wakes the caller, no
    polling) and returns what the ring holds, the epoch's record (each call is a round trip through the gateway
    for every watcher at every epoch change; a wait and then a read were two). A stop's ring holds nothing and
    is followed by a look. A ring whose key never came (its ringer died between its two calls) holds a watcher
    for one wait at most: the look after it reads the count afresh.

    Once ``stopping`` is set, ``news`` itself as soon as the get returns, and no other call: a watcher whose
    owner closes has its get ended by the connection's end (``connect.end_get``), after which a call would fail
    (and c10d write its C++ stack on stderr)."""
    ring = news.rung + 1
    op_timeout = store.timeout
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    try:
        held: bytes | None = store.get(keys.doorbell(keys.NEWS, ring))
    except DistStoreError as e:
        if "timeout" not in str(e).lower():
            raise
        held = None
    finally:
        store.set_timeout(op_timeout)
    if stopping is not None and stopping.is_set():
        return news
    if not held:
        return look(store)
    record = json.loads(held)
    return News(ring, int(record["epoch"]), record)


class RelayGone(Exception):
    """The relay cannot be listened to any more (the reason says why): watch the store instead. ``closed``: the
    relay ended the connection (its agent closing, or following another coordinator), as it may."""

    def __init__(self, reason: str, closed: bool = False) -> None:
        super().__init__(reason)
        self.closed = closed


class RelayQuiet(Exception):
    """The relay has said nothing for the reader's ``quiet_s``: time to check it has missed nothing."""


class RelayedNews:
    """A worker's end of its host's relay: ``next()`` is the next epoch or stop frame of ``incarnation``."""

    def __init__(self, path: str, incarnation: str, quiet_s: float = NEWS_WAIT_S) -> None:
        self.incarnation = incarnation
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(quiet_s)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise
        self._buffer = b""

    def set_quiet(self, quiet_s: float) -> None:
        """From now on, ``next()`` raises RelayQuiet after ``quiet_s`` without a frame."""
        self._sock.settimeout(quiet_s)

    def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            try:
                chunk = self._sock.recv(max(65536, n - len(self._buffer)))
            except TimeoutError:
                raise RelayQuiet() from None
            except OSError as e:
                raise RelayGone(f"the relay's socket failed ({e})") from None
            if not chunk:
                raise RelayGone("the relay closed its socket", closed=True)
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def next(self) -> Frame:
        """The next frame that carries news; RelayQuiet after ``quiet_s`` without one (call again to go on
        waiting), RelayGone when there is none to be had."""
        while True:
            (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
            if length > MAX_FRAME:
                raise RelayGone(f"the relay sent a frame of {length} bytes")
            try:
                frame = decode_frame(self._read(length))
            except ValueError as e:
                raise RelayGone(str(e)) from None
            if frame.incarnation != self.incarnation:
                raise RelayGone(f"the relay follows coordinator {frame.incarnation}, not {self.incarnation}")
            if frame.kind is not FrameKind.HELLO:
                return frame

    def close(self) -> None:
        """End the connection; a ``next()`` blocked in another thread raises RelayGone."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class NewsRelay:
    """The relay of one host: ``follow(address, token)`` each time the agent reaches a coordinator; its workers
    connect to ``path`` (``RELAY_ENV``). Threads: one accepting workers, one watching the current coordinator."""

    def __init__(self, op_timeout_s: float) -> None:
        self.op_timeout_s = op_timeout_s
        self._dir = tempfile.mkdtemp(prefix="unbroken-news-")  # mode 0700: only this user's processes connect
        self.path = os.path.join(self._dir, "news.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1024)
        self._lock = threading.Lock()
        self._subscribers: list[socket.socket] = []
        self._incarnation: str | None = None  # the coordinator followed (None: none, workers are turned away)
        self._latest: dict[FrameKind, bytes] = {}  # sent first to a worker that connects: the newest epoch, a stop
        self._generation = 0  # coordinators followed so far: a watcher of an older one publishes nothing
        self._tunnel: Tunnel | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="news-relay-accept", daemon=True).start()

    def follow(self, address: str, token: str) -> None:
        """Relay the news of the coordinator at ``address`` from now on (the workers of the previous one are
        dropped: they watch the store until they connect again)."""
        generation = self._let_go()
        threading.Thread(
            target=self._watch, args=(address, token, generation), name=f"news-relay-{generation}", daemon=True
        ).start()

    @property
    def following(self) -> bool:
        """Whether it follows a coordinator now (else it turns workers away, and they watch the store)."""
        return self._incarnation is not None

    def close(self) -> None:
        """Stop relaying: the workers go back to the store; the socket and its directory are removed."""
        self._closed.set()
        self._let_go()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- threads ----------------------------------------------------------------------------------------
    def _watch(self, address: str, token: str, generation: int) -> None:
        try:
            store, tunnel = open_store(address, token=token)
        except (TunnelError, RuntimeError, OSError) as e:
            log.warning(
                "news relay: cannot reach the coordinator at %s (%s); the workers watch it themselves", address, e
            )
            return
        try:
            store.set_timeout(datetime.timedelta(seconds=self.op_timeout_s))
            incarnation = store.get(keys.INCARNATION).decode()
            with self._lock:
                if generation != self._generation:
                    return
                self._incarnation, self._tunnel, self._latest = incarnation, tunnel, {}
            log.info("news relay at %s: following coordinator %s (%s)", self.path, incarnation, address)
            self._relay(store, incarnation, generation)
        except RuntimeError as e:
            if generation == self._generation and not self._closed.is_set():
                log.warning("news relay: the coordinator's store failed (%s); the workers watch it themselves", e)
        finally:
            with self._lock:
                if generation == self._generation:
                    self._incarnation, self._tunnel = None, None
                    self._drop_all()
            tunnel.close()

    def _relay(self, store: TCPStore, incarnation: str, generation: int) -> None:
        """Watch as a worker's own watcher would (``watch.NewsWatch.run``) and pass on each newest epoch
        and the stop."""
        news = look(store)
        sent, stopped = 0, False
        while generation == self._generation:
            frames: list[Frame] = []
            if news.newest > sent:
                record = news.record if news.record is not None else read_json(store, keys.epoch(news.newest))
                frames.append(Frame(FrameKind.EPOCH, incarnation, news.newest, record))
                sent = news.newest
            if not stopped and news.record is None and store.check([keys.STOP]):
                frames.append(Frame(FrameKind.STOP, incarnation, reason=store.get(keys.STOP).decode()))
                stopped = True
            if frames:
                self._publish(generation, frames)
            news = next_news(store, news, NEWS_WAIT_S)

    def _publish(self, generation: int, frames: list[Frame]) -> None:
        with self._lock:
            if generation != self._generation:
                return
            encoded = [encode_frame(f) for f in frames]
            for frame, data in zip(frames, encoded, strict=True):
                self._latest[frame.kind] = data
            self._send_all(b"".join(encoded))

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._incarnation is None:
                    conn.close()  # following no coordinator: the worker watches the store itself
                    continue
                conn.setblocking(False)
                first = b"".join(self._latest[k] for k in (FrameKind.EPOCH, FrameKind.STOP) if k in self._latest)
                if self._send(conn, first or encode_frame(Frame(FrameKind.HELLO, self._incarnation))):
                    self._subscribers.append(conn)

    # -- under the lock ---------------------------------------------------------------------------------
    def _send_all(self, data: bytes) -> None:
        self._subscribers = [conn for conn in self._subscribers if self._send(conn, data)]

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> bool:
        """Send ``data`` whole without waiting; False (and the connection closed) where it cannot be: a worker
        that does not read (stopped, or gone) is dropped, never waited for, and watches the store itself once it
        reads the end of what it was sent."""
        try:
            if conn.send(data) == len(data):
                return True
        except OSError:
            pass
        conn.close()
        return False

    def _let_go(self) -> int:
        """Stop relaying the coordinator followed (its workers dropped, its watcher's wait cut); the new
        generation."""
        with self._lock:
            self._generation += 1
            self._drop_all()
            if self._tunnel is not None:
                self._tunnel.cut()
            return self._generation

    def _drop_all(self) -> None:
        for conn in self._subscribers:
            conn.close()
        self._subscribers = []
        self._latest = {}
