"""A job inside the test process: a real coordinator on a thread and workers as threads on real gloo groups.

The step protocol is an object (``unbroken.ft``), so its tests need no processes: each worker is a thread
running a user loop against ``ft.Context``; a worker "dies" by leaving its loop and going silent (its
heartbeats stop and the death is reported, as a launcher would report a process exit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.control.coordinator.loop import Coordinator
from unbroken.control.store.connect import bind_listen_socket, connect_store, report_death
from unbroken.control.store.gateway import new_token
from unbroken.core.config import RunConfig, dump_config
from unbroken.ft.api import Context
from unbroken.ft.process import Job, WorkerLeft


class Died(Exception):
    """Raised by a test's loop to make its worker die at that point."""


def _close_connections(ctx: Context) -> None:
    """A dead process's sockets close with it: drop the dead thread's group (its destructor closes its gloo
    connections, so a peer's collective with it fails now, as with a process killed). Left open, the group
    would be destroyed only when the interpreter exits, under a peer's group still waiting on it: gloo throws
    there, and the process aborts."""
    proto = ctx._proto
    if proto is not None:
        proto.membership.group = None


class ThreadJob:
    """A coordinator for ``workers`` workers; ``run(loop)`` runs ``loop(ctx, worker)`` on one thread each."""

    def __init__(self, run_dir: Path, cfg: RunConfig, workers: int) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir)
        self.token = new_token()
        sock = bind_listen_socket("127.0.0.1", 0)
        self.coordinator = Coordinator(sock, cfg, run_dir, workers, False, token=self.token)
        self._thread = threading.Thread(target=self.coordinator.run, name="coordinator", daemon=True)
        self._thread.start()
        self.workers = workers
        self.store = connect_store(self.coordinator.address, token=self.token)
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}

    def context(self, worker: int) -> Context:
        job = Job(self.coordinator.address, self.token, self.cfg, self.run_dir, worker, exit_process=False)
        return Context(job)

    def _worker(self, worker: int, loop: Callable[[Context, int], Any]) -> None:
        ctx = self.context(worker)
        try:
            self.results[worker] = loop(ctx, worker)
        except Died:
            ctx.close()  # its heartbeats stop; report the death as a launcher reports a process exit
            _close_connections(ctx)
            report_death(self.store, worker, "died in the test")
        except WorkerLeft as e:
            self.results[worker] = e
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.errors[worker] = e
        finally:
            ctx.close()

    def run(self, loop: Callable[[Context, int], Any], timeout_s: float = 120.0) -> dict[int, Any]:
        threads = [
            threading.Thread(target=self._worker, args=(w, loop), name=f"worker-{w}", daemon=True)
            for w in range(self.workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        if self.errors:
            raise next(iter(self.errors.values()))
        return self.results

    def close(self) -> None:
        self.coordinator.stopping.set()
        self._thread.join(timeout=10)
        self.coordinator.gateway.close()
