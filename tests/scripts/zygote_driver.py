"""Drives a real zygote from a process of its own (it becomes a child subreaper, which a pytest process must not):
forks ``zygote_child.py`` with the arguments the test gives, and prints what the test checks, as JSON."""

import json
import os
import signal
import sys
import time
from pathlib import Path

from unbroken.control.zygote import Zygote


def main() -> None:
    out = Path(sys.argv[1])
    child = str(Path(__file__).with_name("zygote_child.py"))
    zygote = Zygote({**os.environ, "MARK": "zygote"}, out / "zygote.log")
    read_fd, write_fd = os.pipe()
    results = {"driver": os.getpid(), "pgid": os.getpgid(0)}
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


if __name__ == "__main__":
    main()
