"""A worker's client of the coordinator: registration, heartbeats, the epoch watch, metrics delivery.

The one way a worker reaches the control plane: ``CoordinatorClient`` registers, keeps a cached view of the
membership epochs and of the stop flag (a watcher thread sleeping on the workers' doorbell), sends
heartbeats and queued metrics records from its own thread, and tells a cut connection from a dead
coordinator.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from unbroken.control import keys
from unbroken.control.gateway import NothingListens, Tunnel, TunnelError, require_token
from unbroken.control.store import (
    STORE_TIMEOUT_S,
    connect_store,
    get_int,
    open_store,
    publish_record,
    read_json,
    ring,
    wait_key,
)

log = logging.getLogger(__name__)

NEWS_WAIT_S = 60.0

# The environment that tells a worker process where its job is (a launcher, the per-host agent, or a user
# under torchrun/srun sets it; unbroken.ft reads it), besides the job's token (gateway.TOKEN_ENV).
COORDINATOR_ENV = "UNBROKEN_COORDINATOR"  # HOST:PORT of the coordinator
WORKER_ID_ENV = "UNBROKEN_WORKER_ID"  # this worker's id (else RANK or SLURM_PROCID; else the coordinator picks)
LOCAL_WORKERS_ENV = "UNBROKEN_LOCAL_WORKERS"  # workers on this host (to size each one's threads)
RUN_DIR_ENV = "UNBROKEN_RUN_DIR"  # where this worker writes checkpoints (default: the coordinator's run dir)


@dataclass
class Epoch:
    epoch: int
    members: tuple[int, ...]
    reason: str
    reform: bool = False  # every member of the previous epoch must abandon its group (a collective stalled)


class CoordinatorClient:
    """A worker's view of the coordinator: registration, heartbeats, the current epoch, metrics.

    When the connection fails, the watcher finds out why (``lost``): ``"coordinator"`` if the coordinator
    cannot be reached any more (dead or unresponsive: the job must stop), ``"cut"`` if it still answers
    (only this worker's connection was cut: this worker leaves, the job goes on without it).
    """

    def __init__(
        self,
        address: str,
        worker_id: int | None,
        heartbeat_interval_s: float = 0.25,
        heartbeat_timeout_s: float = 2.0,
        token: str | None = None,
    ) -> None:
        self.address = address
        self.token = token or require_token()
        self.lost: str | None = None
        self._lost_event = threading.Event()
        self._probe_timeout_s = max(1.0, heartbeat_timeout_s)
        self.store = connect_store(address, token=self.token)
        seq = self.store.add(keys.REGISTER_SEQ, 1)
        request = {
            "worker_id": -1 if worker_id is None else worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.store.set(keys.register(seq), json.dumps(request))
        ring(self.store)
        self.store.wait([keys.register_id(seq)], datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self.worker_id = int(self.store.get(keys.register_id(seq)))
        self.late = self.store.get(keys.register_late(seq)) == b"1"  # joined a running job: it must catch up
        self.latest_epoch = int(self.store.get(keys.EPOCH))
        # Epochs that removed workers, as (epoch, removed ids), kept by the watcher: a collective is abandoned
        # only when one of its members was removed (or, for a re-formation after a stalled collective, every
        # member counts as removed from the old group). A join alone never interrupts one (every member is
        # alive, so it completes), which keeps all members' collective sequences matched.
        self.removals: list[tuple[int, frozenset[int]]] = []
        self._seen_epoch = self.latest_epoch
        self._seen_members = frozenset(self.epoch_record(self._seen_epoch).members) if self._seen_epoch else frozenset()
        self.stopped: str | None = None
        # Two watcher threads, each on its own connection (a TCPStore client is one socket, one call at a
        # time): the sender sends a heartbeat every interval and the metrics records queued by the training
        # thread, the news watcher sleeps in a store wait on the workers' doorbell. (Connected with the long
        # timeout: opening a connection alone can take seconds, see new_connection; then their ops time out
        # within the heartbeat bound, so an unresponsive coordinator is noticed as fast as a dead one.)
        op_timeout = datetime.timedelta(seconds=max(1.0, heartbeat_timeout_s))
        self._sender_store = connect_store(address, token=self.token)
        self._sender_store.set_timeout(op_timeout)
        self._outbox: queue.SimpleQueue[dict[str, Any] | threading.Event | None] = queue.SimpleQueue()
        self._news_store, self._news_tunnel = open_store(address, token=self.token)
        self._news_store.set_timeout(op_timeout)
        self._spare_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-spare")
        self._spare = self._spare_pool.submit(connect_store, address, STORE_TIMEOUT_S, self.token)
        self._hb_interval = heartbeat_interval_s
        self._news_wait_s = NEWS_WAIT_S
        self._watch_stop = threading.Event()
        self._diagnosing = threading.Lock()
        self._watch_threads = [
            threading.Thread(target=self._send, name="heartbeat+metrics", daemon=True),
            threading.Thread(target=self._watch_news, name="epoch-watch", daemon=True),
        ]
        for thread in self._watch_threads:
            thread.start()

    def _send(self) -> None:
        """A heartbeat (one ``add``) every interval, and between them the queued metrics records in order,
        so the training thread never waits on the store to publish. Ends at the ``None`` that ``close``
        queues, after everything queued before it."""
        store, key = self._sender_store, keys.heartbeat(self.worker_id)
        next_beat = time.monotonic()
        while True:
            try:
                if time.monotonic() >= next_beat:
                    store.add(key, 1)
                    next_beat = time.monotonic() + self._hb_interval
                try:
                    item = self._outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
                except queue.Empty:
                    continue
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    item.set()  # a flush: everything queued before it is in the store
                else:
                    publish_record(store, item)
            except RuntimeError:
                self._connection_failed()
                return

    def _watch_news(self) -> None:
        """A cached view of the epoch and the stop flag, so waits never touch the network.

        Sleeps in a store wait on the next ``news/<n>``, rung by the coordinator right after it publishes an
        epoch or a stop, so either is seen as soon as it is published; the wait also ends every
        ``NEWS_WAIT_S`` for a look anyway (rarely: c10d logs a line for every store wait that times out, and a
        dead coordinator ends the wait at once, a hung one is found by the heartbeat sender). The epoch and the
        stop are read after the doorbell's count (or the ring) they follow, and the coordinator writes them
        before ringing: nothing published is missed.
        """
        store = self._news_store
        try:
            rung = get_int(store, keys.doorbell_seq(keys.NEWS))
            while not self._watch_stop.is_set():
                newest = int(store.get(keys.EPOCH))
                if newest > self._seen_epoch:
                    self._advance(store, newest)
                if self.stopped is None and store.check([keys.STOP]):
                    self.stopped = store.get(keys.STOP).decode()
                if wait_key(store, keys.doorbell(keys.NEWS, rung + 1), self._news_wait_s):
                    rung += 1  # doorbell keys stay: if it rang again meanwhile, the next wait returns at once
        except RuntimeError:
            self._connection_failed()

    def _advance(self, store: TCPStore, newest: int) -> None:
        """Read the epochs after the last one seen up to ``newest``: note the removals, then the epoch."""
        for epoch in range(self._seen_epoch + 1, newest + 1):
            record = read_json(store, keys.epoch(epoch))
            members = frozenset(record["members"])
            removed = self._seen_members if record.get("reform") else self._seen_members - members
            if removed:
                self.removals.append((epoch, removed))
            self._seen_epoch, self._seen_members = epoch, members
        self.latest_epoch = max(self.latest_epoch, newest)  # after the removals: readers check both

    def removed_since(self, epoch: int, members: tuple[int, ...]) -> bool:
        """True if an epoch newer than ``epoch`` removed one of ``members`` (cheap: the watcher's cache)."""
        return any(e > epoch and not removed.isdisjoint(members) for e, removed in self.removals)

    def _connection_failed(self) -> None:
        """A watcher's store call failed: find out why, once (unless the client is closing)."""
        if self._watch_stop.is_set() or not self._diagnosing.acquire(blocking=False):
            return
        self._diagnose()

    def _diagnose(self) -> None:
        """The connection failed: is the coordinator gone, or only our connection? (one fresh handshake)"""
        self.lost = "coordinator"
        reason = f"the coordinator at {self.address} is gone (its connection failed and it does not answer)"
        deadline = time.monotonic() + self._probe_timeout_s
        while time.monotonic() < deadline:  # a few tries: a cut in progress may sever the first probe too
            try:
                Tunnel(self.address, self.token, self._probe_timeout_s).close()
            except NothingListens:
                break  # the coordinator's port is closed: no need to wait out the probe timeout
            except (TunnelError, OSError):
                time.sleep(0.2)
                continue
            self.lost = "cut"
            reason = "this worker's connection to the coordinator was cut"
            break
        log.error("%s", reason)
        self.stopped = self.stopped or reason
        self._lost_event.set()

    def wait_lost(self, timeout_s: float) -> str | None:
        """After a store call failed: wait (bounded) for the watcher's verdict; None if it saw nothing."""
        if any(thread.is_alive() for thread in self._watch_threads):
            self._lost_event.wait(timeout_s)
        return self.lost

    def new_connection(self) -> TCPStore:
        """Another authenticated connection to the store, for a blocking user such as a group's rendezvous:
        a wait abandoned on it cannot hold up this client's own store calls, which share one socket.

        The connection was opened ahead on a background thread (and the next one is started now): torch
        formats a new socket's addresses with getnameinfo, a reverse DNS lookup that stalls for the
        resolver's timeout (5 s) where DNS is slow or unreachable, and recovery must not wait for that."""
        spare = self._spare
        self._spare = self._spare_pool.submit(connect_store, self.address, STORE_TIMEOUT_S, self.token)
        try:
            return spare.result(timeout=STORE_TIMEOUT_S)
        except (RuntimeError, ConnectionError, concurrent.futures.TimeoutError):
            return connect_store(self.address, token=self.token)  # the spare failed: one more try, here

    def config_toml(self) -> str:
        return self.store.get(keys.CONFIG).decode()

    def run_dir(self) -> Path:
        return Path(self.store.get(keys.RUN_DIR).decode())

    def current_epoch(self) -> int:
        return int(self.store.get(keys.EPOCH))

    def epoch_record(self, epoch: int) -> Epoch:
        record = read_json(self.store, keys.epoch(epoch))
        return Epoch(record["epoch"], tuple(record["members"]), record["reason"], bool(record.get("reform")))

    def stop_reason(self) -> str | None:
        if self.store.check([keys.STOP]):
            return self.store.get(keys.STOP).decode()
        return None

    def done(self) -> bool:
        """Whether the run has finished (its leader said so)."""
        try:
            return self.store.check([keys.DONE])
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
            first = self.store.compare_set(keys.STOP, "", reason) == reason.encode()
            ring(self.store)
            return first
        except RuntimeError:
            return False  # the coordinator is gone: nobody left to tell

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait (bounded) until the job's stop is seen; True if it was."""
        deadline = time.monotonic() + timeout_s
        while self.stopped is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.stopped is not None

    def report_timeout(self, epoch: int) -> None:
        """A collective (or the rendezvous) of ``epoch`` timed out with nobody removed: the coordinator, which
        sees every heartbeat, decides what to do (re-form once, then exclude whoever stalls again)."""
        try:
            self.store.set(keys.timeout(epoch, self.worker_id), str(time.time()))
            ring(self.store)
        except RuntimeError:
            pass

    def wait_for_epoch(self, timeout_s: float, after: int = 0) -> Epoch | None:
        """Block (polling) until an epoch newer than ``after`` that includes this worker is published.

        None if the run stops, time runs out, or (for a worker that was a member) the newest epoch
        excludes it: it was declared dead and must not rejoin under its old state.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stop_reason() is not None:
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
        (the connection failed: the caller's copy of its recent records is all there is)."""
        delivered, sender = threading.Event(), self._watch_threads[0]
        self._outbox.put(delivered)
        deadline = time.monotonic() + timeout_s
        while not delivered.wait(0.05):
            if not sender.is_alive() or time.monotonic() > deadline:
                return False
        return True

    def close(self) -> None:
        """Stop the watchers (the sender delivers what was queued, then ends; the news watcher's wait ends on
        a ring of the workers' doorbell, harmless to the others, or else when its connection is cut); joined
        so that no thread is inside a store call while the interpreter shuts down."""
        self._outbox.put(None)
        self._watch_stop.set()
        watcher = self._watch_threads[1]
        try:
            ring(self.store, keys.NEWS)
            watcher.join(timeout=1.0)
        except RuntimeError:
            pass  # the coordinator is gone: cut the connection instead
        if watcher.is_alive():
            self._news_tunnel.cut()
        self._spare_pool.shutdown(wait=False, cancel_futures=True)
        for thread in self._watch_threads:
            thread.join(timeout=max(1.0, 4 * self._hb_interval) + self._probe_timeout_s)
