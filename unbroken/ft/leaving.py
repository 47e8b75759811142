"""How a worker leaves the job: a decision to stop, a lost connection, an exception of the user's code.

Owns ``Leaving``, what stands between the user's loop and every call into the protocol (``guard``): a
``StopRun`` (the job stops, this worker was excluded or cut off, an invariant broke) or a broken connection
to the coordinator ends this worker with the status the launcher expects, after saying why, telling the
others if the job must stop, and saving the state where the coordinator asks it to (``save_at_stop``) or is
gone (``stop_without_coordinator``); the user's code never sees either. An exception of the user's code that
nothing catches (``crash``) is reported to the coordinator with where it was raised before the worker ends
(``report_crash``). A replica of several ranks whose ranks cannot go on together leaves at once
(``replica_down``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from unbroken.control.member.client import CoordinatorClient
from unbroken.control.store.gateway import TunnelError
from unbroken.core import ckptfiles
from unbroken.core.records import ErrorPhase, RecordKind, make
from unbroken.ft import crash, determinism
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.process import Job
from unbroken.ft.protocol import StepProtocol
from unbroken.ft.stops import EXIT_COORDINATOR_LOST, EXIT_STOPPED, StopRun

if TYPE_CHECKING:
    from unbroken.ft.parallel.replica import Replica

log = logging.getLogger(__name__)

_CONTROL_PLANE = str(Path(__file__).resolve().parent.parent / "control") + os.sep


class Leaving:
    """How this worker (of ``job``) leaves. ``where()``: where the user's code is when it raises (the phase, the
    step, the microbatch); ``close()``: stops the heartbeats and watchers. ``client``, ``proto`` and
    ``replica`` are set as the worker registers, joins and forms its replica."""

    def __init__(
        self, job: Job, where: Callable[[], tuple[ErrorPhase, int, int | None]], close: Callable[[], None]
    ) -> None:
        self.job = job
        self.run_dir = job.run_dir
        self.heartbeat_timeout_s = job.config.comm.heartbeat_timeout_s
        self.where = where
        self.close = close
        self.client: CoordinatorClient | None = None
        self.proto: StepProtocol | None = None
        self.replica: Replica | None = None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around every call into the protocol: a decision to stop, or a broken connection to the coordinator,
        ends this worker (``leave``); the user's code never sees either."""
        try:
            yield
        except StopRun as e:
            self.leave(e)
        except (RuntimeError, TunnelError) as e:
            if self.replica is not None:
                self.replica.collective_failed(e)  # leaves if the replica is down (a replica-mate died)
            if not self._connection_error(e):
                raise
            self.leave(StopRun(str(e).splitlines()[0] if str(e) else type(e).__name__))

    def _connection_error(self, e: Exception) -> bool:
        """A store call failed (the connection to the coordinator broke), as opposed to a bug: only an error
        raised by a call into the control plane is looked into (a ``RuntimeError`` of the user's backward or
        optimizer ends the worker as the bug it is, at once)."""
        client = self.client
        if client is None or not _raised_by_control_plane(e):
            return False
        return client.wait_lost(self.news_s) is not None

    @property
    def news_s(self) -> float:
        """How long a failure takes at most to become news to the membership: a dead worker's agent reports its
        exit at once, a lost host or coordinator is found by silence (the heartbeat timeout), and one more
        heartbeat timeout and a second for the decision to reach this worker."""
        return 2 * self.heartbeat_timeout_s + 1.0

    def leave(self, e: StopRun) -> NoReturn:
        """This worker stops: say why, tell the others if the job must stop, and end (``Job.leave``)."""
        client, proto = self.client, self.proto
        code = e.code
        if client is not None and client.lost == "coordinator":
            line = stop_without_coordinator(proto, self.run_dir)
            log.error("%s", line)
            code = EXIT_COORDINATOR_LOST
        elif client is not None and client.lost == "cut":
            log.error("stopping: %s; leaving the job (the others go on without this worker)", client.stopped)
            code = EXIT_STOPPED
        elif client is not None and client.done():
            log.info("the run finished before this worker could take part; leaving")
            code = 0
        else:
            log.error("stopping: %s", e)
            if e.fatal and client is not None:
                # The records published so far (the last committed step's) reach the file whoever stops first.
                client.flush_metrics(timeout_s=5.0)
            if e.fatal and client is not None and client.stopped is None:
                group = proto.membership.group if proto is not None else None
                if e.shared and group is not None and group.rank != 0:
                    # The leader saw the same; it stops the job once its records are out. If it died
                    # meanwhile, stop it from here.
                    client.wait_stopped(2 * self.heartbeat_timeout_s)
                if client.stopped is None:
                    client.stop_job(str(e))  # the coordinator records why (the first reason given)
            if client is not None and client.stopped is not None and client.named_to_save():
                client.tell_saved(save_at_stop(proto, self.run_dir))
        self.close()
        self.job.leave(code)
        raise AssertionError("leave() returned")  # pragma: no cover

    def replica_down(self, reason: str) -> NoReturn:
        """This rank's replica is down: end the process now (any thread; the replica restarts whole)."""
        log.error("leaving: %s", reason)
        self.job.leave(EXIT_STOPPED)
        raise AssertionError("leave() returned")  # pragma: no cover

    def report_crash(self, error: Exception) -> None:
        """``error`` ends this worker (nothing caught it): tell the coordinator what and where (``crash``), after
        the records already queued. An op without a deterministic implementation is no bug of the user's code
        but of the run's settings, the same on every worker: the job stops at once with the line that says so."""
        op = determinism.nondeterministic_op(error)
        if op is not None:
            self.leave(StopRun(determinism.stop_line(op), shared=True))
        client = self.client
        worker = client.worker_id if client is not None else self.job.worker_id
        report = crash.describe(error, -1 if worker is None else worker, *self.where())
        if client is not None:
            client.flush_metrics(timeout_s=2.0)
            told = client.report_error(report)
        else:
            told = self.job.report_error(report)
        if not told:
            log.error("could not tell the coordinator of this exception; ending")
            return
        log.info("the coordinator was told of this exception")
        if client is not None:
            # Its answer comes at once: a new epoch without this worker, or a stop for a bug, which may name this
            # worker to save the state it holds (nobody who did not raise is left).
            client.wait_removed(2 * self.heartbeat_timeout_s)
            if client.stopped is not None and client.named_to_save():
                client.tell_saved(save_at_stop(self.proto, self.run_dir))


def _raised_by_control_plane(e: BaseException) -> bool:
    """Whether ``e`` was raised inside a call into the control plane (a store call, a new connection)."""
    return isinstance(e, TunnelError) or any(
        os.path.realpath(frame.f_code.co_filename).startswith(_CONTROL_PLANE)
        for frame, _ in traceback.walk_tb(e.__traceback__)
    )


def save_at_stop(proto: StepProtocol | None, run_dir: Path) -> str:
    """The coordinator stopped the job for a bug in the user's code and named this worker, which holds a good
    state (the last committed step, bitwise every member's), to keep it: save it unless its checkpoint (or a
    newer one) is on disk already. Returns the words naming the last good checkpoint."""
    saved = ckpt.list_checkpoints(run_dir)
    if proto is not None and proto.ctx.replica is None and proto.state.step > max(saved, default=0):
        step, t0 = proto.state.step, time.perf_counter()
        try:
            path = ckpt.save_checkpoint(run_dir, step, proto.state.snapshot(), proto.cfg.checkpoint_keep)
        except OSError as e:
            log.error("could not save the state of step %d: %s", step, e)
        else:
            seconds = time.perf_counter() - t0
            log.info("saved the state of step %d (%s) before leaving", step, path)
            record = make(RecordKind.CHECKPOINT, time.time(), step=step, path=str(path), seconds=seconds)
            proto.ctx.client.publish_metrics(record)
            proto.ctx.client.flush_metrics(timeout_s=5.0)
    return ckptfiles.last_checkpoint_words(run_dir)


def stop_without_coordinator(proto: StepProtocol | None, run_dir: Path) -> str:
    """The coordinator is gone: no membership can change any more, so the job stops. The leader of this
    worker's group checkpoints the last committed state (every member holds it, bitwise) and writes the
    metrics records the coordinator did not drain. Returns the line to log."""
    hint = f"continue with: unbroken train --resume {run_dir}"
    if proto is None or proto.membership.group is None or not proto.membership.leader or proto.state.step <= 0:
        return f"the coordinator is gone; stopping (the leader checkpoints the last committed step); {hint}"
    membership, step = proto.membership, proto.state.step
    saved = ckpt.list_checkpoints(run_dir)
    if saved and saved[0] >= step:
        path = ckpt.checkpoint_path(run_dir, saved[0])
    elif proto.ctx.replica is not None:  # the ranks of the leading replica, together
        proto.checkpoints.write()
        path = ckpt.sharded_path(run_dir, step)
    else:
        path = ckpt.save_checkpoint(run_dir, step, proto.state.snapshot(), proto.cfg.checkpoint_keep)
    membership.append_undrained({"type": "coordinator_lost", "step": step, "path": str(path), "time": time.time()})
    return f"the coordinator is gone; saved the state of step {step} ({path}); {hint}"
