"""The network a job runs on: the local address and interface on the route to its coordinator.

A host has several interfaces (loopback, often a management network beside the data network). A process that
tells its peers where to reach it must name the one its job uses: not the address its host name resolves to
(127.0.x.x in many /etc/hosts files, which no other host can reach) and not every interface. The job is
wherever the coordinator is reached from, so the interface that carries the route to the coordinator is the
job's. Workers point gloo's sockets at it (``GLOO_SOCKET_IFNAME``, torch's own setting) unless the user set
one; a job whose coordinator is on loopback stays on loopback.

Also here: a free port for a process to listen on (``free_port``), for the tests, benchmarks and local etcd
clusters that start listeners of their own.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import socket
import struct
from collections.abc import MutableMapping
from pathlib import Path

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError (one line) if malformed."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r} is malformed; expected HOST:PORT")
    return host.strip("[]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """The local address the kernel would send from to reach (host, port): the route's source (no packet sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # a datagram socket's connect only chooses the route
        return str(probe.getsockname()[0])


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on that interface
    return socket.inet_ntoa(answer[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address -> interface name, from /proc/net/if_inet6 (absent without IPv6)."""
    found: dict[str, str] = {}
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return found


def interface_with(address: str) -> str | None:
    """The name of the local interface that holds ``address``, or None if none does."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def job_interface(coordinator: str) -> tuple[str, str] | None:
    """(interface, local address) on the route to the first coordinator of ``coordinator`` (``HOST:PORT``, or
    a comma-separated list); None where that route is loopback or cannot be found."""
    host, port = split_address(coordinator.split(",")[0])
    try:
        local = local_address_towards(host, port)
    except OSError:
        return None  # no route (yet): gloo keeps its own choice
    if ipaddress.ip_address(local).is_loopback:
        return None
    name = interface_with(local)
    return (name, local) if name is not None else None


def use_job_interface(coordinator: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Point gloo at the job's interface unless the user chose one (``GLOO_SOCKET_IFNAME``); returns the
    interface gloo will use, or None for gloo's own choice (a job on loopback)."""
    if env.get(GLOO_INTERFACE_ENV):
        return env[GLOO_INTERFACE_ENV]
    found = job_interface(coordinator)
    if found is None:
        return None
    env[GLOO_INTERFACE_ENV] = found[0]
    return found[0]


# Where the ports ``free_port`` picks start: above the well-known and the commonly configured service ports.
QUIET_PORTS_FROM = 10_000


def free_port() -> int:
    """A TCP port free on every address a moment ago, chosen at random below the kernel's ephemeral range where
    there is one (Linux): no ``bind(0)`` and no outgoing connection (how gloo, the stores and the other processes
    of a test or benchmark get theirs) is given one of them, so only another explicit choice like this one can
    take it before the process it is meant for binds it. A port from ``bind(0)`` could be, and was (a
    coordinator exited with "address already in use" in a full suite)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low > QUIET_PORTS_FROM + 1000:
        for _ in range(1000):
            port = random.randrange(QUIET_PORTS_FROM, low)
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
