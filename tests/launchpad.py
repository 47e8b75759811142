"""The tests' launcher fork server: ``unbroken`` command lines run by forking a process that has already imported
what a launcher imports, instead of starting one that imports torch again (2 to 4 s of CPU a run on this machine,
a few hundred runs a suite).

    python tests/launchpad.py SOCKET_PATH       # started by tests/runner.py, one per test process

It imports what ``unbroken train`` and its zygote import (``unbroken.control.host.zygote.PRELOAD``, the trainer's
``unbroken.train.launch.TRAINER_IMPORTS``, the CLI, the exact fold's kernels), starts no thread, and listens on a
Unix socket. Each request (one connection: a JSON line with argv, cwd and the environment, and the three standard
descriptors as ``SCM_RIGHTS``) is served by a forked
reporter, which forks the command's process, sends ``{"pid": N}``, waits for it and sends ``{"status": S}`` (as
``subprocess`` gives it: negative for a signal). The command's process takes the descriptors, the directory and
the environment, and runs ``python -m unbroken`` (``runpy``) with the request's arguments: from its first line on
it is the program a cold start runs, which then forks its own zygote (``zygote.fork_early``) as it would.

What a fork does not redo: the interpreter's start (its flags are this server's: none; ``PYTHONHASHSEED`` and the
environment read at import time are the test process's when the server started). tests/runner.py sends only its
own plain ``unbroken train`` runs here; a test of the program's cold start or of another environment starts it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import runpy
import signal
import socket
import sys

from unbroken.control.host.zygote import _PR_SET_PDEATHSIG, MESSAGE_BYTES, PRELOAD, _prctl
from unbroken.core.ending import run_then_exit
from unbroken.train.launch import TRAINER_IMPORTS


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request (a JSON line; the descriptors come with its first bytes)."""
    fds = array.array("i")
    data, ancillary, _flags, _addr = conn.recvmsg(MESSAGE_BYTES, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while data and not data.endswith(b"\n"):
        more = conn.recv(MESSAGE_BYTES)
        if not more:
            raise ValueError("the request ended before its end of line")
        data += more
    return json.loads(data), list(fds)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _reap(_signum: int, _frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def serve(path: str) -> dict:
    """Listen at ``path``; return the request in the command's process (forked twice), never in the server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # The reporters are reaped as they end (not left to the kernel: a waited child's CPU time, its command's
    # included, is counted in its parent's, so a suite's total under ``time`` still holds it).
    signal.signal(signal.SIGCHLD, _reap)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() != 0:
            conn.close()
            continue
        # The reporter.
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its command's process
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            os._exit(1)
        pid = os.fork()
        if pid == 0:
            conn.close()
            for fd, number in zip(fds, (0, 1, 2), strict=True):
                os.dup2(fd, number)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # a started program has the three only
            return request
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            _send(conn, {"status": os.waitstatus_to_exitcode(status)})
        finally:
            os._exit(0)


def main() -> None:
    (path,) = sys.argv[1:]
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the test process's end ends the server (not its runs)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import gc

    import unbroken.cli  # noqa: F401 - what every command imports
    from unbroken.ft import foldkernel

    for name in (*PRELOAD, *TRAINER_IMPORTS):
        __import__(name)
    foldkernel.warm()  # its kernels are not parallel: no thread is started
    gc.freeze()
    request = serve(path)
    # The command's process: from here on, ``python -m unbroken ARGS`` in the request's directory and environment.
    if request.get("new_session"):
        os.setsid()  # as ``Popen(start_new_session=True)``: ``os.killpg`` of its pid ends it and its children
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as ``python -m`` puts it (the server's is tests/)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["unbroken", *request["argv"]]
    # Ended as a forked worker is (without the interpreter's teardown, which copies the pages it shares).
    run_then_exit(_command)


def _command() -> None:
    runpy.run_module("unbroken", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
