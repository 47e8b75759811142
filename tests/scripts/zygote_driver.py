"""Drives a real zygote from a process of its own (it becomes a child subreaper, which a pytest process must not):
forks ``zygote_child.py`` with the arguments the test gives, and prints what the test checks, as JSON.

``zygote_driver.py OUT started``: the zygote is started (``python -m unbroken.control.host.zygote``);
``OUT early``: it is forked from this process at the top of ``main``, as ``unbroken train`` forks its own
(``fork_early``)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

from unbroken.control.host import zygote as zygotes
from unbroken.control.host.zygote import Zygote


def main() -> int:
    out, how = Path(sys.argv[1]), sys.argv[2]
    early = None
    if how == "early":
        import torch  # noqa: F401 - what the program imports before it forks its zygote

        if zygotes.fork_early():
            return zygotes.serve_early()  # the zygote, and each process it forks
        assert zygotes._early is not None
        early = zygotes._early.pid
    child = str(Path(__file__).with_name("zygote_child.py"))
    # What its caller names for the workers (the trainer, an HF run's model): one module that exists, one that does
    # not, and a warm-up call (the exact fold's kernels in a real run; here one whose effect a forked worker sees).
    preload = ("wave", "no_such_module_here", "faulthandler:enable")
    zygote = Zygote({**os.environ, "MARK": "zygote"}, out / "zygote.log", preload=preload)
    read_fd, write_fd = os.pipe()
    results = {"driver": os.getpid(), "pgid": os.getpgid(0), "early": early, "zygote": zygote.proc.pid}
    for name, new_session, code in (("own", True, "3"), ("group", False, "raise"), ("killed", True, "sleep")):
        env = {**os.environ, "MARK": name}
        proc = zygote.fork([sys.executable, child, code, str(write_fd)], env, out / f"{name}.log", new_session,
                           (write_fd,))  # fmt: skip
        assert proc is not None
        if code == "sleep":
            while not (out / f"{name}.log").read_text().count("\n") >= 2:
                time.sleep(0.01)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.2)
            stopped_poll = proc.poll()
            proc.kill()
            results[name + "_stopped_poll"] = stopped_poll
        results[name] = {"pid": proc.pid, "code": proc.wait(timeout=60)}
    os.close(write_fd)
    said = b""
    while chunk := os.read(read_fd, 4096):
        said += chunk
    results["said"] = [json.loads(line) for line in said.decode().splitlines()]
    zygote.close()
    results["zygote_code"] = zygote.proc.returncode
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
