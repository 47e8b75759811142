"""Hosts that are really separate, on one machine, for tests and benchmarks: one Linux network namespace per host,
each with its own address on a bridge that lives in a namespace of its own (nothing is routed to or from the
machine's network), and a link per host that can be cut (``ip link set ... down``) and mended.

A process started with ``Network.popen(host, ...)`` sees only its host's interfaces: its loopback (which no other
host reaches) and ``eth0``, its address on the bridge. Cutting a host's link leaves its processes alive and
unreachable, as a failed switch port or cable would: no reset reaches either side, packets are simply lost.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; ``unavailable()`` says why not where not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces for a test, or None if it can (it tries one)."""
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    name = f"ubprobe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "add", "br0", "type", "bridge")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"this machine refused a network namespace with a bridge ({e})"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


class Network:
    """Hosts ``names`` on one bridge: host i has address ``10.<net>.0.<i + 1>`` on its ``eth0``; with
    ``observer``, the test's own (root) namespace has ``10.<net>.0.254`` on the bridge too."""

    def __init__(self, names: list[str], observer: bool = False) -> None:
        tag = uuid.uuid4().hex[:6]
        self.prefix = f"ub{tag}"
        self.hub = f"{self.prefix}-hub"
        self.names = list(names)
        subnet = int(tag[:2], 16) % 200 + 20  # two suites on one machine pick different subnets (most of the time)
        self.address = {name: f"10.{subnet}.0.{i + 1}" for i, name in enumerate(names)}
        self.processes: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        # The test's own process on the bridge too (address .254), to watch from outside (etcd's health, say).
        self.observer = f"10.{subnet}.0.254" if observer else None
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _port(self, host: str) -> str:
        return f"{self.prefix}{self.names.index(host)}"  # the hub's end of the host's link (<= 15 characters)

    def _make(self) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for host in self.names:
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Made inside the hub, its peer moved into the host: no interface is ever left in the root namespace.
            _ip("-n", self.hub, "link", "add", self._port(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", self._port(host), "master", "br0")
            _ip("-n", self.hub, "link", "set", self._port(host), "up")
            _ip("-n", ns, "addr", "add", f"{self.address[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        if self.observer is not None:
            # The root namespace's end is removed with the hub's, when the hub's namespace is deleted.
            _ip("-n", self.hub, "link", "add", f"{self.prefix}o", "type", "veth", "peer", "name", f"{self.prefix}r",
                "netns", "1")  # fmt: skip
            _ip("-n", self.hub, "link", "set", f"{self.prefix}o", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"{self.prefix}o", "up")
            _ip("addr", "add", f"{self.observer}/24", "dev", f"{self.prefix}r")
            _ip("link", "set", f"{self.prefix}r", "up")

    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the bridge: its processes run on, and no packet reaches or leaves it."""
        _ip("-n", self.hub, "link", "set", self._port(host), "down")

    def mend(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._port(host), "up")

    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (in a session of its own), stdout and stderr to ``log``."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command(host, argv), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.processes.append(proc)
        return proc

    def run(self, host: str, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout_s)

    def kill_host(self, host: str) -> None:
        """``kill -9`` of every process in ``host``'s namespace: a host that dies."""
        for pid in self._pids(self.namespace(host)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @staticmethod
    def _pids(ns: str) -> list[int]:
        result = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in result.stdout.split()]

    def close(self) -> None:
        """Kill whatever still runs in the hosts, then remove every namespace (and with them the links)."""
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self._made:
            for pid in self._pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        for ns in reversed(self._made):
            while subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode != 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
