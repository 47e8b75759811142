"""Authenticated access to the coordinator's store: an HMAC gateway in front of it, a tunnel to it.

Owns the job's secret token and the bytes between a store client and the store. torch's TCPStore has no
authentication (any client can list, read, write and delete keys), so the coordinator never exposes it:
the store listens on 127.0.0.1 on an internal port, and the public port is served by a ``Gateway`` that
admits a connection only after a challenge-response with the job's token, then pipes its bytes to the
store. Clients (workers, the launcher) reach the store through a ``Tunnel``: a one-shot forwarder on
127.0.0.1 in their own process that does the handshake and then pipes, so TCPStore clients work unchanged
(``connect.connect_store`` opens one).

The handshake, mutual (each side proves it holds the token; no secret crosses the wire; nonces make
replays useless):

    gateway -> client   MAGIC + nonce_g                        (32 random bytes)
    client  -> gateway  HMAC-SHA256(token, "client" + nonce_g) + nonce_c
    gateway -> client   HMAC-SHA256(token, "server" + nonce_c)

A wrong answer, garbage bytes, or silence past ``HANDSHAKE_TIMEOUT_S`` closes the connection before a
single byte reaches the store. This module must not know what is in the store.

Known gaps (documented in docs/reliability.md): the internal store port is reachable by other users of
the coordinator's host (loopback only); gloo's worker-to-worker data sockets are not authenticated.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.control.store.netif import split_address

log = logging.getLogger(__name__)

TOKEN_ENV = "UNBROKEN_TOKEN"
MIN_TOKEN_CHARS = 16
MAGIC = b"UNBROKEN/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not proved the token by then is closed
HANDSHAKE_TICK_S = 0.25  # while handshakes are pending, their deadlines are checked this often
MAX_PENDING = 128  # handshakes in progress; past it the oldest is dropped (a flood cannot lock workers out)
BUFFER_LIMIT = 4 * 2**20  # bytes queued towards one side before we stop reading from the other
CHUNK = 2**16


def new_token() -> str:
    """A fresh random job token (256 bits, hex)."""
    return secrets.token_hex(32)


def token_from_env() -> str | None:
    """``UNBROKEN_TOKEN`` if set; ValueError (one line) if it is too short to be a secret."""
    token = os.environ.get(TOKEN_ENV)
    if token is None or token == "":
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{TOKEN_ENV} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. {_HOW})")
    return token


_HOW = "export UNBROKEN_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')"


def require_token() -> str:
    """The job token from the environment; ValueError (one line) saying how to set it if it is missing."""
    token = token_from_env()
    if token is None:
        raise ValueError(f"{TOKEN_ENV} is not set; every process of a job needs the same secret token ({_HOW})")
    return token


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _mac(token: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), role + nonce, hashlib.sha256).digest()


class _Loop:
    """One selector thread that owns a set of sockets; other threads hand it work through ``call``."""

    def __init__(self, name: str) -> None:
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._closed = threading.Event()
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread (soon)."""
        self._calls.append(fn)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the wake-up pipe is full: the loop is awake anyway

    def _drain_wake(self, _mask: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def tick(self) -> None:
        """Called on the loop thread after every wake-up (handshake deadlines)."""

    def idle_timeout(self) -> float | None:
        """How long the loop may sleep when nothing happens: None (until a socket or ``call`` wakes it)
        unless ``tick`` has deadlines to watch. A loop shares the training cores: no idle wake-ups."""
        return None

    def _run(self) -> None:
        while not self._closed.is_set():
            for key, mask in self.sel.select(timeout=self.idle_timeout()):
                try:
                    key.data(mask)
                except Exception:  # noqa: BLE001 - one bad connection must not end the loop
                    log.exception("relay callback failed")
            while self._calls:
                try:
                    self._calls.popleft()()
                except Exception:  # noqa: BLE001
                    log.exception("relay call failed")
            self.tick()
        for key in list(self.sel.get_map().values()):
            _close(key.fileobj)  # type: ignore[arg-type]
        self.sel.close()

    def close(self) -> None:
        self._closed.set()
        self.call(lambda: None)
        self.thread.join(timeout=2.0)

    # -- pipes --------------------------------------------------------------------------------------
    def pipe(self, a: socket.socket, b: socket.socket, initial_to_b: bytes = b"") -> _Pipe:
        """Forward bytes both ways between ``a`` and ``b`` until either side closes (loop thread only)."""
        return _Pipe(self, a, b, initial_to_b)


def _register(sel: selectors.BaseSelector, sock: socket.socket, events: int, data: Any) -> None:
    """``sel.register``, after dropping a stale entry under the same descriptor: a socket closed while still
    registered leaves its number in the selector's map, and the kernel hands that number to the next socket
    (seen once in the suite: "FD 42 is already registered", and a worker could not join). The cause found was a
    second close of the store's listening descriptor (``connect.serve_store`` now leaves it to the store
    alone); the loop stays tolerant of any other socket closed behind its back."""
    try:
        sel.register(sock, events, data)
    except KeyError:
        sel.unregister(sock.fileno())  # the stale entry (the kernel dropped the closed one from epoll itself)
        sel.register(sock, events, data)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class _Side:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()  # bytes waiting to be written to this side
        self.events = 0
        self.received = 0  # bytes read from this side so far


class _Pipe:
    """Two non-blocking sockets joined together, with bounded buffers (backpressure, no busy loop)."""

    def __init__(self, loop: _Loop, a: socket.socket, b: socket.socket, initial_to_b: bytes) -> None:
        self.loop = loop
        self.a, self.b = _Side(a), _Side(b)
        self.closed = False
        for side in (self.a, self.b):
            side.sock.setblocking(False)
            side.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.b.out += initial_to_b
        for side in (self.a, self.b):
            _register(loop.sel, side.sock, selectors.EVENT_READ, lambda mask, s=side: self._on(s, mask))
            side.events = selectors.EVENT_READ
        self._flush(self.b)
        self._update()

    def _other(self, side: _Side) -> _Side:
        return self.b if side is self.a else self.a

    def _on(self, side: _Side, mask: int) -> None:
        if self.closed:
            return
        if mask & selectors.EVENT_READ:
            try:
                data = side.sock.recv(CHUNK)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self.close()
                return
            if data:
                side.received += len(data)
                other = self._other(side)
                other.out += data
                self._flush(other)
        if mask & selectors.EVENT_WRITE:
            self._flush(side)
        if not self.closed:
            self._update()

    def _flush(self, side: _Side) -> None:
        while side.out and not self.closed:
            try:
                sent = side.sock.send(side.out)
            except BlockingIOError:
                return
            except OSError:
                self.close()
                return
            del side.out[:sent]

    def _update(self) -> None:
        for side in (self.a, self.b):
            other = self._other(side)
            events = 0
            if len(other.out) < BUFFER_LIMIT:
                events |= selectors.EVENT_READ  # read only while the other side keeps up
            if side.out:
                events |= selectors.EVENT_WRITE
            if events == side.events:
                continue
            callback = lambda mask, s=side: self._on(s, mask)  # noqa: E731
            if not events:
                self.loop.sel.unregister(side.sock)
            elif not side.events:
                _register(self.loop.sel, side.sock, events, callback)
            else:
                self.loop.sel.modify(side.sock, events, callback)
            side.events = events

    def finish(self, last_to_a: bytes) -> None:
        """Close both sides, ``a`` having been given what was queued for it and then ``last_to_a`` (loop thread
        only). Nothing more is read from ``b``."""
        if self.closed:
            return
        try:
            self.a.sock.settimeout(1.0)  # a few bytes to a loopback peer: the kernel takes them at once
            self.a.sock.sendall(bytes(self.a.out) + last_to_a)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for side in (self.a, self.b):
            try:
                self.loop.sel.unregister(side.sock)
            except (KeyError, ValueError):
                pass
            _close(side.sock)


# ---------------------------------------------------------------------------------------------------------
# The coordinator's side


class _Handshake:
    def __init__(self, sock: socket.socket, peer: str, timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.buf = bytearray()
        self.deadline = time.monotonic() + timeout_s


class Gateway(_Loop):
    """Serves the public listening socket: admits token holders and pipes them to ``internal`` (HOST, PORT).

    Counters (``admitted``, ``rejected``, ``timed_out``, ``dropped``) are for tests and the run's logs.
    """

    def __init__(
        self,
        public: socket.socket,
        internal: tuple[str, int],
        token: str,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.public = public
        self.handshake_timeout_s = handshake_timeout_s
        self.internal = internal
        self.token = token
        self.pending: collections.OrderedDict[socket.socket, _Handshake] = collections.OrderedDict()
        self.admitted = self.rejected = self.timed_out = self.dropped = 0
        self._last_warning = 0.0
        super().__init__("gateway")
        public.setblocking(False)
        self.call(lambda: self.sel.register(public, selectors.EVENT_READ, self._accept))

    def _warn(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 5.0:  # a flood must not flood the log too
            self._last_warning = now
            counts = (self.admitted, self.rejected, self.timed_out)
            log.warning("%s (admitted %d, rejected %d, timed out %d)", text, *counts)

    def _accept(self, _mask: int) -> None:
        for _ in range(64):
            try:
                sock, addr = self.public.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            if len(self.pending) >= MAX_PENDING:
                oldest, _ = self.pending.popitem(last=False)
                self.dropped += 1
                self._drop(oldest)
            sock.setblocking(False)
            hs = _Handshake(sock, f"{addr[0]}:{addr[1]}", self.handshake_timeout_s)
            try:
                sock.send(MAGIC + hs.nonce)  # 43 bytes into an empty send buffer: sent whole
            except OSError:
                _close(sock)
                continue
            self.pending[sock] = hs
            _register(self.sel, sock, selectors.EVENT_READ, lambda mask, h=hs: self._on_handshake(h))

    def _drop(self, sock: socket.socket) -> None:
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        _close(sock)

    def _on_handshake(self, hs: _Handshake) -> None:
        try:
            data = hs.sock.recv(MAC_BYTES + NONCE_BYTES - len(hs.buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.pending.pop(hs.sock, None)
            self.rejected += 1
            self._drop(hs.sock)
            return
        hs.buf += data
        if len(hs.buf) < MAC_BYTES + NONCE_BYTES:
            return
        self.pending.pop(hs.sock, None)
        answer, client_nonce = bytes(hs.buf[:MAC_BYTES]), bytes(hs.buf[MAC_BYTES:])
        if not hmac.compare_digest(answer, _mac(self.token, b"client", hs.nonce)):
            self.rejected += 1
            self._drop(hs.sock)
            self._warn(f"refused a connection from {hs.peer}: it does not hold the job's token")
            return
        self.sel.unregister(hs.sock)
        try:
            hs.sock.send(_mac(self.token, b"server", client_nonce))
            store = socket.create_connection(self.internal, timeout=5.0)
        except OSError as e:
            log.warning("could not connect %s to the store: %s", hs.peer, e)
            _close(hs.sock)
            return
        self.admitted += 1
        self.pipe(hs.sock, store)

    def idle_timeout(self) -> float | None:
        return HANDSHAKE_TICK_S if self.pending else None

    def tick(self) -> None:
        now = time.monotonic()
        while self.pending:
            sock, hs = next(iter(self.pending.items()))
            if hs.deadline > now:
                break
            self.pending.popitem(last=False)
            self.timed_out += 1  # counted before the close a client (or a test) can observe
            self._drop(sock)
            self._warn(f"closed a connection from {hs.peer} that did not complete the handshake in time")


# ---------------------------------------------------------------------------------------------------------
# The clients' side


class TunnelError(ConnectionError):
    """The coordinator could not be reached or refused us (wrong token, not a coordinator)."""


class NothingListens(TunnelError):
    """The connection to the coordinator's address was refused: no process listens there (it is gone)."""


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def handshake(sock: socket.socket, token: str, address: str) -> None:
    """The client's half of the handshake on a connected blocking socket (with a timeout set)."""
    hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC) or len(hello) != len(MAGIC) + NONCE_BYTES:
        raise TunnelError(f"{address} is not an unbroken coordinator (unexpected greeting)")
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_mac(token, b"client", hello[len(MAGIC) :]) + client_nonce)
    proof = _recv_exactly(sock, MAC_BYTES)
    if len(proof) < MAC_BYTES:
        raise TunnelError(f"the coordinator at {address} refused this process's {TOKEN_ENV} (not the job's token)")
    if not hmac.compare_digest(proof, _mac(token, b"server", client_nonce)):
        raise TunnelError(f"the coordinator at {address} does not hold the job's token; refusing to talk to it")


_client_loop: _Loop | None = None
_client_lock = threading.Lock()


def _loop() -> _Loop:
    global _client_loop
    with _client_lock:
        if _client_loop is None:
            _client_loop = _Loop("store-tunnels")
        return _client_loop


def _owned_by_this_process(peer: tuple[str, int], listening: tuple[str, int]) -> bool:
    """True if the TCP connection from ``peer`` to ``listening`` (a tunnel's local address) was opened by this
    process: one of its descriptors is a socket bound to ``peer`` and connected to ``listening`` (Linux /proc).

    The tunnel's local end listens on a loopback address for one connection: this stops another local user from
    slipping in before our own store client connects. Each of this process's sockets is asked for its two ends,
    highest descriptors first (a guess only: the kernel reuses the lowest free number); the host's socket
    tables (/proc/net/tcp) are not read: they list every socket of the network namespace, which took the kernel
    tens of milliseconds a read with a thousand members on one machine, and can miss entries while they change.
    Without /proc there is no check."""
    try:
        fds = sorted((int(fd) for fd in os.listdir("/proc/self/fd")), reverse=True)
    except OSError:
        return True
    # A store client may use an IPv6 socket, which reaches 127.x.y.z as ::ffff:127.x.y.z.
    wanted_local = {(peer[0], peer[1]), (f"::ffff:{peer[0]}", peer[1])}
    wanted_remote = {(listening[0], listening[1]), (f"::ffff:{listening[0]}", listening[1])}
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except OSError:
            continue  # closed meanwhile
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getsockname()[:2] in wanted_local and sock.getpeername()[:2] in wanted_remote:
                    return True
            except OSError:
                continue  # not connected (a listener)
    return False


def _loopback_listener() -> socket.socket:
    """A non-blocking listening socket on a loopback address of its own: a random 127.x.y.z where the system
    routes all of 127/8 to itself (Linux), else 127.0.0.1.

    A store client connects to a tunnel by address and port and retries a refused connection until its timeout.
    One left behind by an earlier job of the same process (workers as threads, in tests) would otherwise reach a
    new tunnel that was given the old port number, take its one connection, and leave the new client refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((f"127.{secrets.randbelow(255)}.{secrets.randbelow(255)}.{1 + secrets.randbelow(254)}", 0))
    except OSError:
        sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.setblocking(False)
    return sock


class Tunnel:
    """A local port that leads, authenticated, to the coordinator: connect one TCPStore client to it."""

    def __init__(self, address: str, token: str, timeout_s: float) -> None:
        try:
            host, port = split_address(address)
        except ValueError:
            raise ValueError(f"--coordinator {address!r} is malformed; expected HOST:PORT") from None
        try:
            upstream = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            error = NothingListens if isinstance(e, ConnectionRefusedError) else TunnelError
            raise error(f"cannot reach the coordinator at {address}: {e.strerror or e}") from None
        try:
            upstream.settimeout(min(timeout_s, HANDSHAKE_TIMEOUT_S))
            handshake(upstream, token, address)
        except (OSError, TunnelError) as e:
            upstream.close()
            if isinstance(e, TunnelError):
                raise
            raise TunnelError(f"handshake with the coordinator at {address} failed: {e}") from None
        self.upstream = upstream
        self.listener = _loopback_listener()
        self.host, self.port = self.listener.getsockname()[:2]
        self.connected = False
        self.closed = False
        self.pipe: _Pipe | None = None
        self.loop = _loop()
        self.loop.call(lambda: self.loop.sel.register(self.listener, selectors.EVENT_READ, self._accept))

    def _accept(self, _mask: int) -> None:
        try:
            local, peer = self.listener.accept()
        except (BlockingIOError, OSError):
            return
        # Whose connection it is is read from /proc, which takes milliseconds in a process of thousands of
        # sockets; the loop relays every connection of this process (the heartbeats among them), so it is
        # looked up on a thread of its own and the loop goes on.
        threading.Thread(target=self._check, args=(local, peer), name="tunnel-accept", daemon=True).start()

    def _check(self, local: socket.socket, peer: tuple[str, int]) -> None:
        if _owned_by_this_process(peer, (self.host, self.port)):
            self.loop.call(lambda: self._pipe(local))
        else:
            log.warning("refused a local connection to the store tunnel from %s:%d (not this process)", *peer)
            _close(local)

    def _pipe(self, local: socket.socket) -> None:
        if self.connected or self.closed:  # one connection per tunnel
            _close(local)
            return
        self.loop.sel.unregister(self.listener)
        _close(self.listener)
        self.connected = True
        self.pipe = self.loop.pipe(local, self.upstream)

    def bytes_from_client(self) -> int:
        """The bytes the tunnel has read from its client so far (its requests, on their way to the coordinator)."""
        return self.pipe.a.received if self.pipe is not None else 0

    def close(self) -> None:
        """Forget the tunnel if no client connected (the pipe closes itself when either end does)."""
        self.loop.call(self._forget)

    def _forget(self) -> None:
        if not self.connected and not self.closed:
            self.closed = True
            try:
                self.loop.sel.unregister(self.listener)
            except (KeyError, ValueError):
                pass
            _close(self.listener)
            _close(self.upstream)

    def finish(self, last: bytes) -> None:
        """Close the tunnel, its client reading ``last`` before the end of the connection: bytes that end the call
        it is blocked in, where the caller knows which (``connect.end_wait``), so that the call returns
        instead of failing on a lost connection. Without a connected client it is ``close``."""

        def finish_now() -> None:
            if self.pipe is not None:
                self.pipe.finish(last)
            else:
                self._forget()

        self.loop.call(finish_now)

    def cut(self) -> None:
        """Sever the connection to the coordinator (failure injection: a cut network link)."""
        try:
            self.upstream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
