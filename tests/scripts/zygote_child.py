"""What a forked worker sees: reported on the descriptor it was handed (``argv[2]``), then it ends as ``argv[1]``
says: an exit status, an exception, or a sleep until it is killed."""

import faulthandler
import json
import os
import sys
import time

fd = int(sys.argv[2])
open_fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
report = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "argv": sys.argv,
          "mark": os.environ.get("MARK"), "forked": os.environ.get("UNBROKEN_FORKED"), "name": __name__,
          "torch_loaded": "torch" in sys.modules, "numba_loaded": "numba" in sys.modules,
          "preloaded": "wave" in sys.modules, "warmed": faulthandler.is_enabled(), "fds": open_fds}  # fmt: skip
os.write(fd, (json.dumps(report) + "\n").encode())
print("to the log", flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("a bug")
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
