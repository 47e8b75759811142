"""How a host's processes start, and how the host waits on them without a polling loop.

Owns ``ProcessStarter`` (a process running the workers' command: forked by the host's zygote when the command can
be forked, else started cold; with the descriptors and environment every worker gets from its agent: the injection
pipe's write end, the host heartbeat board's slot), ``WakePipe`` (a pipe that ends a wait early) and
``wait_for_exit`` (a sleep on the processes' pidfds that ends at the first exit). It decides nothing about which
process to start or when: the supervisor and the spare pool do (``control.host.supervisor``, ``control.host.spares``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import time
from pathlib import Path

from unbroken.control.host import zygote
from unbroken.control.host.command import WorkerCommand
from unbroken.control.member.env import INJECT_FD_ENV
from unbroken.control.member.hostbeat import HOST_BEAT_ENV, HostBeats

log = logging.getLogger(__name__)

WorkerProcess = subprocess.Popen[bytes] | zygote.ForkedProcess


class WakePipe:
    """A pipe that ends a ``wait_for_exit`` early: another thread, a signal handler or a child process (given
    ``write_fd``) writes to it; the waiter empties it. Both ends are non-blocking: a full pipe already wakes it."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def fds(self) -> tuple[int, ...]:
        """The descriptor to wait on (none once closed)."""
        return (self.read_fd,) if self.read_fd >= 0 else ()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed (the waiter is gone)
            os.write(self.write_fd, b"!")

    def drain(self) -> bool:
        """Empty it; whether anything was written since the last drain."""
        woken = False
        while self.read_fd >= 0:
            try:
                if not os.read(self.read_fd, 4096):
                    break
            except BlockingIOError:
                break
            woken = True
        return woken

    def close(self) -> None:
        if self.read_fd >= 0:
            os.close(self.read_fd)
            os.close(self.write_fd)
            self.read_fd = self.write_fd = -1


def wait_for_exit(procs: list[WorkerProcess], timeout_s: float, readable: tuple[int, ...] = ()) -> None:
    """Sleep up to ``timeout_s``, waking as soon as one of ``procs`` exits (Linux pidfds; elsewhere a plain
    sleep) or one of the ``readable`` descriptors has data. The workers share the host's cores: a busy agent
    would slow them down. A process that exited is reaped here (``poll``, which sets its ``returncode``): the
    pidfd of an unreaped one stays readable and would end every later wait at once."""
    running = [p for p in procs if p.returncode is None]
    if any(p.poll() is not None for p in running):
        return  # one exited since the caller last looked
    fds: list[int] = []
    try:
        for p in running:
            fds.append(os.pidfd_open(p.pid))
        select.select([*fds, *readable], [], [], timeout_s)
    except (AttributeError, OSError):
        time.sleep(timeout_s)
    finally:
        for fd in fds:
            os.close(fd)
        for p in running:
            p.poll()


class ProcessStarter:
    """Starts processes running ``worker``'s command for this host, each with ``env`` and what the call adds, its
    output appended to a log in ``log_dir``.

    Args:
        own_sessions: True: each process in a session of its own (a terminal's Ctrl-C reaches only the launcher,
            which stops them in order); False: they share the agent's process group, so the host's loss (``kill -9``
            of the group) takes them all, as a machine that dies would.
        wake: the pipe a worker writes to once it reaches an injection point (``INJECT_FD_ENV``), if the run has a
            failure schedule.
        beats: the host's heartbeat board (``comm.heartbeats = "host"``), whose slot each process is given.
    """

    def __init__(
        self,
        worker: WorkerCommand,
        env: dict[str, str],
        log_dir: Path,
        own_sessions: bool = True,
        wake: WakePipe | None = None,
        beats: HostBeats | None = None,
    ) -> None:
        self.worker = worker
        self.env = env  # every process's environment, before what each start adds
        self.log_dir = log_dir
        self.own_sessions = own_sessions
        self.wake = wake
        self.beats = beats
        self.zygote: zygote.Zygote | None = None
        self._zygote_tried = False

    def start(self, env: dict[str, str], log_name: str, fds: tuple[int, ...] = ()) -> WorkerProcess:
        """A process running the workers' command with ``env``, ``fds`` handed on: forked by the zygote when it
        can, else started cold."""
        log_path = self.log_dir / log_name
        if self.wake is not None:
            env = {**env, INJECT_FD_ENV: str(self.wake.write_fd)}
            fds = (*fds, self.wake.write_fd)
        if self.beats is not None:
            env = {**env, HOST_BEAT_ENV: self.beats.env_for_new_process()}
        self.warm()
        argv = list(self.worker.argv)
        process = self.zygote.fork(argv, env, log_path, self.own_sessions, fds) if self.zygote else None
        if process is None:
            with open(log_path, "ab") as out:
                process = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=self.own_sessions,
                    env=env,
                    pass_fds=fds,
                )
        if self.beats is not None:
            self.beats.bind(env[HOST_BEAT_ENV], process)
        return process

    def warm(self) -> None:
        """Start the zygote that forks this host's processes (``control.host.zygote``), once, if they can be forked:
        its imports (``WorkerCommand.preload``) run while the caller goes on (start it before anything slow, e.g.
        the coordinator)."""
        if self._zygote_tried:
            return
        self._zygote_tried = True
        if zygote.forkable(self.worker, self.env) and zygote.enabled(self.env):
            try:
                self.zygote = zygote.Zygote(self.env, self.log_dir / "zygote.log", self.worker.preload)
            except OSError as e:
                log.warning("workers start cold: %s", e)

    def close(self) -> None:
        """End the zygote (the processes it forked are the agent's children and live on)."""
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
