"""The coordinator's gateway on real sockets: only holders of the job's token reach the store.

The store is a real TCPStore listening on 127.0.0.1; the gateway serves a public port in front of it, as
the coordinator does. Attackers are real clients: garbage bytes, a wrong token, silence, a flood, a raw
TCPStore client, and another process racing for a worker's local tunnel.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from torch.distributed import TCPStore

from unbroken.control.store.connect import end_wait, serve_store
from unbroken.control.store.gateway import (
    MAGIC,
    MAX_PENDING,
    NONCE_BYTES,
    Gateway,
    Tunnel,
    TunnelError,
    _Loop,
    new_token,
)

pytestmark = pytest.mark.timeout(60)


@dataclass
class Served:
    store: TCPStore  # the coordinator's own (master) handle
    gateway: Gateway
    address: str
    token: str

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


# The gateway's handshake timeout in every test but the one about it: longer than any test here may last, so a
# connection the gateway closes was refused or dropped, never timed out, and a client's handshake may take as long as
# a loaded machine makes it.
PATIENT_S = 600.0


@contextlib.contextmanager
def serve(handshake_timeout_s: float) -> Iterator[Served]:
    store, port = serve_store(timeout_s=10.0)
    public = socket.socket()
    public.bind(("127.0.0.1", 0))
    public.listen(1024)
    token = new_token()
    gateway = Gateway(public, ("127.0.0.1", port), token, handshake_timeout_s=handshake_timeout_s)
    store.set("epoch", "1")
    try:
        yield Served(store, gateway, f"127.0.0.1:{public.getsockname()[1]}", token)
    finally:
        gateway.close()


@pytest.fixture
def served() -> Iterator[Served]:
    with serve(PATIENT_S) as s:
        yield s


def client(served: Served, token: str | None = None) -> TCPStore:
    tunnel = Tunnel(served.address, token or served.token, 5.0)
    return TCPStore(
        tunnel.host, tunnel.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )


def wait_closed(sock: socket.socket) -> None:
    """Return once the peer has closed ``sock`` (whatever it sent before); the test's timeout bounds the wait."""
    sock.settimeout(None)
    try:
        while sock.recv(4096) != b"":
            pass
    except OSError:
        pass  # reset


def test_token_holder_reaches_the_store(served: Served) -> None:
    c = client(served)
    assert c.get("epoch") == b"1"
    c.set("hb/0", "1")
    assert served.store.get("hb/0") == b"1"
    assert served.gateway.admitted == 1


# A store wait for a key that never comes, longer than the tests may last: within a test it can only end by what
# the test does to its tunnel, never by its own timeout.
NEVER_S = 600.0


def blocked_in_a_wait(served: Served) -> tuple[Tunnel, TCPStore, threading.Thread, list[str]]:
    """A client through a tunnel, blocked (on a daemon thread) in a ``NEVER_S`` store wait for a key that never
    comes; the list gets "returned" or "raised ..." when the wait ends."""
    tunnel = Tunnel(served.address, served.token, 5.0)
    store = TCPStore(
        tunnel.host, tunnel.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    assert store.get("epoch") == b"1"
    asked = tunnel.bytes_from_client()
    outcome: list[str] = []

    def wait() -> None:
        try:
            store.wait(["never"], datetime.timedelta(seconds=NEVER_S))
            outcome.append("returned")
        except Exception as e:  # noqa: BLE001 - the test reports whatever it was
            outcome.append(f"raised {e!r}")

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    while tunnel.bytes_from_client() == asked and waiter.is_alive():
        time.sleep(0.01)  # until the tunnel has read the wait's request
    assert tunnel.bytes_from_client() > asked and waiter.is_alive() and not outcome  # blocked in the wait
    return tunnel, store, waiter, outcome


def test_a_wait_through_a_tunnel_ended_by_end_wait_returns_and_c10d_logs_nothing(
    served: Served, capfd: pytest.CaptureFixture[str]
) -> None:
    """A client blocked in a store wait (a worker's news watcher as it closes): ``end_wait`` makes the wait
    return as if the key had come (its own timeout is past the test's), where cutting the connection fails the
    wait and c10d writes a C++ stack to stderr (the end of a user's script, once). The connection is gone after
    it."""
    tunnel, store, waiter, outcome = blocked_in_a_wait(served)
    end_wait(tunnel)
    waiter.join()
    assert outcome == ["returned"]
    assert "recvValueWithTimeout" not in capfd.readouterr().err
    with pytest.raises(RuntimeError):
        store.get("epoch")
    assert "recvValueWithTimeout" in capfd.readouterr().err  # what a failed call writes: the check above can fail


def test_cutting_a_tunnel_fails_the_wait_blocked_on_it(served: Served) -> None:
    """The other way to end a wait (failure injection, a lost coordinator): the call fails, long before its own
    timeout (past the test's)."""
    tunnel, _store, waiter, outcome = blocked_in_a_wait(served)
    tunnel.cut()
    waiter.join()
    assert len(outcome) == 1 and outcome[0].startswith("raised"), outcome


# Seeded random bytes: every pytest process (make test runs two) must collect the same parameters.
GARBAGE = random.Random(95)
PAYLOADS = [b"\x00" * 64, GARBAGE.randbytes(64), GARBAGE.randbytes(2**20), b"GET / HTTP/1.1\r\n\r\n" * 4]


@pytest.mark.parametrize("payload", PAYLOADS, ids=["zeros", "random-64", "random-1MiB", "http"])
def test_garbage_is_refused_and_the_store_is_untouched(served: Served, payload: bytes) -> None:
    keys = served.store.num_keys()
    sock = socket.create_connection(("127.0.0.1", served.port))
    greeting = sock.recv(len(MAGIC) + NONCE_BYTES)
    assert greeting.startswith(MAGIC)  # the greeting carries only a random challenge
    try:
        sock.sendall(payload)
    except OSError:
        pass  # the gateway may close before a large payload is fully sent
    wait_closed(sock)  # refused: with the handshake timeout past the test's, nothing else closes it
    sock.close()
    assert served.store.num_keys() == keys
    gateway = served.gateway
    assert (gateway.rejected, gateway.timed_out, gateway.dropped, gateway.admitted) == (1, 0, 0, 0)
    assert client(served).get("epoch") == b"1"  # and the gateway still serves


def test_wrong_token_is_refused(served: Served) -> None:
    with pytest.raises(TunnelError, match="refused this process's UNBROKEN_TOKEN"):
        Tunnel(served.address, new_token(), 5.0)
    assert served.gateway.rejected == 1 and served.gateway.admitted == 0


@pytest.mark.parametrize("address", ["127.0.0.1", ":29400", "host:port", ""])
def test_a_malformed_coordinator_address_is_named_in_one_line(address: str) -> None:
    with pytest.raises(ValueError, match=r"^--coordinator .* is malformed; expected HOST:PORT$"):
        Tunnel(address, new_token(), 5.0)


def test_client_must_not_trust_a_coordinator_without_the_token(served: Served) -> None:
    # A fake coordinator that greets correctly but cannot prove the token: the client hangs up.
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(1)

    import threading

    def impostor() -> None:
        conn, _ = fake.accept()
        conn.sendall(MAGIC + os.urandom(NONCE_BYTES))
        conn.recv(64)
        conn.sendall(os.urandom(32))
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(TunnelError, match="does not hold the job's token"):
        Tunnel(f"127.0.0.1:{fake.getsockname()[1]}", served.token, 5.0)
    fake.close()


def test_silent_client_is_closed_after_the_handshake_timeout() -> None:
    """Closed by the timeout (counted as such, nothing refused), and not before it: the gateway's deadline starts
    at its accept, after ``opened`` (the same clock), and a loaded machine only makes the close later. That others
    are served while a silent connection waits is shown with a flood of them, below."""
    with serve(handshake_timeout_s=1.0) as hasty:
        opened = time.monotonic()
        sock = socket.create_connection(("127.0.0.1", hasty.port))
        wait_closed(sock)
        closed = time.monotonic()
        gateway = hasty.gateway
        assert (gateway.timed_out, gateway.rejected, gateway.dropped, gateway.admitted) == (1, 0, 0, 0)
        assert closed >= opened + gateway.handshake_timeout_s, (opened, closed)
        sock.close()


def test_a_flood_of_silent_connections_does_not_lock_workers_out(served: Served) -> None:
    """A worker that connects after a flood of silent connections is admitted, and it is the drop of the oldest
    handshakes that lets it in (the handshake timeout is past the test's): the gateway accepts in the kernel's
    order, so every connection of the flood is accepted before the worker's, and each accept past
    ``MAX_PENDING`` pending ones drops one, the worker's own included."""
    flood = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(MAX_PENDING + 50)]
    assert client(served).get("epoch") == b"1"
    gateway = served.gateway
    assert (gateway.admitted, gateway.dropped) == (1, len(flood) + 1 - MAX_PENDING)
    assert (gateway.rejected, gateway.timed_out) == (0, 0)
    for s in flood:
        s.close()


def test_raw_tcpstore_client_gets_nothing(served: Served) -> None:
    keys = served.store.num_keys()
    with pytest.raises(RuntimeError):
        raw = TCPStore(
            "127.0.0.1",
            served.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=2),
        )
        raw.get("epoch")
    assert served.store.num_keys() == keys and served.gateway.admitted == 0


def test_another_process_cannot_take_over_a_local_tunnel(served: Served) -> None:
    tunnel = Tunnel(served.address, served.token, 5.0)
    # Another process connects to the tunnel's local port before our store client does.
    script = (
        "import socket,sys\n"
        f"s=socket.create_connection(({tunnel.host!r},{tunnel.port}))\n"
        "s.settimeout(3)\n"
        "s.sendall(b'x'*16)\n"
        "try:\n    data=s.recv(100)\nexcept OSError:\n    data=b''\n"
        "sys.exit(0 if data==b'' else 1)\n"
    )
    intruder = subprocess.run([sys.executable, "-c", script], timeout=30)
    assert intruder.returncode == 0, "the intruder was given a connection to the store"
    c = TCPStore(
        tunnel.host, tunnel.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    assert c.get("epoch") == b"1"


@pytest.mark.skipif(sys.platform != "linux", reason="a loopback address of its own needs Linux's 127/8")
def test_a_stale_client_retrying_an_old_tunnel_port_cannot_take_a_new_tunnel(served: Served) -> None:
    """A store client keeps retrying a refused port until its timeout; one left behind by an earlier job of this
    process, retrying 127.0.0.1:P, must not take the one connection of a new tunnel that got port P (CI: a
    worker's join then failed, its own client refused)."""
    tunnel = Tunnel(served.address, served.token, 5.0)
    assert tunnel.host != "127.0.0.1"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", tunnel.port), timeout=2).close()
    c = TCPStore(
        tunnel.host, tunnel.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    assert c.get("epoch") == b"1"


@pytest.mark.timeout(30)
def test_a_socket_closed_while_registered_does_not_block_the_next_one_with_its_number() -> None:
    """A pipe's socket closed behind the loop's back leaves its descriptor in the selector; the kernel gives the
    number to the next socket, which must still be piped (once: "FD 42 is already registered", a worker lost)."""

    def tcp_pair() -> tuple[socket.socket, socket.socket]:
        with socket.create_server(("127.0.0.1", 0)) as server:
            client = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
        return accepted, client

    loop = _Loop("test-loop")
    try:
        a, a_peer = tcp_pair()
        b, b_peer = tcp_pair()
        done = threading.Event()
        loop.call(lambda: (loop.pipe(a, b), done.set()))
        assert done.wait(5)
        stale = a.fileno()
        a.close()  # not unregistered: its number stays in the selector's map
        c, c_peer = tcp_pair()
        reused = next(x for x in (c, c_peer) if x.fileno() == stale)
        other = c_peer if reused is c else c
        d, d_peer = tcp_pair()
        piped = threading.Event()
        loop.call(lambda: (loop.pipe(reused, d), piped.set()))
        assert piped.wait(5)
        other.sendall(b"through")
        d_peer.settimeout(5)
        assert d_peer.recv(16) == b"through"
    finally:
        loop.close()
