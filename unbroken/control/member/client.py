"""A worker's client of the coordinator: registration, heartbeats, the epoch watch, metrics delivery, and
holding on when the coordinator dies.

The one way a worker reaches the control plane: ``CoordinatorClient`` registers, keeps a cached view of the
membership epochs and of the stop flag (a watcher thread sleeping on the workers' doorbell, or reading its
host's news relay: ``control.newsrelay``), sends heartbeats and queued metrics records from its own thread,
and tells a cut connection from a dead coordinator.

A dead coordinator does not stop the worker. Its gloo groups do not need the coordinator, so training goes
on while the client looks for a coordinator again (the same address, restarted by its launcher, or a
standby's from the list in ``UNBROKEN_COORDINATOR``) for up to ``hold_s``. A new coordinator (another
*incarnation*) is re-registered with under the same worker id, the watchers move to it, the records it may
not have are sent again (it drops duplicates), and training-thread store calls made meanwhile wait for it
and are retried. Only when no coordinator comes back in time is the worker ``lost``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.member.hostbeat import WorkerBeat
from unbroken.control.member.news import (
    NEWS_WAIT_S,
    RELAY_ENV,
    RELAY_GRACE_S,
    FrameKind,
    RelayedNews,
    RelayGone,
    RelayQuiet,
    look,
    next_news,
)
from unbroken.control.store import keys
from unbroken.control.store.connect import (
    STORE_TIMEOUT_S,
    connect_store,
    end_wait,
    open_store,
    publish_record,
    reach,
    read_json,
    report_error,
    report_timeout,
    request_stop,
    ring,
)
from unbroken.control.store.gateway import NothingListens, Tunnel, TunnelError, require_token
from unbroken.core.records import WorkerError

log = logging.getLogger(__name__)

RECENT_RECORDS = 256  # records kept to send again to a coordinator that replaced a dead one
RECONNECT_POLL_S = 0.1
REFUSAL_CHECK_S = 0.1  # how often a worker waiting for its first epoch looks whether it was refused
LEFT_CHECK_S = 0.05  # how often a member blocked in a superseded group's collective looks for members that left
STALL_DUMP_SHARE = 0.75  # a heartbeat this late (share of the timeout) logs every thread's stack
STALL_HEADER = "heartbeat late by {late:.2f} s; every thread's stack, most recent call first:"
# A process logs every thread's stack at most this often, whatever the clients in it: the stacks are every
# thread's already, and reading them holds the GIL (with 128 clients in one process, as a control-scale crowd
# runs them, each late beat's dump of 600 threads made the next beats later still, until the crowd seized up).
STALL_DUMP_EVERY_S = 10.0

# The environment that tells a worker process where its job is (a launcher, the per-host agent, or a user
# under torchrun/srun sets it; unbroken.ft reads it), besides the job's token (gateway.TOKEN_ENV).
COORDINATOR_ENV = "UNBROKEN_COORDINATOR"  # HOST:PORT of the coordinator (a comma-separated list: standbys)
WORKER_ID_ENV = "UNBROKEN_WORKER_ID"  # this worker's id (else RANK or SLURM_PROCID; else the coordinator picks)
LOCAL_WORKERS_ENV = "UNBROKEN_LOCAL_WORKERS"  # workers on this host (to size each one's threads)
SPARE_ENV = "UNBROKEN_SPARE"  # a warm spare's index: it waits, initialised, for the id of a dead worker to replace
DEVICE_INDEX_ENV = "UNBROKEN_DEVICE_INDEX"  # a warm spare's device on its host (the workers' come from their ids)
RUN_DIR_ENV = "UNBROKEN_RUN_DIR"  # where this worker writes checkpoints (default: the coordinator's run dir)
# With a failure schedule: a pipe's write end (its descriptor number) on which the worker wakes its agent once it
# has reached an injection point (ft.inject), so the agent waits instead of polling the store for it.
INJECT_FD_ENV = "UNBROKEN_INJECT_FD"
# Set by the agent that starts the process: when it asked for it (time.time()), and "1" if a zygote forked it
# (control.zygote). The registration reports how long the start took, in wall time and in the process's CPU.
STARTED_AT_ENV = "UNBROKEN_STARTED_AT"
FORKED_ENV = "UNBROKEN_FORKED"


def start_cost() -> dict[str, Any]:
    """What this process's start cost until now: ``start_s``, the wall time since its agent asked for it (None if
    no agent said when), ``start_cpu_s``, the CPU this process used (a forked process starts from zero), and
    ``forked``."""
    asked = os.environ.get(STARTED_AT_ENV)
    try:
        start_s: float | None = round(time.time() - float(asked), 4) if asked else None
    except ValueError:
        start_s = None
    return {
        "start_s": start_s,
        "start_cpu_s": round(time.process_time(), 4),
        "forked": os.environ.get(FORKED_ENV) == "1",
    }


class Refused(Exception):
    """The coordinator keeps this worker out of the membership; the message is the one line saying why."""


@dataclass
class Epoch:
    epoch: int
    members: tuple[int, ...]
    reason: str
    reform: bool = False  # every member of the previous epoch must abandon its group (a collective stalled)
    workload: str = ""  # the workload policy from this epoch on, when not the config's (recovery.slow = rebalance)


class _RateLimit:
    """``due()`` is True at most once every ``every_s``, across the threads of the process."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: float | None = None

    def due(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last < self.every_s:
                return False
            self._last = now
            return True


_STALL_DUMPS = _RateLimit(STALL_DUMP_EVERY_S)


def thread_stacks() -> str:
    """Every thread's Python stack, innermost call first (faulthandler's layout), read while holding the GIL.
    ``faulthandler``'s own dump reads other threads' frames without it, and a live worker crashed in one (SIGSEGV
    while its training thread ran; CPython issues 116008 and 131580)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        lines = [f"Thread {names.get(ident, hex(ident))} (most recent call first):"]
        lines += [
            f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in reversed(traceback.extract_stack(frame))
        ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def addresses_of(spec: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` -> the list (the leading coordinator and its standbys)."""
    out = [a.strip() for a in spec.split(",") if a.strip()]
    if not out:
        raise ValueError(f"no coordinator address in {spec!r}; expected HOST:PORT[,HOST:PORT...]")
    return out


class _HeldStore:
    """The client's store connection for the training thread: a call that fails while the client holds on
    (the coordinator is being replaced) waits for the new one and is made again there (every call the
    training thread makes is idempotent: get, set, check, delete, compare-and-set)."""

    def __init__(self, client: CoordinatorClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            generation = self._client._generation
            try:
                return getattr(self._client._store, name)(*args, **kwargs)
            except RuntimeError:
                if not self._client._await_reconnect(generation):
                    raise
                return getattr(self._client._store, name)(*args, **kwargs)

        return call


class CoordinatorClient:
    """A worker's view of the coordinator: registration, heartbeats, the current epoch, metrics.

    When the connection fails, the client finds out why (``lost``): ``"cut"`` if the coordinator that
    admitted this worker still answers (only this worker's connection was cut: it leaves, the job goes on);
    if it does not, the client holds on for ``hold_s`` while a coordinator comes back, and is ``lost =
    "coordinator"`` only if none does. ``news_relay``: the socket of this host's news relay (default: from
    ``UNBROKEN_NEWS_RELAY``, which the agent sets; none: the client watches the coordinator itself).
    ``host_beat``: this process's slot on its host's beat board (default: from ``UNBROKEN_HOST_BEAT``, which an
    agent sets under ``comm.heartbeats = "host"``; none: the client sends its heartbeats itself). ``spare``: the
    index of the warm spare this process was, promoted to ``worker_id`` (its registration says so, and the
    coordinator admits it without the joiners' last call).
    """

    def __init__(
        self,
        address: str,
        worker_id: int | None,
        heartbeat_interval_s: float = 0.25,
        heartbeat_timeout_s: float = 2.0,
        token: str | None = None,
        hold_s: float = 60.0,
        fingerprint: dict[str, str] | None = None,
        news_relay: str | None = None,
        host_beat: WorkerBeat | None = None,
        spare: int | None = None,
    ) -> None:
        self.addresses = addresses_of(address)
        self.fingerprint = dict(fingerprint or {})  # what decides this worker's bits (core.numerics)
        self.token = token or require_token()
        self.hold_s = hold_s
        self.lost: str | None = None
        self.stopped: str | None = None
        self.holding = False
        self._lost_event = threading.Event()
        self._reconnected = threading.Condition()
        self._generation = 0  # connections made so far (a new coordinator makes a new generation)
        self._probe_timeout_s = max(1.0, heartbeat_timeout_s)
        self._op_timeout = datetime.timedelta(seconds=max(1.0, heartbeat_timeout_s))
        self._hb_interval = heartbeat_interval_s
        self._stall_dump_s = STALL_DUMP_SHARE * heartbeat_timeout_s
        self._hb_timeout_s = heartbeat_timeout_s
        self._beat_since: float | None = None  # when the heartbeat under way was sent (None: none is)
        self._beat_done = time.monotonic()  # when the last heartbeat was answered (or the sender started)
        self._stall_logged = 0.0  # the ``_beat_done`` whose lateness was logged (once per late beat)
        self._news_wait_s = NEWS_WAIT_S
        self._relay_path = news_relay if news_relay is not None else os.environ.get(RELAY_ENV) or None
        self._host_beat = host_beat if host_beat is not None else WorkerBeat.from_env()
        self.spare = spare
        self._relay: RelayedNews | None = None  # the news watcher's connection to its host's relay, while it has one
        self._watch_stop = threading.Event()
        self._diagnosing = threading.Lock()
        self._diagnosis: threading.Thread | None = None
        self._outbox: queue.SimpleQueue[dict[str, Any] | threading.Event | None] = queue.SimpleQueue()
        self._in_hand: dict[str, Any] | None = None  # the record the sender was publishing when it failed
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RECORDS)
        self._left_checked_at = 0.0
        self._left = False
        self._spare_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-spare")
        # Epochs that removed workers, as (epoch, removed ids), kept by the watcher: a collective is abandoned
        # only when one of its members was removed (or, for a re-formation after a stalled collective, every
        # member counts as removed from the old group). A join alone never interrupts one (every member is
        # alive, so it completes), which keeps all members' collective sequences matched.
        self.removals: list[tuple[int, frozenset[int]]] = []
        # Called by the watcher with (epoch, members) of each newest epoch it reads (the step protocol forms
        # the epoch's group ahead of need): must be quick and must not raise.
        self.on_epoch: Callable[[int, tuple[int, ...]], None] | None = None
        self.excluded = False  # an epoch removed this worker after it had been a member
        self._connection_lock = threading.Lock()  # new_connection is called from the training and former threads
        self.address = self.addresses[0]
        self.store: Any = _HeldStore(self)
        self._store = self._first_connection()
        self._connect_watchers()
        self.worker_id, self.late = self._register(worker_id, returning=False)
        self.incarnation = self._store.get(keys.INCARNATION).decode()
        self.latest_epoch = int(self._store.get(keys.EPOCH))
        self._seen_epoch = self.latest_epoch
        self._seen_members = frozenset(self.epoch_record(self._seen_epoch).members) if self._seen_epoch else frozenset()
        self._start_watchers()

    # -- connections --------------------------------------------------------------------------------
    def _first_connection(self) -> TCPStore:
        """The first coordinator of the list that answers; one the network does not reach is tried again for
        up to ``hold_s`` (a worker restarted while its host's link flaps), one where nothing listens is not."""
        store, self._store_tunnel, self.address = reach(self.addresses, self.token, self.hold_s)
        return store

    def _register(self, worker_id: int | None, returning: bool) -> tuple[int, bool]:
        """Ask the coordinator for admission; (the admitted id, whether this worker joins a running job)."""
        store = self._store
        seq = store.add(keys.REGISTER_SEQ, 1)
        request = {
            "worker_id": -1 if worker_id is None else worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "returning": returning,  # a member of the job whose coordinator was replaced: it holds the state
            "fingerprint": self.fingerprint,
            **({} if returning else start_cost()),
            **({} if self.spare is None else {"spare": self.spare}),  # a promoted spare: no last call
        }
        store.set(keys.register(seq), json.dumps(request))
        ring(store)
        store.wait([keys.register_id(seq)], datetime.timedelta(seconds=STORE_TIMEOUT_S))
        worker_id = int(store.get(keys.register_id(seq)))
        if store.check([keys.refused(worker_id)]):
            raise Refused(store.get(keys.refused(worker_id)).decode())
        return worker_id, store.get(keys.register_late(seq)) == b"1"

    def _connect_watchers(self) -> None:
        """The watchers' connections, each its own (a TCPStore client is one socket, one call at a time),
        opened before registering: the coordinator counts a worker's silence from its admission, and opening a
        connection alone can take seconds (see new_connection; 64 workers joining at once on 2 cores: 42 of
        them were declared dead before their first heartbeat). Connected with the long timeout, then their waits
        time out within the heartbeat bound. A call already sent to a host the network no longer reaches is
        not bounded by it (it waits for TCP to give up): ``_watch_stalls`` covers that case."""
        self._sender_store, self._sender_tunnel = open_store(self.address, token=self.token)
        self._sender_store.set_timeout(self._op_timeout)
        self._news_store, self._news_tunnel = open_store(self.address, token=self.token)
        self._news_store.set_timeout(self._op_timeout)
        with self._connection_lock:
            self._spare = self._spare_pool.submit(connect_store, self.address, STORE_TIMEOUT_S, self.token)

    def _start_watchers(self) -> None:
        """Two watcher threads on the connections ``_connect_watchers`` opened: the sender sends a heartbeat
        every interval and the metrics records queued by the training thread, the news watcher sleeps in a
        store wait on the workers' doorbell."""
        generation = self._generation
        self._beat_done = time.monotonic()  # the sender beats at once: a late beat is counted from here
        self._watch_threads = [
            threading.Thread(target=self._send, args=(generation,), name="heartbeat+metrics", daemon=True),
            threading.Thread(target=self._watch_news, args=(generation,), name="epoch-watch", daemon=True),
            threading.Thread(target=self._watch_stalls, args=(generation,), name="stall-watch", daemon=True),
        ]
        for thread in self._watch_threads:
            thread.start()

    def _send(self, generation: int) -> None:
        """A heartbeat every interval (one ``add``, or a count on the host's beat board that its agent passes on,
        and the ``add`` too until the agent has passed one of this worker's beats on and while it is behind), and
        between them the queued metrics records in order, so the training thread never waits on the store to
        publish. Ends at the ``None`` that ``close`` queues, after everything queued before it."""
        store, key = self._sender_store, keys.heartbeat(self.worker_id)
        host_beat = self._host_beat
        if host_beat is not None:
            host_beat.claim(self.worker_id)
        next_beat = time.monotonic()
        first_counted: float | None = None  # host heartbeats: when this worker's first count was on the board
        while True:
            try:
                if time.monotonic() >= next_beat:
                    if host_beat is not None:
                        host_beat.beat()
                        first_counted = first_counted or time.monotonic()
                    if (
                        host_beat is None
                        or first_counted is None
                        or not host_beat.passed_since(first_counted)
                        or host_beat.agent_behind(self._hb_interval)
                    ):
                        self._beat_since = time.monotonic()
                        store.add(key, 1)
                        self._beat_since = None
                    self._beat_done = time.monotonic()
                    next_beat = self._beat_done + self._hb_interval
                if self._in_hand is None:
                    try:
                        item = self._outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
                    except queue.Empty:
                        continue
                    if item is None:
                        return
                    if isinstance(item, threading.Event):
                        item.set()  # a flush: everything queued before it is in the store
                        continue
                    self._in_hand = item
                publish_record(store, self._in_hand)
                self._recent.append(self._in_hand)
                self._in_hand = None
            except RuntimeError:
                self._connection_failed(generation)
                return

    def _watch_news(self, generation: int) -> None:
        """A cached view of the epoch and the stop flag, so waits never touch the network.

        From this host's news relay where the agent runs one (``control.newsrelay``: one watcher of the
        coordinator per host), else, or once the relay is gone, from the store: a get of the next ``news/<n>``
        (it waits for the key, ``newsrelay.next_news``), rung by the coordinator right after it publishes an epoch
        or a stop, so either is seen as soon as it is published; the wait also ends every ``NEWS_WAIT_S`` for a
        look anyway (rarely: c10d logs a line for every store wait that times out, and a dead coordinator ends the
        wait at once, a hung one is found by the heartbeat sender). The epoch and the stop are read after the
        doorbell's count (or the ring) they follow, and the coordinator writes them before ringing: nothing
        published is missed.
        """
        store = self._news_store
        try:
            if self._relay_path is not None and self._watch_relay(store, self._relay_path):
                return
            news = look(store)
            while not self._watch_stop.is_set():
                if news.newest > self._seen_epoch:
                    self._advance(store, news.newest, news.record)
                if self.stopped is None and news.record is None and store.check([keys.STOP]):
                    self.stopped = store.get(keys.STOP).decode()
                news = next_news(store, news, self._news_wait_s)
        except RuntimeError:
            self._connection_failed(generation)

    def _watch_relay(self, store: TCPStore, path: str) -> bool:
        """The news from this host's relay until it is gone: True if the watch is over (the client closes),
        False to watch the store instead. Epochs the relay skipped are read from ``store`` (``_advance``)."""
        try:
            relay = RelayedNews(path, self.incarnation, self._news_wait_s)
        except OSError as e:
            log.info("no news relay at %s (%s); watching the coordinator", path, e)
            return False
        self._relay = relay
        log.info("epoch news from this host's relay at %s", path)
        grace_s = min(RELAY_GRACE_S, self._news_wait_s)
        behind = False  # the last quiet look found news in the store that the relay had not passed on
        try:
            while not self._watch_stop.is_set():
                try:
                    frame = relay.next()
                except RelayQuiet:
                    ahead = self._store_ahead_of_relay(store)
                    if ahead and behind:  # still not passed on after the grace: the relay missed it
                        self._relay_missed_news(store)
                        return False
                    behind = ahead
                    relay.set_quiet(grace_s if behind else self._news_wait_s)
                    continue
                if behind:
                    behind = False
                    relay.set_quiet(self._news_wait_s)
                if frame.kind is FrameKind.EPOCH and frame.epoch > self._seen_epoch:
                    self._advance(store, frame.epoch, frame.record)
                elif frame.kind is FrameKind.STOP and self.stopped is None:
                    self.stopped = frame.reason
        except RelayGone as e:
            if not self._watch_stop.is_set():
                log.log(logging.INFO if e.closed else logging.WARNING, "news relay: %s; watching the coordinator", e)
        finally:
            self._relay = None
            relay.close()
        return self._watch_stop.is_set()

    def _store_ahead_of_relay(self, store: TCPStore) -> bool:
        """After a quiet period without news from the relay, the look a watcher of the store makes as often:
        whether the store holds an epoch or a stop this worker has not had."""
        return look(store).newest > self._seen_epoch or (self.stopped is None and store.check([keys.STOP]))

    def _relay_missed_news(self, store: TCPStore) -> None:
        """Take from the store the news the relay did not pass on (``_store_ahead_of_relay`` twice, a grace apart)."""
        log.warning("news relay: it did not pass on the store's news; watching the coordinator")
        news = look(store)
        if news.newest > self._seen_epoch:
            self._advance(store, news.newest)
        if self.stopped is None and store.check([keys.STOP]):
            self.stopped = store.get(keys.STOP).decode()

    def _advance(self, store: TCPStore, newest: int, known: dict[str, Any] | None = None) -> None:
        """Read the epochs after the last one seen up to ``newest`` (``known``: the newest one's record, from
        its ring): note the removals, then the epoch; then tell ``on_epoch`` of the newest one read."""
        read: tuple[int, tuple[int, ...]] | None = None
        for epoch in range(self._seen_epoch + 1, newest + 1):
            # The newest is there (its record is written before the epoch number): one call less per member
            # and epoch change. An older one may have been published by a coordinator that died before this
            # one (a restart skips it).
            if epoch < newest and not store.check([keys.epoch(epoch)]):
                continue
            record = known if epoch == newest and known is not None else read_json(store, keys.epoch(epoch))
            members = frozenset(record["members"])
            removed = self._seen_members if record.get("reform") else self._seen_members - members
            if removed:
                self.removals.append((epoch, removed))
            if self.worker_id in self._seen_members and self.worker_id not in members:
                self.excluded = True
            self._seen_epoch, self._seen_members = epoch, members
            read = (epoch, tuple(sorted(members)))
        self._seen_epoch = max(self._seen_epoch, newest)
        self.latest_epoch = max(self.latest_epoch, newest)  # after the removals: readers check both
        if read is not None and read[0] == self.latest_epoch and self.on_epoch is not None:
            self.on_epoch(*read)

    def removed_since(self, epoch: int, members: tuple[int, ...]) -> bool:
        """True if an epoch newer than ``epoch`` removed one of ``members`` (cheap: the watcher's cache)."""
        return any(e > epoch and not removed.isdisjoint(members) for e, removed in self.removals)

    # -- a failed connection -------------------------------------------------------------------------
    def _connection_failed(self, generation: int | None = None) -> None:
        """A watcher's store call failed: find out why, once per connection (unless the client is closing)."""
        if generation is not None and generation != self._generation:
            return  # a watcher of a connection already replaced
        if self._watch_stop.is_set() or not self._diagnosing.acquire(blocking=False):
            return
        self._diagnosis = threading.Thread(target=self._diagnose, name="coordinator-lost", daemon=True)
        self._diagnosis.start()

    def _probe(self) -> tuple[str, TCPStore, Tunnel] | None:
        """A fresh connection to the first coordinator that answers, its address and tunnel; None if none does."""
        for address in self.addresses:
            try:
                return address, *open_store(address, timeout_s=self._probe_timeout_s, token=self.token)
            except NothingListens:
                continue  # nothing on that port (dead, restarting, or a standby that does not lead)
            except (TunnelError, RuntimeError, OSError):
                continue
        return None

    def _diagnose(self) -> None:
        """Is it only our connection that was cut (the same coordinator answers: leave), or is the coordinator
        gone (hold on until one answers: a new incarnation is joined again; none within ``hold_s``: lost)?"""
        self.holding = True
        deadline = time.monotonic() + self.hold_s
        try:
            while not self._watch_stop.is_set():
                found = self._probe()
                if found is not None:
                    address, store, tunnel = found
                    try:
                        incarnation = store.get(keys.INCARNATION).decode()
                    except RuntimeError:
                        incarnation = ""
                    if incarnation == self.incarnation:
                        self._give_up("cut", "this worker's connection to the coordinator was cut")
                        return
                    if incarnation and self._rejoin(address, store, tunnel, incarnation):
                        return
                if time.monotonic() > deadline:
                    self._give_up(
                        "coordinator",
                        f"no coordinator at {','.join(self.addresses)} answered within {self.hold_s:.0f} s",
                    )
                    return
                time.sleep(RECONNECT_POLL_S)
        finally:
            self.holding = False

    def _rejoin(self, address: str, store: TCPStore, tunnel: Tunnel, incarnation: str) -> bool:
        """Re-register with a coordinator that replaced the dead one, under the same id; move the watchers."""
        log.warning("the coordinator was replaced (now at %s); registering again as worker %d", address, self.worker_id)
        old = self._watch_threads
        # The old connections' calls end now, whatever state their sockets are in: a coordinator whose host was
        # cut off answers nothing and resets nothing, and a call on it would wait for TCP to give up (minutes).
        for cut in (self._news_tunnel, self._sender_tunnel, self._store_tunnel):
            cut.cut()
        if (relay := self._relay) is not None:
            relay.close()  # the new watcher connects to it again, and takes only the new coordinator's news
        for thread in old[:2]:  # the sender and the news watcher (the stall watch ends at the new generation)
            thread.join(timeout=self._probe_timeout_s + 1.0)
        self._store, self._store_tunnel, self.address = store, tunnel, address
        try:
            self._connect_watchers()
            worker_id, _late = self._register(self.worker_id, returning=True)
            if worker_id != self.worker_id:
                self._give_up("cut", f"the new coordinator admitted this worker as {worker_id}, not {self.worker_id}")
                return True
            self.incarnation = incarnation
            for record in list(self._recent):  # what the dead coordinator may not have written (it drops duplicates)
                self._outbox.put(record)
            with self._reconnected:
                self._generation += 1
            self._start_watchers()
        except RuntimeError as e:
            log.warning("registering with the new coordinator failed (%s); trying again", e)
            return False
        with self._reconnected:
            self._diagnosing.release()
            self._reconnected.notify_all()
        return True

    def _watch_stalls(self, generation: int) -> None:
        """A heartbeat unanswered for the heartbeat timeout (or, under host heartbeats, its agent's calls failing
        for as long, ``control.hostbeat``): has another coordinator taken over (an etcd standby, the old leader's host
        cut off)? Then register with it. Otherwise nothing is done: the
        coordinator may be only slow or paused (it declares nobody dead then), and a worker whose own link is
        down is excluded by the coordinator and learns it when the link is back. Needed because a store call
        on a connection whose peer the network no longer reaches neither fails nor times out (TCPStore's
        timeout does not bound it): only the diagnosis of a failed call would otherwise find the successor.

        Also logs every thread's stack once the next heartbeat is late by most of the timeout (the sender
        starved of the GIL, or the store slow to answer): why a live worker was about to be declared dead."""
        while not self._watch_stop.wait(self._hb_interval) and generation == self._generation:
            done = self._beat_done
            late = time.monotonic() - done
            if late > self._stall_dump_s and self._stall_logged != done:
                self._stall_logged = done
                if _STALL_DUMPS.due():
                    log.warning("%s\n\n%s", STALL_HEADER.format(late=late), thread_stacks())
                else:
                    log.warning("heartbeat late by %.2f s (this process logged every thread's stack lately)", late)
            since = self._beat_since
            if self._host_beat is not None and (agent := self._host_beat.agent_call_since()) is not None:
                since = agent if since is None else min(since, agent)
            if since is None or time.monotonic() - since < self._hb_timeout_s or len(self.addresses) < 2:
                continue
            if self.lost is not None or self._diagnosing.locked():
                continue  # a diagnosis is under way (it finds a successor too)
            for address in self.addresses:
                try:
                    store, tunnel = open_store(address, timeout_s=self._probe_timeout_s, token=self.token)
                    incarnation = store.get(keys.INCARNATION).decode()
                except (TunnelError, RuntimeError, OSError):
                    continue
                if incarnation and incarnation != self.incarnation and self._diagnosing.acquire(blocking=False):
                    self.holding = True
                    try:
                        rejoined = self._rejoin(address, store, tunnel, incarnation)
                    finally:
                        self.holding = False
                    if not rejoined:  # its old connections are cut now: the diagnosis takes over from here
                        self._diagnosing.release()
                        self._connection_failed()
                    return
                tunnel.close()
                break  # the same coordinator answers (slow or paused, or this host's link came back): wait

    def _give_up(self, lost: str, reason: str) -> None:
        log.error("%s", reason)
        self.lost = lost
        self.stopped = self.stopped or reason
        self._lost_event.set()
        with self._reconnected:
            self._reconnected.notify_all()

    def _await_reconnect(self, generation: int) -> bool:
        """After a failed call on connection ``generation``: wait until a new one exists (True) or the client
        is lost (False)."""
        deadline = time.monotonic() + self.hold_s + STORE_TIMEOUT_S
        with self._reconnected:
            while self._generation == generation and self.lost is None and time.monotonic() < deadline:
                if not self.holding and not self._diagnosing.locked():
                    self._connection_failed()  # the training thread noticed first
                self._reconnected.wait(0.1)
            return self._generation != generation and self.lost is None

    def wait_lost(self, timeout_s: float) -> str | None:
        """After a store call failed: wait (bounded) for the verdict; None if the connection is fine again."""
        deadline = time.monotonic() + max(timeout_s, self.hold_s + 1.0)
        generation = self._generation
        while self.lost is None and self._generation == generation and time.monotonic() < deadline:
            if not self._diagnosing.locked():
                self._connection_failed()
            self._lost_event.wait(0.1)
        return self.lost

    def new_connection(self) -> TCPStore:
        """Another authenticated connection to the store, for a blocking user such as a group's rendezvous:
        a wait abandoned on it cannot hold up this client's own store calls, which share one socket.

        The connection was opened ahead on a background thread (and the next one is started now): torch
        formats a new socket's addresses with getnameinfo, a reverse DNS lookup that stalls for the
        resolver's timeout (5 s) where DNS is slow or unreachable, and recovery must not wait for that."""
        with self._connection_lock:
            spare = self._spare
            self._spare = self._spare_pool.submit(connect_store, self.address, STORE_TIMEOUT_S, self.token)
        try:
            return spare.result(timeout=STORE_TIMEOUT_S)
        except (RuntimeError, ConnectionError, concurrent.futures.TimeoutError):
            return connect_store(self.address, token=self.token)  # the spare failed: one more try, here

    # -- the job's keys -----------------------------------------------------------------------------
    def config_toml(self) -> str:
        return self.store.get(keys.CONFIG).decode()

    def run_dir(self) -> Path:
        return Path(self.store.get(keys.RUN_DIR).decode())

    def current_epoch(self) -> int:
        return int(self.store.get(keys.EPOCH))

    def epoch_record(self, epoch: int) -> Epoch:
        record = json.loads(self.store.get(keys.epoch(epoch)).decode())
        reform, workload = bool(record.get("reform")), str(record.get("workload", ""))
        return Epoch(record["epoch"], tuple(record["members"]), record["reason"], reform, workload)

    def stop_reason(self) -> str | None:
        if self.store.check([keys.STOP]):
            return self.store.get(keys.STOP).decode()
        return None

    def refusal(self) -> str | None:
        """Why the coordinator keeps this worker out of the membership (``Refused``), or None."""
        key = keys.refused(self.worker_id)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def done(self) -> bool:
        """Whether the run has finished (its leader said so)."""
        try:
            return bool(self._store.check([keys.DONE]))
        except RuntimeError:
            return False

    def mark_done(self) -> None:
        """The leader, after the final record: the run finished (the coordinator then ends)."""
        self.store.set(keys.DONE, "ok")
        ring(self.store)

    def stop_job(self, reason: str) -> bool:
        """Ask every process of the job to stop (a check that guards the training state failed); True if this
        call set the reason (the first of several members that saw the same thing)."""
        try:
            return request_stop(self._store, reason)
        except RuntimeError:
            return False  # the coordinator is gone: nobody left to tell

    def report_error(self, error: WorkerError) -> bool:
        """This worker is dying of an exception: tell the coordinator, on this worker's own connection and without
        waiting for a coordinator that replaces a dead one (the process ends next). False if nobody was told."""
        try:
            report_error(self._store, error)
            return True
        except RuntimeError:
            return False

    def named_to_save(self) -> bool:
        """The job stopped with a good state (a bug in the user's code) and the coordinator named this worker
        to save the state it holds (``keys.STOP_SAVER``)."""
        try:
            return self._store.check([keys.STOP_SAVER]) and int(self._store.get(keys.STOP_SAVER)) == self.worker_id
        except (RuntimeError, ValueError):
            return False

    def tell_saved(self, words: str) -> None:
        """The state is saved (or a newer checkpoint was already there): ``words`` name the last good one."""
        try:
            self._store.set(keys.STOP_SAVED, words)
            ring(self._store)
        except RuntimeError:
            pass  # the coordinator gave up waiting: it names the newest checkpoint on disk itself

    def wait_removed(self, timeout_s: float) -> bool:
        """Whether this worker was removed from the membership or the run is stopping, waiting up to
        ``timeout_s`` for the news (a replica-mate's death is seen by the coordinator within a heartbeat
        timeout)."""
        deadline = time.monotonic() + timeout_s
        while not (self.excluded or self.stopped is not None or self.lost is not None):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait (bounded) until the job's stop is seen; True if it was."""
        deadline = time.monotonic() + timeout_s
        while self.stopped is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.stopped is not None

    def announce_forming(self, epoch: int) -> None:
        """This worker leaves its current group for ``epoch``'s: it runs none of the old group's collectives
        again (members still blocked in one read this through ``left_for_newer``)."""
        try:
            self._store.set(keys.forming(self.worker_id), str(epoch))
        except RuntimeError:
            pass  # the coordinator is gone: its successor re-forms the group anyway

    def left_for_newer(self, epoch: int, members: tuple[int, ...]) -> bool:
        """Whether a member of ``epoch``'s group has left it for a newer epoch (so a collective of it can never
        complete). Store reads, at most every ``LEFT_CHECK_S``; call it only when a newer epoch exists."""
        now = time.monotonic()
        if now < self._left_checked_at + LEFT_CHECK_S:
            return self._left
        self._left_checked_at = now
        try:
            for m in members:
                key = keys.forming(m)
                if m != self.worker_id and self._store.check([key]) and int(self._store.get(key)) > epoch:
                    self._left = True
                    break
            else:
                self._left = False
        except (RuntimeError, ValueError):
            self._left = False
        return self._left

    def report_timeout(self, epoch: int) -> None:
        """A collective (or the rendezvous) of ``epoch`` timed out with nobody removed: the coordinator, which
        sees every heartbeat, decides what to do (re-form once, then exclude whoever stalls again)."""
        try:
            report_timeout(self._store, epoch, self.worker_id)
        except RuntimeError:
            pass  # the coordinator is gone: its successor re-forms the group anyway

    def wait_for_epoch(self, timeout_s: float, after: int = 0) -> Epoch | None:
        """Block (polling) until an epoch newer than ``after`` that includes this worker is published.

        None if the run stops, time runs out, or (for a worker that was a member) the newest epoch
        excludes it: it was declared dead and must not rejoin under its old state.
        """
        deadline = time.monotonic() + timeout_s
        refusal_checked = 0.0
        while time.monotonic() < deadline:
            if self.stop_reason() is not None:
                return None
            if time.monotonic() - refusal_checked > REFUSAL_CHECK_S:
                refusal_checked = time.monotonic()
                if self.refusal() is not None:
                    return None
            epoch = self.current_epoch()
            if epoch > after:
                self.latest_epoch = max(self.latest_epoch, epoch)  # the watcher may not have seen it yet
                record = self.epoch_record(epoch)
                if self.worker_id in record.members:
                    return record
                if after > 0:
                    return None
            time.sleep(0.005)
        return None

    def publish_metrics(self, record: dict[str, Any]) -> None:
        """Queue ``record`` for the coordinator's metrics.jsonl; the sender thread delivers it."""
        self._outbox.put(record)

    def flush_metrics(self, timeout_s: float = STORE_TIMEOUT_S) -> bool:
        """Wait until every record queued so far is in the store; False if that did not happen in time
        (the connection failed and no coordinator came back)."""
        delivered = threading.Event()
        self._outbox.put(delivered)
        deadline = time.monotonic() + timeout_s
        while not delivered.wait(0.05):
            if self.lost is not None or time.monotonic() > deadline:
                return False
        return True

    def close(self) -> None:
        """Stop the watchers (the sender delivers what was queued, then ends; the news watcher's wait ends on
        a ring of the workers' doorbell, harmless to the others, or else when its connection is cut); joined
        so that no thread is inside a store call while the interpreter shuts down."""
        self._outbox.put(None)
        self._watch_stop.set()
        # The watcher's wait ends when its own connection is ended, as if its key had come (``end_wait``). Not by
        # ringing the workers' doorbell: a ring is two store calls, and a worker that ends between them (excluded
        # as its link came back, killed) leaves a count with no key, on which every other worker's watcher would
        # wait until NEWS_WAIT_S.
        end_wait(self._news_tunnel)
        if (relay := self._relay) is not None:
            relay.close()
        self._spare_pool.shutdown(wait=False, cancel_futures=True)
        # The diagnosis of a lost connection makes store calls too (it ends at its next look, at ``_watch_stop``).
        for thread in [*self._watch_threads, *([self._diagnosis] if self._diagnosis is not None else [])]:
            thread.join(timeout=max(1.0, 4 * self._hb_interval) + self._probe_timeout_s)
