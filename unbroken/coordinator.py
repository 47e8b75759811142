"""The coordinator (one small process per job, never a training worker) and the workers' client of it.

Owns membership. The coordinator hosts the rendezvous store (torch.distributed's TCPStore), admits
workers, watches their heartbeats and the launcher's process-exit reports, and publishes a new membership
epoch whenever a worker dies or joins. It also drains the metrics the workers publish into
``RUN_DIR/metrics.jsonl``.

The store itself listens on 127.0.0.1 on an internal port; the job's public address (127.0.0.1 unless
told otherwise) is served by ``gateway.Gateway``, which admits only clients that prove they hold the
job's token (``UNBROKEN_TOKEN``) and pipes them to the store. Clients connect with ``connect_store``
through an authenticated local tunnel, so every worker in a process group was admitted by the gateway.

Store keys (all under the job's store):
  config, run_dir, expected        the resolved config (TOML), the run directory, workers expected
  register/seq, register/<n>        worker registration requests; register/<n>/id the admitted id
  hb/<id>                           heartbeat counter of a worker
  dead/<id>                         set by the launcher when the worker's process exits
  epoch, epoch/<e>                  the current epoch number, and its JSON record (members, reason)
  metrics/seq, metrics/<n>          metric records (JSON lines) published by the epoch's leader
  final/<id>                        a worker's final parameter checksum
  done, stop                        the run finished (JSON status); everyone must stop now (reason)
  bell/seq, bell/<n>                the coordinator's doorbell: "something to look at" (a registration, a
                                    death report, stop, done)
  news/seq, news/<n>                the workers' doorbell: a new epoch or a stop was published

Nothing polls at a high rate (the coordinator and the launcher share the workers' cores, so every wake-up
is taken from training). The coordinator sleeps in a store wait on the next ``bell/<n>``; whoever writes
something it must act on rings it. Between rings it wakes every ``heartbeat_timeout_s /
CHECKS_PER_TIMEOUT`` for a quiet tick, one round trip that reads every heartbeat counter and the metrics
sequence; the full pass over registrations, death reports, stop and done runs when the bell rang, and at
least once per heartbeat timeout regardless. Each worker sends a heartbeat (one ``add``) every heartbeat interval on
one connection, and a second thread sleeps in a store wait on the next ``news/<n>`` on another, so a new
epoch or a stop reaches every worker as soon as the store sees it. A hang is declared after
``heartbeat_timeout_s`` of silence, seen at most one heartbeat interval and two ticks later.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError, TCPStore

from unbroken.gateway import Gateway, NothingListens, Tunnel, TunnelError, require_token

log = logging.getLogger(__name__)

STORE_TIMEOUT_S = 30.0
CHECKS_PER_TIMEOUT = 10  # heartbeat checks (and metrics drains) per heartbeat timeout; events wake it at once
MAX_TICK_S = 0.25


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on (host, port); ValueError (one line) if the port is taken or the host is invalid."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; choose a free --port (0 = any)") from None
    sock.listen(1024)
    return sock


def connect_store(address: str, timeout_s: float = STORE_TIMEOUT_S, token: str | None = None) -> TCPStore:
    """A client connection to the coordinator's store at ``HOST:PORT``, through an authenticated tunnel.

    ``token`` defaults to ``UNBROKEN_TOKEN``. Raises ValueError (no token, malformed address) or
    ``TunnelError`` (unreachable, or the coordinator refused the token)."""
    return open_store(address, timeout_s, token)[0]


def open_store(address: str, timeout_s: float = STORE_TIMEOUT_S, token: str | None = None) -> tuple[TCPStore, Tunnel]:
    """``connect_store``, with the tunnel under the connection (``tunnel.cut()`` ends a call blocked on it)."""
    tunnel = Tunnel(address, token if token is not None else require_token(), timeout_s)
    try:
        store = TCPStore(
            "127.0.0.1",
            tunnel.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except RuntimeError:
        tunnel.close()
        raise
    return store, tunnel


def ring(store: TCPStore, bell: str = "bell") -> None:
    """Ring a doorbell: ``bell`` wakes the coordinator (after writing something it must act on), ``news``
    wakes every worker's watcher (after publishing an epoch or a stop)."""
    n = store.add(f"{bell}/seq", 1)
    store.set(f"{bell}/{n}", "")


def publish_record(store: TCPStore, record: dict[str, Any]) -> None:
    """Queue one metrics record for the coordinator to append to the run's metrics.jsonl."""
    seq = store.add("metrics/seq", 1)
    store.set(f"metrics/{seq}", json.dumps(record, sort_keys=True))


def wait_key(store: TCPStore, key: str, timeout_s: float) -> bool:
    """Block until ``key`` exists (True) or ``timeout_s`` passes (False); the store wakes us, no polling."""
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        return True
    except DistStoreError as e:
        if "timeout" not in str(e).lower():
            raise
        return False


def _get_int(store: TCPStore, key: str) -> int:
    return store.add(key, 0)


def read_json(store: TCPStore, key: str) -> Any:
    return json.loads(store.get(key).decode())


@dataclass
class Epoch:
    epoch: int
    members: tuple[int, ...]
    reason: str


class Coordinator:
    """Membership service for one job. ``run()`` loops until the job is done, stopped or abandoned."""

    def __init__(
        self,
        sock: socket.socket,
        config_toml: str,
        run_dir: Path,
        expected_workers: int,
        heartbeat_timeout_s: float,
        join_timeout_s: float,
        resume: bool,
        parent_pid: int | None = None,
        token: str | None = None,
    ) -> None:
        self.sock = sock  # the public socket, served by the gateway
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.port = port
        self.internal = bind_listen_socket("127.0.0.1", 0)  # kept open for the store's lifetime
        internal_port = self.internal.getsockname()[1]
        self.store = TCPStore(
            "127.0.0.1",
            internal_port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=self.internal.fileno(),
            use_libuv=True,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        )
        self.gateway = Gateway(sock, ("127.0.0.1", internal_port), token if token is not None else require_token())
        self.run_dir = run_dir
        self.expected = expected_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.join_timeout_s = join_timeout_s
        self.parent_pid = parent_pid
        self.store.set("config", config_toml)
        self.store.set("run_dir", str(run_dir))
        self.store.set("expected", str(expected_workers))
        self.store.set("resume", "1" if resume else "0")
        self.store.set("epoch", "0")
        self.store.add("metrics/seq", 0)  # exists from the start: the quiet tick reads it with the heartbeats
        self.rung = 0
        self.next_registration = 1
        self.next_worker_id = 0
        self.admitted: dict[int, dict[str, Any]] = {}
        self.members: tuple[int, ...] = ()
        self.epoch = 0
        self.heartbeats: dict[int, tuple[int, float]] = {}
        self.tick_s = min(MAX_TICK_S, heartbeat_timeout_s / CHECKS_PER_TIMEOUT)
        self.next_metric = 1
        self.metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self.started = time.monotonic()
        self.stopping = threading.Event()

    # -- output -------------------------------------------------------------------------------------
    def emit(self, record: dict[str, Any]) -> None:
        self.metrics_file.write(json.dumps(record, sort_keys=True) + "\n")

    # -- membership ---------------------------------------------------------------------------------
    def _admit_new(self) -> list[int]:
        joined = []
        seq = _get_int(self.store, "register/seq")
        while self.next_registration <= seq:
            key = f"register/{self.next_registration}"
            if not self.store.check([key]):
                break  # the worker incremented the counter but has not written its request yet
            request = read_json(self.store, key)
            wid = request.get("worker_id", -1)
            if wid is None or wid < 0 or wid in self.members or (wid in self.admitted and self.epoch == 0):
                wid = max([self.next_worker_id, *[w + 1 for w in self.admitted]])
            # A worker that died may come back under its old id (the launcher restarts it so).
            self.next_worker_id = max(self.next_worker_id, wid + 1)
            self.admitted[wid] = request
            self.heartbeats[wid] = (_get_int(self.store, f"hb/{wid}"), time.monotonic())
            self.store.delete_key(f"dead/{wid}")
            self.store.set(f"{key}/late", "1" if self.epoch > 0 else "0")
            self.store.set(f"{key}/id", str(wid))
            joined.append(wid)
            self.next_registration += 1
        return joined

    def _read_counters(self) -> tuple[list[int], int]:
        """Every member's heartbeat counter and the metrics sequence, in one round trip (every one of those
        counters exists: ``_get_int`` created each heartbeat counter at admission)."""
        raw = self.store.multi_get([*(f"hb/{wid}" for wid in self.members), "metrics/seq"])
        return [int(r) for r in raw[:-1]], int(raw[-1])

    def _dead(self, counts: list[int], reported: bool) -> dict[int, str]:
        """Members that died: reported by the launcher (looked up only when ``reported`` may have news) or
        silent for longer than the heartbeat timeout."""
        dead: dict[int, str] = {}
        now = time.monotonic()
        for wid, count in zip(self.members, counts, strict=True):
            if reported and self.store.check([f"dead/{wid}"]):
                dead[wid] = "process " + self.store.get(f"dead/{wid}").decode()
                continue
            last_count, last_time = self.heartbeats.get(wid, (count, now))
            if count != last_count:
                self.heartbeats[wid] = (count, now)
            elif now - last_time > self.heartbeat_timeout_s:
                dead[wid] = f"no heartbeat for {now - last_time:.2f} s"
        return dead

    def _failure_record(self, wid: int, why: str) -> dict[str, Any]:
        """A failure with its detection latency when the launcher recorded when it delivered the fault."""
        record: dict[str, Any] = {
            "type": "failure",
            "worker": wid,
            "why": why,
            "time": time.time(),
            "epoch": self.epoch,
        }
        if self.store.check([f"injected/{wid}"]):
            injected = read_json(self.store, f"injected/{wid}")
            record["event"] = injected["event"]
            record["detection_s"] = record["time"] - injected["time"]
            self.store.delete_key(f"injected/{wid}")
        return record

    def _drain_metrics(self, seq: int | None = None) -> None:
        if seq is None:
            seq = _get_int(self.store, "metrics/seq")
        while self.next_metric <= seq:
            key = f"metrics/{self.next_metric}"
            if not self.store.check([key]):
                break
            self.metrics_file.write(self.store.get(key).decode() + "\n")
            self.store.delete_key(key)
            self.next_metric += 1

    def publish(self, members: tuple[int, ...], reason: str) -> None:
        self.epoch += 1
        self.members = tuple(sorted(members))
        record = {"epoch": self.epoch, "members": list(self.members), "reason": reason, "time": time.time()}
        self.store.set(f"epoch/{self.epoch}", json.dumps(record))
        self.store.set("epoch", str(self.epoch))
        ring(self.store, "news")
        self.emit({"type": "membership", **record, "elapsed_s": time.monotonic() - self.started})
        log.info("epoch %d: members %s (%s)", self.epoch, list(self.members), reason)

    def stop(self, reason: str) -> None:
        if not self.store.check(["stop"]):
            self.store.set("stop", reason)
        self.stopping.set()
        ring(self.store, "news")
        ring(self.store)

    def run(self) -> int:
        """Admit the expected workers, publish epochs, drain metrics; return 0 when the job is done."""
        start_deadline = time.monotonic() + self.join_timeout_s
        rung, ticks = True, 0
        try:
            while not self.stopping.is_set():
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.stop("the launcher died")
                    break
                # Everything but silence is announced by the bell; a full pass once per heartbeat timeout
                # anyway, in case a ringer died between writing its news and ringing.
                full = rung or ticks % CHECKS_PER_TIMEOUT == 0
                joined = self._admit_new() if full else []
                counts, metrics_seq = self._read_counters()
                if self.epoch == 0:
                    if len(self.admitted) >= self.expected:
                        self.publish(tuple(self.admitted), "start")
                    elif time.monotonic() > start_deadline:
                        self.stop(
                            f"only {len(self.admitted)} of {self.expected} workers joined "
                            f"within {self.join_timeout_s:.0f} s"
                        )
                        break
                else:
                    dead = self._dead(counts, reported=full)
                    if dead:
                        survivors = tuple(w for w in self.members if w not in dead)
                        if not survivors:
                            self.publish((), "every worker died")
                            self.stop("every worker died")
                            break
                        self.publish(survivors, "died: " + ", ".join(str(w) for w in sorted(dead)))
                        for wid, why in dead.items():
                            self.emit(self._failure_record(wid, why))
                    if joined:
                        self.publish((*self.members, *joined), "joined: " + ", ".join(str(w) for w in joined))
                self._drain_metrics(metrics_seq)
                if full and self.store.check(["stop"]):
                    ring(self.store, "news")  # a stop written by the launcher or a worker: tell everyone now
                    break
                if full and self.store.check(["done"]):
                    self._drain_metrics()
                    break
                rung = wait_key(self.store, f"bell/{self.rung + 1}", self.tick_s)
                if rung:
                    self.rung = _get_int(self.store, "bell/seq")
                ticks += 1
        finally:
            self._drain_metrics()
            gw = self.gateway
            self.emit(
                {
                    "type": "gateway",
                    "admitted": gw.admitted,
                    "rejected": gw.rejected,
                    "timed_out": gw.timed_out,
                    "dropped": gw.dropped,
                    "time": time.time(),
                }
            )
            self.metrics_file.close()
        return 0 if self.store.check(["done"]) else 1


def run_coordinator(coordinator: Coordinator, address_file: Path | None) -> int:
    """Run ``coordinator`` until the job ends; SIGTERM/SIGINT ask every worker to stop first."""

    def on_signal(signum: int, _frame: object) -> None:
        coordinator.stop(f"coordinator received signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if address_file is not None:
        tmp = address_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": coordinator.address, "pid": os.getpid()}))
        os.replace(tmp, address_file)
    code = coordinator.run()
    # Let workers read the final keys before the store goes away.
    time.sleep(0.5)
    coordinator.gateway.close()
    return code


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
    ) -> None:
        self.address = address
        self.token = require_token()
        self.lost: str | None = None
        self._lost_event = threading.Event()
        self._probe_timeout_s = max(1.0, heartbeat_timeout_s)
        self.store = connect_store(address, token=self.token)
        seq = self.store.add("register/seq", 1)
        request = {
            "worker_id": -1 if worker_id is None else worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.store.set(f"register/{seq}", json.dumps(request))
        ring(self.store)
        self.store.wait([f"register/{seq}/id"], datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self.worker_id = int(self.store.get(f"register/{seq}/id"))
        self.late = self.store.get(f"register/{seq}/late") == b"1"  # joined a running job: it must catch up
        self.latest_epoch = int(self.store.get("epoch"))
        # Epochs that removed workers, as (epoch, removed ids), kept by the watcher: a collective is abandoned
        # only when one of its members was removed. A join alone never interrupts one (every member is alive,
        # so it completes), which keeps all members' collective sequences matched.
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
        self._news_wait_s = max(1.0, heartbeat_timeout_s)
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
        store, key = self._sender_store, f"hb/{self.worker_id}"
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
        ``_news_wait_s`` for a look anyway. The epoch and the stop are read after the doorbell's count (or
        the ring) they follow, and the coordinator writes them before ringing: nothing published is missed.
        """
        store = self._news_store
        try:
            rung = _get_int(store, "news/seq")
            while not self._watch_stop.is_set():
                newest = int(store.get("epoch"))
                if newest > self._seen_epoch:
                    self._advance(store, newest)
                if self.stopped is None and store.check(["stop"]):
                    self.stopped = store.get("stop").decode()
                if wait_key(store, f"news/{rung + 1}", self._news_wait_s):
                    rung += 1  # doorbell keys stay: if it rang again meanwhile, the next wait returns at once
        except RuntimeError:
            self._connection_failed()

    def _advance(self, store: TCPStore, newest: int) -> None:
        """Read the epochs after the last one seen up to ``newest``: note the removals, then the epoch."""
        for epoch in range(self._seen_epoch + 1, newest + 1):
            members = frozenset(read_json(store, f"epoch/{epoch}")["members"])
            if self._seen_members - members:
                self.removals.append((epoch, self._seen_members - members))
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
        return self.store.get("config").decode()

    def run_dir(self) -> Path:
        return Path(self.store.get("run_dir").decode())

    def resume(self) -> bool:
        return self.store.get("resume") == b"1"

    def current_epoch(self) -> int:
        return int(self.store.get("epoch"))

    def epoch_record(self, epoch: int) -> Epoch:
        record = read_json(self.store, f"epoch/{epoch}")
        return Epoch(record["epoch"], tuple(record["members"]), record["reason"])

    def stop_reason(self) -> str | None:
        if self.store.check(["stop"]):
            return self.store.get("stop").decode()
        return None

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
        """Stop the watchers (the sender delivers what was queued, then ends; the news watcher's wait ends
        when its connection is cut); joined so that no thread is inside a store call while the interpreter
        shuts down."""
        self._outbox.put(None)
        self._watch_stop.set()
        self._news_tunnel.cut()
        self._spare_pool.shutdown(wait=False, cancel_futures=True)
        for thread in self._watch_threads:
            thread.join(timeout=max(1.0, 4 * self._hb_interval) + self._probe_timeout_s)
