"""``core.ending``: a process ended without the interpreter's teardown ends as a program does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENDING = """
import atexit, os, sys, threading, time
from unbroken.core.ending import run_then_exit
def program(how):
    atexit.register(lambda: sys.stdout.write("left in the buffer\\n"))  # the last handler: the end must flush it
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.2)
        print("the non-daemon thread finished", flush=True)
    threading.Thread(target=late).start()
    if how == "status":
        sys.exit(3)
    if how == "message":
        sys.exit("a one-line reason")
    if how == "raise":
        raise RuntimeError("a crash")

if sys.argv[2] == "started":
    run_then_exit(lambda: program(sys.argv[1]))
pid = os.fork()
if pid == 0:
    run_then_exit(lambda: program(sys.argv[1]))
_, status = os.waitpid(pid, 0)
print(f"\\nstatus {os.waitstatus_to_exitcode(status)}")
"""


@pytest.mark.parametrize("process", ["forked", "started"])
@pytest.mark.parametrize(("how", "status"), [("return", 0), ("status", 3), ("message", 1), ("raise", 1)])
def test_a_process_ends_as_a_program_does(process: str, how: str, status: int) -> None:
    """``run_then_exit`` skips only the interpreter's teardown: the program's exit status, its non-daemon threads,
    its atexit handlers and its buffered output are what a program's end gives them (a crash is reported as the
    interpreter reports one), in a forked process and in a started one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # its output held in a buffer
    cmd = [sys.executable, "-c", ENDING, how, process]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    lines = result.stdout.splitlines()
    if process == "started":
        assert result.returncode == status, (result.stdout, result.stderr)
        lines.append(f"status {status}")
    assert lines[-1] == f"status {status}", (result.stdout, result.stderr)
    # the thread is waited for, then the atexit handlers run (the interpreter's order), then the output is flushed
    assert lines[:3] == ["the non-daemon thread finished", "atexit ran", "left in the buffer"], result.stdout
    if how == "message":
        assert "a one-line reason" in result.stderr
    if how == "raise":
        assert "RuntimeError: a crash" in result.stderr
