"""Starting a worker costs a fork, not an import.

Owns the zygote: one process per agent that has imported torch, ``torch._dynamo`` (which every torch optimizer
imports when it is built: 1.6 s of CPU on this machine) and what the agent's caller names for its workers
(``WorkerCommand.preload``: the built-in trainer, Hugging Face's model for an HF run, and the exact fold's numba
kernels loaded by a warm-up call when the run's reduction is exact: an fp32 worker never loads numba, 57 MiB of each
process), and has run nothing that starts a thread, OpenMP or CUDA; it forks each worker on request. A cold worker
spends about 4 s of CPU on imports before its first line of training; a forked one starts at its first line.

The worker is the zygote's grandchild: the zygote forks a child, which joins the session or process group the
worker must have and forks the worker, then exits; the worker starts once it has. Linux hands an orphan to its
nearest "subreaper": the agent marks itself one (``PR_SET_CHILD_SUBREAPER``), so a forked worker is the agent's own
child, as a started one is: its exit status, ``kill``, ``SIGSTOP`` and pidfd work the same (``ForkedProcess``).

A fork-safe command (the built-in trainer's: ``WorkerCommand.fork_safe``) is forked (``forkable``), and so is the
launcher's coordinator (``spawn_coordinator``), whose successor after a death is then forked too. Any other
command (a user's script) is started cold unless its launch says ``--fork``
(``UNBROKEN_ZYGOTE=scripts``): a forked process inherits the zygote's string-hash seed, so data seeded with Python's
``hash()`` (impure, and different in every process of a real cluster) would look pure on one host, and the data
check could not see it. ``UNBROKEN_ZYGOTE=0`` starts every worker cold.

``unbroken train`` and ``unbroken agent`` import torch for themselves, so their zygote is not started but forked
from them (``fork_early``), at the top of the command line's ``main``, before they have started a thread or touched a
device: it then imports only what they did not (``torch._dynamo``, the trainer), and a run imports torch once. The
forked zygote waits for its setup (environment, log, preload list: what the command line of a started one says) and
goes on as a started one does. A program that cannot fork it (threads started, CUDA initialised) starts it (``python -m
unbroken.control.host.zygote``).

A forked process (the zygote, a worker, a coordinator) ends without the interpreter's teardown
(``core.ending.run_then_exit``), which would copy most of the pages it shares with the zygote.

The wire, agent to zygote (a ``SOCK_SEQPACKET`` pair, one message each way per worker): a JSON request (argv,
environment, log file, session or process group, descriptors to hand on and the numbers they must have) with the
descriptors as ``SCM_RIGHTS``; the answer, ``{"pid": N}`` or ``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import gc
import importlib
import io
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from unbroken.control.host.command import WorkerCommand
from unbroken.control.member.env import FORKED_ENV, STARTED_AT_ENV, WORKER_ID_ENV
from unbroken.core.ending import run_then_exit

ZYGOTE_ENV = "UNBROKEN_ZYGOTE"  # "0": every worker starts cold; "scripts": a user's script's workers are forked too
FORK_SCRIPTS = "scripts"
PRELOAD = ("torch", "torch._dynamo", "torch.distributed")  # then the caller's (``WorkerCommand.preload``)
READY_TIMEOUT_S = 120.0  # the zygote's imports, on a loaded machine
MESSAGE_BYTES = 1 << 20
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
READY_LINE = "zygote ready: imports took {wall:.3f} s wall, {cpu:.3f} s CPU"
READY_PATTERN = r"zygote ready: imports took (?P<wall>[\d.]+) s wall, (?P<cpu>[\d.]+) s CPU"
_FD_HIGH = 1000  # received descriptors are parked above every number a worker is told to use


def ready_cost(log_path: Path) -> tuple[float, float] | None:
    """(wall, CPU) seconds the zygote logging to ``log_path`` took from its start to ready (its imports); None
    if it never got there."""
    for line in log_path.read_text(errors="replace").splitlines() if log_path.exists() else []:
        if match := re.fullmatch(READY_PATTERN, line):
            return float(match["wall"]), float(match["cpu"])
    return None


def forkable(worker: WorkerCommand, env: dict[str, str]) -> bool:
    """Whether the zygote forks workers running ``worker`` with ``env``: this interpreter running a fork-safe
    command (the built-in trainer's), or a script where ``env`` asks for it (``FORK_SCRIPTS``; see the module's
    doc)."""
    command = worker.argv
    if sys.platform != "linux" or len(command) < 2 or command[0] != sys.executable:
        return False
    if worker.fork_safe:
        return True
    script = not command[1].startswith("-")  # a script's path (any name), not an option of the interpreter's
    return env.get(ZYGOTE_ENV, os.environ.get(ZYGOTE_ENV)) == FORK_SCRIPTS and script


def enabled(env: dict[str, str]) -> bool:
    return env.get(ZYGOTE_ENV, os.environ.get(ZYGOTE_ENV, "1")) != "0"


def _prctl(option: int, value: int | ctypes.c_char_p) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def process_name(worker_id: str) -> str:
    """A forked worker's name (``ps -o comm``, ``top``, ``/proc/PID/comm``): its command line and ``/proc/PID/environ``
    are the zygote's, its name says which worker it is."""
    return f"unbroken w{worker_id}"


def worker_of(pid: int) -> int | None:
    """The worker id of process ``pid``, started cold (its environment says) or forked (its name says); None for
    any other process, or one that is gone."""
    proc = Path(f"/proc/{pid}")
    try:
        for item in (proc / "environ").read_bytes().split(b"\0"):
            if item.startswith(WORKER_ID_ENV.encode() + b"="):
                return int(item.split(b"=", 1)[1])
        name = (proc / "comm").read_text().strip()
    except (OSError, ValueError):
        return None
    prefix = process_name("")
    return int(name[len(prefix) :]) if name.startswith(prefix) and name[len(prefix) :].isdigit() else None


class ForkedProcess:
    """A worker forked by the zygote, now this process's child: what the agent uses of ``subprocess.Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped elsewhere: gone, and how is unknown
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The agent's end: starts the zygote (its imports run while the agent goes on) and asks it for workers."""

    def __init__(self, env: dict[str, str], log_path: Path, preload: tuple[str, ...] = ()) -> None:
        global _early
        early, _early = _early, None  # forked at this program's start (``fork_early``): used once, or dropped
        if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
            if early is not None:
                early.sock.close()
            raise OSError("cannot become a child subreaper")
        self.broken = False
        setup = {
            "env": {**env, STARTED_AT_ENV: repr(time.time())},
            "log": str(log_path),
            "preload": list(preload),
        }
        if early is not None:
            try:
                early.sock.send(json.dumps(setup).encode())
            except OSError:  # it is gone: start one
                early.sock.close()
            else:
                self.proc: subprocess.Popen[bytes] | ForkedProcess = ForkedProcess(early.pid)
                self.sock = early.sock
                return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "unbroken.control.host.zygote",
                    "--fd",
                    str(theirs.fileno()),
                    *(f"--preload={name}" for name in preload),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
                env=setup["env"],
            )
        theirs.close()
        self.sock = mine

    def fork(
        self, argv: list[str], env: dict[str, str], log_path: Path, new_session: bool, fds: tuple[int, ...] = ()
    ) -> ForkedProcess | None:
        """A worker running ``argv`` with ``env``, its output appended to ``log_path``, in a session of its own or
        in this process's group; ``fds`` keep their numbers in it. None if the zygote cannot (the caller starts
        the worker cold; the zygote is not asked again)."""
        if self.broken:
            return None
        request = {
            "argv": argv,
            "env": env,
            "log": str(log_path),
            "pgid": None if new_session else os.getpgid(0),
            "fds": list(fds),
        }
        try:
            self.sock.settimeout(READY_TIMEOUT_S)
            socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
            answer = json.loads(self.sock.recv(MESSAGE_BYTES) or b"{}")
        except (OSError, ValueError):
            answer = {}
        if "pid" not in answer:
            self.broken = True
            return None
        return ForkedProcess(int(answer["pid"]))

    def close(self) -> None:
        self.sock.close()  # the zygote ends at the end of its socket
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------------------
# The zygote process: ``python -m unbroken.control.host.zygote --fd N``


@dataclass(frozen=True)
class _Job:
    argv: list[str]
    env: dict[str, str]
    log: int  # the descriptor of its log, opened for appending
    fds: list[tuple[int, int]]  # (received descriptor, the number the worker expects)


def _serve(conn: socket.socket) -> _Job | None:
    """Answer requests until the agent closes its end (None: the zygote ends). Returns in a forked worker only."""
    while True:
        msg, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 16)
        if not msg:
            return None
        request: dict[str, Any] = json.loads(msg)
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read_end)
            worker = -1
            try:
                if request["pgid"] is None:
                    os.setsid()
                else:
                    os.setpgid(0, request["pgid"])
                # The log exists once the agent has its answer, as it does for a process it starts itself.
                log = _open_log(request["log"])
                gate, gate_held = os.pipe()  # held open by this child alone: closed when it exits
                intermediate = os.getpid()  # not the worker's getppid(): by its first line this child may be gone
                worker = os.fork()
            except OSError as e:
                os.write(write_end, json.dumps({"error": str(e)}).encode())
                os._exit(1)
            if worker == 0:
                os.close(write_end)
                os.close(gate_held)
                # Start once this child has exited and the agent is the parent: a process that watches its
                # parent (the coordinator stops the job when the launcher dies) must never see this one. Its
                # exit closes the gate before it hands its children to the agent: wait for that too.
                os.read(gate, 1)
                os.close(gate)
                deadline = time.monotonic() + READY_TIMEOUT_S
                while os.getppid() == intermediate and time.monotonic() < deadline:
                    time.sleep(0.001)
                conn.detach()  # its descriptor is closed with the others (``_become``)
                handed = list(zip(fds, request["fds"], strict=True))
                return _Job(request["argv"], request["env"], log, handed)
            os.write(write_end, json.dumps({"pid": worker}).encode())
            os._exit(0)
        os.close(write_end)
        answer = b""
        while chunk := os.read(read_end, 4096):
            answer += chunk
        os.close(read_end)
        os.waitpid(child, 0)  # the child is gone: the worker now belongs to the agent (the subreaper)
        for fd in fds:
            os.close(fd)
        conn.send(answer or json.dumps({"error": "the fork failed"}).encode())


def _open_log(path: str) -> int:
    """A process's log, created if needed, opened for appending (a descriptor)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _become(job: _Job) -> None:
    """In the forked worker: its output to its log, only the descriptors it was given, its environment."""
    os.dup2(job.log, 1)
    os.dup2(job.log, 2)
    parked = [(fcntl.fcntl(fd, fcntl.F_DUPFD, _FD_HIGH), number) for fd, number in job.fds]
    os.closerange(3, _FD_HIGH)
    for fd, number in parked:
        os.dup2(fd, number)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(job.env)
    os.environ[FORKED_ENV] = "1"
    os.write(2, f"started by a fork of the agent's zygote (pid {os.getpid()})\n".encode())
    if (worker := job.env.get(WORKER_ID_ENV)) is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(process_name(worker).encode()[:15]))


def _run(argv: list[str]) -> None:
    """What ``python ARGV[1:]`` would run, as ``__main__``: ``-m module [args]`` or ``script [args]``."""
    if argv[1] == "-m":
        sys.argv = [argv[0], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")


@dataclass(frozen=True)
class _Early:
    pid: int
    sock: socket.socket  # the program's end: the setup goes here, then the requests


_early: _Early | None = None  # in a program that forked its zygote early, until its ``Zygote`` takes it
_early_conn: socket.socket | None = None  # in that zygote: its end


def fork_early() -> bool:
    """Fork this program's zygote now, if it can be forked (Linux, no thread of this program's own started, no
    CUDA initialised, ``UNBROKEN_ZYGOTE`` not 0). Call it from the program's ``main``, after the imports the program
    needs anyway (torch), before anything else. Returns False in the program, whose first ``Zygote`` then uses this
    one instead of starting one; True in the forked zygote, whose ``main`` must return ``serve_early()`` at once."""
    global _early, _early_conn
    if sys.platform != "linux" or not enabled(dict(os.environ)) or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    if torch is None or torch.cuda.is_initialized():
        return False
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    program = os.getpid()
    pid = os.fork()
    if pid == 0:
        mine.close()
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the program's death ends it, as it ends a started one
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as ``_zygote`` says
        if os.getppid() != program:  # the program died before the line above
            os._exit(0)
        _early_conn = theirs
        return True
    theirs.close()
    _early = _Early(pid, mine)
    return False


def serve_early() -> NoReturn:
    """In a zygote forked by ``fork_early``: wait for its setup (none: the program ended without needing it), take
    the environment, output and descriptors a started one would have, and go on as one (``_zygote``)."""
    conn = _early_conn
    if conn is None:
        raise RuntimeError("serve_early() outside a zygote forked by fork_early()")
    try:
        setup = json.loads(conn.recv(MESSAGE_BYTES) or b"null")
    except (OSError, ValueError):
        setup = None
    if setup is None:
        run_then_exit(lambda: None)
    log = _open_log(setup["log"])
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, number in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, number)
    keep = conn.fileno()
    os.closerange(3, keep)  # the program's descriptors (its listening socket, pipes) are not the zygote's
    os.closerange(keep + 1, _FD_HIGH)
    os.environ.clear()
    os.environ.update(setup["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        # What the interpreter does at start for a started zygote: its workers' output is not held in a buffer.
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            raw = io.FileIO(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, stream.encoding, stream.errors, write_through=True))
    print(f"zygote forked from its program (pid {os.getppid()})", flush=True)
    return _zygote(conn, tuple(setup["preload"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unbroken.control.host.zygote", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="this end of the agent's socket pair")
    what = "a module its workers import (import it first), or MODULE:FUNCTION (import it, call the function)"
    parser.add_argument("--preload", action="append", default=[], help=what)
    args = parser.parse_args(argv)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the agent's death ends the zygote (its workers go on)
    return _zygote(socket.socket(fileno=args.fd), tuple(args.preload))


def _preload(name: str) -> None:
    """Import module ``name``, or for ``module:function`` import it and call the function (a warm-up, such as the
    exact fold's kernels: not parallel, so no thread is started). A module that cannot be imported stops nothing:
    each worker imports it again and says what is wrong in its own words."""
    module, _, function = name.partition(":")
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        print(f"zygote: {module} not preloaded ({e})", flush=True)
        return
    if function:
        getattr(loaded, function)()


def _zygote(conn: socket.socket, preload: tuple[str, ...] = ()) -> NoReturn:
    """The zygote, started or forked early: its imports (``PRELOAD``, then ``preload``: what this run's workers import
    and warm up beyond, such as the trainer, Hugging Face's model or the exact fold's kernels), then requests until its
    program closes the socket. Ends the process (``run_then_exit``), the zygote's when it is done and each worker's
    when its program has run."""
    # A terminal's Ctrl-C reaches the launcher's process group, the zygote's too: the launcher stops the job in
    # order, and the zygote must live on to serve that job's restarts (a worker gets Python's handler back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in PRELOAD:
        __import__(name)
    for name in preload:
        _preload(name)
    # What the zygote holds now lives as long as every worker: out of the collector's reach, so that a worker's
    # collections neither walk it nor copy its pages (Python's advice for a process that forks without exec).
    gc.freeze()
    print(READY_LINE.format(wall=time.time() - float(os.environ[STARTED_AT_ENV]), cpu=time.process_time()), flush=True)
    job = _serve(conn)
    if job is None:
        run_then_exit(lambda: None)
    _become(job)
    run_then_exit(lambda: _run(job.argv))


if __name__ == "__main__":
    sys.exit(main())
