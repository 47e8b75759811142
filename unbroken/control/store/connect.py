"""Connections to the coordinator's store and the small store idioms every party uses.

Owns how a process reaches the store (``connect_store``: through an authenticated ``gateway.Tunnel``), how
a listening socket is bound, the doorbells (``ring``) and bounded key waits. What the keys mean is
``keys``'s.
"""

from __future__ import annotations

import datetime
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed import DistStoreError, TCPStore

from unbroken.control.store import keys
from unbroken.control.store.gateway import NothingListens, Tunnel, TunnelError, require_token
from unbroken.core.records import WorkerError, encode

STORE_TIMEOUT_S = 30.0
T = TypeVar("T")


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


def serve_store(timeout_s: float = STORE_TIMEOUT_S) -> tuple[TCPStore, int]:
    """The coordinator's store (the master) on an internal port of 127.0.0.1; returns it and its port.

    The store is handed the listening socket's descriptor and closes it when it is destroyed, so the socket is
    detached from Python first: were a Python object left holding the number too, the second close would land
    on whatever socket the kernel gave that number next (in a process that also holds tunnels: a live store
    connection cut, or a selector left with a stale entry)."""
    internal = bind_listen_socket("127.0.0.1", 0)
    port = internal.getsockname()[1]
    store = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=internal.detach(),
        use_libuv=True,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return store, port


def connect_store(address: str, timeout_s: float = STORE_TIMEOUT_S, token: str | None = None) -> TCPStore:
    """A client connection to the coordinator's store at ``HOST:PORT``, through an authenticated tunnel.

    ``token`` defaults to ``UNBROKEN_TOKEN``. Raises ValueError (no token, malformed address) or
    ``TunnelError`` (unreachable, or the coordinator refused the token)."""
    return open_store(address, timeout_s, token)[0]


REACH_RETRY_S = 0.25  # between attempts to reach a coordinator that the network did not let us reach


def reach(
    addresses: list[str], token: str | None, patience_s: float, timeout_s: float = STORE_TIMEOUT_S
) -> tuple[TCPStore, Tunnel, str]:
    """A connection to the first of ``addresses`` (the coordinator, then its standbys) that answers, its
    tunnel and its address. An address where nothing listens (refused: the job is over, or a standby that
    does not lead) is an answer: when every address refuses, ``NothingListens`` at once. An address the
    network does not reach (no route, a link down, a connection timing out) is tried again for up to
    ``patience_s``: a host whose link flaps must not take a passing cut for the end of its job. Raises the
    last error."""
    deadline = time.monotonic() + patience_s
    while True:
        last: Exception | None = None
        unreachable = False
        for address in addresses:
            try:
                store, tunnel = open_store(address, timeout_s, token)
                return store, tunnel, address
            except NothingListens as e:
                last = e
            except (TunnelError, RuntimeError, OSError) as e:
                last, unreachable = e, True
        assert last is not None, "no address to reach"
        if not unreachable or time.monotonic() + REACH_RETRY_S > deadline:
            raise last
        time.sleep(REACH_RETRY_S)


class CallGuard:
    """Bounds the store calls of one owner: a call under way for longer than ``limit_s`` has its tunnel cut,
    so it fails (RuntimeError) instead of waiting. A connection whose peer the network no longer reaches (a
    host cut off: nothing resets it) neither fails nor times out: TCPStore's timeout does not bound a call
    already sent, and TCP gives up only after many minutes. One watching thread, started on the first call and
    ended by ``close``."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: float | None = None
        self._tunnel: Tunnel | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def call(self, tunnel: Tunnel | None, fn: Callable[[], T]) -> T:
        """``fn()``, its tunnel cut should it take longer than the limit (None: a store not behind a tunnel)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="store-call-guard", daemon=True)
            self._thread.start()
        self._tunnel, self._since = tunnel, time.monotonic()
        try:
            return fn()
        finally:
            self._since = None

    def close(self) -> None:
        """End the watching thread (a call made after this is not bounded)."""
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self.limit_s / 4):
            since, tunnel = self._since, self._tunnel
            if since is not None and tunnel is not None and time.monotonic() - since > self.limit_s:
                tunnel.cut()


def open_store(address: str, timeout_s: float = STORE_TIMEOUT_S, token: str | None = None) -> tuple[TCPStore, Tunnel]:
    """``connect_store``, with the tunnel under the connection (``tunnel.cut()`` ends a call blocked on it)."""
    tunnel = Tunnel(address, token if token is not None else require_token(), timeout_s)
    try:
        store = TCPStore(
            tunnel.host,
            tunnel.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except RuntimeError:
        tunnel.close()
        raise
    return store, tunnel


# The byte with which torch's store answers a client's wait once its keys exist (c10d's
# ``WaitResponseType::STOP_WAITING``): the last byte a tunnel ended by ``end_wait`` gives its client.
STOP_WAITING = b"\x00"


def end_wait(tunnel: Tunnel) -> None:
    """Close ``tunnel``, a wait its client is blocked in returning as if its keys had come, instead of failing on
    the lost connection (which c10d reports with a C++ stack on stderr: a user's script would end with one). The
    client must make no store call after it (it would fail) and must not be inside another call (that call
    would read a wrong answer and fail): a watcher that only waits between looks, and checks why it woke."""
    tunnel.finish(STOP_WAITING)


# The answer to a read of a key (c10d's ``GET``) whose value is empty: the value's length (a uint64), 0, no bytes.
EMPTY_VALUE = (0).to_bytes(8, "little")


def end_get(tunnel: Tunnel) -> None:
    """``end_wait`` for a client blocked in a ``get`` of a key not there yet (torch's get is a wait, then a read):
    its wait ends as if the key had come and its read returns an empty value (both answers are in the client's
    socket before the tunnel closes; the read's request, sent after, goes nowhere). The client must tell that value
    from its key's (it knows why it woke) and make no store call after it."""
    tunnel.finish(STOP_WAITING + EMPTY_VALUE)


def ring(store: TCPStore, bell: str = keys.BELL) -> None:
    """Ring a doorbell: ``keys.BELL`` wakes the coordinator (after writing something it must act on),
    ``keys.NEWS`` wakes every worker's watcher (after publishing an epoch or a stop)."""
    n = store.add(keys.doorbell_seq(bell), 1)
    store.set(keys.doorbell(bell, n), "")


def publish_record(store: TCPStore, record: dict[str, Any]) -> None:
    """Queue one metrics record (``core.records`` encodes it) for the coordinator to append."""
    seq = store.add(keys.METRICS_SEQ, 1)
    store.set(keys.metrics(seq), encode(record))


def request_stop(store: TCPStore, reason: str) -> bool:
    """Ask every process of the job to stop, unless someone already did (``keys.STOP``, a compare-and-set):
    the first reason is the one kept, whoever asks after. Wakes the coordinator; True if ``reason`` is kept."""
    first = store.compare_set(keys.STOP, "", reason) == reason.encode()
    ring(store)
    return first


def exit_reason(code: int) -> str:
    """What ``keys.dead`` says of a worker process that ended with ``code`` (``Popen.returncode``: -N for signal N);
    the coordinator's failure record says it as "process " + this."""
    return "killed by SIGKILL" if code == -signal.SIGKILL else f"exited with status {code}"


_PROCESS = "process "


def process_failure(dead: str) -> str:
    """The coordinator's failure record's ``why`` for a worker whose process ended, ``dead`` being its
    ``keys.dead`` value (``exit_reason``'s text)."""
    return _PROCESS + dead


_RAISED = "raised "


def raised_failure(headline: str) -> str:
    """The coordinator's failure record's ``why`` for a worker that reported an exception (its headline)."""
    return _RAISED + headline


def raised_headline(why: str) -> str | None:
    """The exception headline a failure record's ``why`` names, as ``raised_failure`` wrote it; None when the
    failure was not an exception raised."""
    return why[len(_RAISED) :] if why.startswith(_RAISED) else None


_EXIT_REASON = re.compile(rf"(?:^|{re.escape(_PROCESS)})(?:killed by (SIGKILL)|exited with status (-?\d+))$")


def exit_code_in(why: str) -> int | None:
    """The exit code a failure record's ``why`` (or a ``keys.dead`` value) names, as ``exit_reason`` wrote it;
    None when the failure was not a process's end (a lost heartbeat, an exception raised, an exclusion)."""
    found = _EXIT_REASON.search(why)
    if found is None:
        return None
    return -signal.SIGKILL if found.group(1) else int(found.group(2))


def report_death(store: TCPStore, worker: int, why: str) -> None:
    """A launcher or agent saw ``worker``'s process exit: ``keys.dead`` says why, then ``keys.DEATHS`` counts it
    (the coordinator reads the dead keys only when that count moved: one read a look, whatever the members),
    then the coordinator is woken."""
    store.set(keys.dead(worker), why)
    store.add(keys.DEATHS, 1)
    ring(store)


def report_timeout(store: TCPStore, epoch: int, worker: int) -> None:
    """``worker``'s collective of ``epoch`` timed out with nobody removed: ``keys.timeout``, counted in
    ``keys.TIMEOUTS`` (as ``report_death``), and the coordinator woken."""
    store.set(keys.timeout(epoch, worker), str(time.time()))
    store.add(keys.TIMEOUTS, 1)
    ring(store)


def report_error(store: TCPStore, error: WorkerError) -> None:
    """A worker dying of an exception tells the coordinator (``keys.error``) and wakes it."""
    n = store.add(keys.ERROR_SEQ, 1)
    store.set(keys.error(n), error.encode())
    ring(store)


def wait_key(store: TCPStore, key: str, timeout_s: float) -> bool:
    """Block until ``key`` exists (True) or ``timeout_s`` passes (False); the store wakes us, no polling."""
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        return True
    except DistStoreError as e:
        if "timeout" not in str(e).lower():
            raise
        return False


def get_int(store: TCPStore, key: str) -> int:
    return store.add(key, 0)


def read_json(store: TCPStore, key: str) -> Any:
    return json.loads(store.get(key).decode())
