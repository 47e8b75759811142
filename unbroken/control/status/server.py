"""The read-only status server of a run (``StatusServer``): a page and a JSON endpoint on a port of its own.

Owns how the live view (``control.status.model.RunView``, or anything with its ``snapshot`` and ``wait_for``)
leaves the coordinator: the HTTP routes, who may read them, and the resources a reader may hold. It reads
the view and the page's static files (``static/``, package data) and nothing else; it writes nothing.

``StatusServer`` serves, on a port of its own (loopback unless told otherwise):

    GET /                       the page (static/index.html; draws the snapshot with the vendored uPlot)
    GET /api/status             the snapshot as JSON; ``?since=SEQ&wait=S`` answers as soon as a record
                                newer than SEQ was folded, or after S seconds (at most ``MAX_WAIT_S``)
    GET /static/NAME            the page's script, style and the vendored chart library (no run data)

Access: a client on the loopback interface that names the server by an IP literal or ``localhost`` is
trusted; any other client must present the job's token (``UNBROKEN_TOKEN``) as ``Authorization: Bearer
TOKEN`` or as ``?token=TOKEN`` (compared with ``hmac.compare_digest``); otherwise 401. Checking the Host
header keeps a web page in the operator's own browser from reading the status through DNS rebinding. Only
GET and HEAD exist (anything else is 501); the static files come from a fixed table (no path is ever joined
from a request); a token in a query string never reaches a log line.

Why the standard library's ``http.server`` and not a web framework: the server has three read-only GET
routes, no templates, forms or sessions, and runs as one daemon thread inside the coordinator, which is a
synchronous, thread-based program with no event loop to host (tornado, aiohttp or starlette/uvicorn would
bring one, and with them a dependency that every cluster image must carry for a page). What a framework
would add is routing (a dict here); what the stdlib server lacks for this use is bounded resources, and this
module adds it: a socket timeout per request (``REQUEST_TIMEOUT_S``), at most ``MAX_CLIENTS`` requests in
flight (more get 503 at once), HTTP/1.0 (no idle keep-alive connections holding threads), and no access log
with query strings. The house style makes the same choice for config (``tomllib`` and a short override
parser over tyro or Hydra), and the job's gateway is stdlib sockets too.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

MAX_WAIT_S = 25.0  # the longest a long-poll (``wait=``) is held
REQUEST_TIMEOUT_S = 10.0  # a client that stalls while sending its request is dropped after this
MAX_CLIENTS = 32  # requests served at once (each holds a thread, a long-poll for up to MAX_WAIT_S)

STATIC_FILES: dict[str, str] = {  # name under unbroken/control/status/static -> content type
    "index.html": "text/html; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
}


class StatusSource(Protocol):
    """What ``StatusServer`` serves: ``RunView`` is one."""

    def snapshot(self) -> dict[str, Any]: ...

    def wait_for(self, seq: int, timeout_s: float) -> None: ...


# -- the server ---------------------------------------------------------------------------------------------
def is_trusted_local(client_ip: str, host_header: str | None) -> bool:
    """A loopback client that names the server by an IP literal or ``localhost`` (a DNS name that resolves
    to 127.0.0.1 is how a foreign web page in the operator's browser would reach it)."""
    try:
        ip = ipaddress.ip_address(client_ip)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_loopback:
        return False
    if host_header is None:
        return True  # HTTP/1.0 without Host: not a browser
    host = host_header.strip()
    host = host[1 : host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    if host.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _load_static() -> dict[str, bytes]:
    folder = resources.files("unbroken.control.status").joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in STATIC_FILES}


_TOKEN_IN_TEXT = re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S
    server_version = "unbroken-status"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path.startswith("/static/"):
            name = url.path.removeprefix("/static/")
            if name not in STATIC_FILES:
                return self._send(404, b"not found\n", "text/plain; charset=utf-8", body)
            return self._send(200, self.server.static[name], STATIC_FILES[name], body)
        if not self._authorized(query):
            self._send(401, b"the job's token is required\n", "text/plain; charset=utf-8", body, auth=True)
            return
        if url.path in ("/", "/index.html"):
            return self._send(200, self.server.static["index.html"], STATIC_FILES["index.html"], body)
        if url.path == "/api/status":
            try:
                since = int(query.get("since", ["-1"])[0])
                wait = min(MAX_WAIT_S, max(0.0, float(query.get("wait", ["0"])[0])))
            except ValueError:
                return self._send(400, b"since and wait must be numbers\n", "text/plain; charset=utf-8", body)
            if body and wait > 0 and since >= 0:
                self.server.source.wait_for(since, wait)
            data = json.dumps(self.server.source.snapshot(), allow_nan=False, separators=(",", ":")).encode()
            return self._send(200, data, "application/json", body)
        self._send(404, b"not found\n", "text/plain; charset=utf-8", body)

    def _authorized(self, query: dict[str, list[str]]) -> bool:
        if self.server.trusted(self.client_address[0], self.headers.get("Host")):
            return True
        token = self.server.token
        if not token:
            return False  # no token configured: only trusted local clients
        given = None
        auth = self.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        elif "token" in query:
            given = query["token"][0]
        return given is not None and hmac.compare_digest(given.encode(), token.encode())

    def _send(self, code: int, data: bytes, content_type: str, body: bool, auth: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        if auth:
            self.send_header("WWW-Authenticate", 'Bearer realm="unbroken"')
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("status %s: %s", self.client_address[0], _TOKEN_IN_TEXT.sub(r"\1<redacted>", format % args))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # closing does not wait for long-polls

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        source: StatusSource,
        token: str | None,
        trusted: Callable[[str, str | None], bool],
        max_clients: int,
    ) -> None:
        self.address_family = family
        self.source = source
        self.token = token
        self.trusted = trusted
        self.static = _load_static()
        self.slots = threading.BoundedSemaphore(max_clients)
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host's name up (socket.getfqdn): a reverse DNS query that can hang
        # for seconds on a cluster without DNS. The name is only used in CGI variables; skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 5\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("status: request from %s failed", client_address[0], exc_info=True)  # a client that went away


class StatusServer:
    """The read-only status page and JSON endpoint of one run, served from a daemon thread.

    Args:
        source: what to serve (a ``RunView``).
        host: the interface to listen on; 127.0.0.1 by default (0.0.0.0 or :: for every interface).
        port: 0 for any free port (``address`` says which).
        token: the job's token (``UNBROKEN_TOKEN``); clients other than trusted local ones must present it.
            None: only trusted local clients are served.
        trusted: ``(client_ip, host_header) -> bool``, the clients served without the token
            (``is_trusted_local``; tests inject another).
        max_clients: requests served at once; more are answered 503.

    Raises:
        ValueError: the port is taken or the host is not an address of this machine.
    """

    def __init__(
        self,
        source: StatusSource,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        trusted: Callable[[str, str | None], bool] = is_trusted_local,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._server = _Server((host, port), family, source, token, trusted, max_clients)
        except OSError as e:
            raise ValueError(f"status page: cannot listen on {host}:{port}: {e.strerror}") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``HOST:PORT`` as ``unbroken status`` takes it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/"

    def start(self) -> StatusServer:
        """Serve from a daemon thread; returns self."""
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-server", daemon=True)
        self._thread.start()
        log.info("status page on %s", self.url)
        return self

    def close(self) -> None:
        """Stop serving (returns within half a second; long-polls in flight are abandoned)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> StatusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
