"""Helpers shared by the tests that launch real training jobs (``unbroken train`` as a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from unbroken.control.zygote import worker_of
from unbroken.core.records import read_records
from unbroken.ft import checkpoint as ckpt
from unbroken.lab.figures import free_port  # noqa: F401 - the tests take it from here

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "tests" / "tiny.toml")  # configs/tiny.toml with a smaller vocabulary (read it)
EXACT = "--recovery.reduction=exact"
# One intra-op thread per worker, however many share the machine: every microbatch gradient is computed by the
# same kernels, so exact runs of different worker counts are bitwise comparable (tests/test_train.py).
ONE_THREAD = "--train.threads=1"
RUN_TIMEOUT_S = 240  # one run of ``train``


def train_cmd(cache: Path, *args: str, workers: int = 4) -> list[str]:
    """``unbroken train ARGS --workers N --quiet`` with the session's data cache (give TINY or --resume)."""
    return [
        sys.executable,
        "-m",
        "unbroken",
        "train",
        *args,
        "--workers",
        str(workers),
        "--quiet",
        f"--data.cache_dir={cache}",
    ]


def train(
    out: Path,
    cache: Path,
    *overrides: str,
    workers: int = 4,
    timeout_s: float = RUN_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``unbroken train tests/tiny.toml`` with ``workers`` worker processes into ``out``."""
    cmd = train_cmd(cache, TINY, "--out", str(out), *overrides, workers=workers)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model parameters of the run's newest good checkpoint."""
    loaded = ckpt.load_latest(run_dir)
    assert loaded is not None
    return loaded.state["model"]


# -- jobs of several processes started by hand (coordinator, agents, launchers) --------------------------------
CONTROL_STEPS = 40
# 8 microbatches of 4 sequences a step: slow enough (a few tenths of a second a step here) that the faults land
# mid-run; the assertions say if one did not.
CONTROL_COMMON = [
    f"--train.steps={CONTROL_STEPS}",
    "--train.microbatches=8",
    "--data.microbatch_size=4",
    EXACT,
    ONE_THREAD,
    "--checkpoint.every=10",
]


# -- the recovery runs (tests/conftest.py makes them; test_recovery and test_report read them) ------------------
RECOVERY_STEPS = 50
# Two kills (backward, reduction) and a rejoin. Worker 1's kill comes the step after worker 2's, while worker 2 is
# still down: it is restarted 6 s after its kill (a fork: it starts at once) and rejoins at a step boundary. Each
# microbatch worker 0 computes over steps 7-19 takes 0.25 s more (4 a step while two workers are down: at least
# 13 s whatever the machine's speed), so that the rejoin lands well before the last step even on an idle, fast
# machine (a factor would shrink with the step: the tests' vocabulary made steps 3x faster, and the rejoin came
# after the end). The delay does not change what exact mode computes.
RECOVERY_SCHEDULE = (
    "kill:worker=2,step=5,phase=backward,rejoin=6.0; kill:worker=1,step=6,phase=reduction; "
    "slow:worker=0,seconds=0.25,steps=7-19"
)
FP32_STEPS = 20  # the fp32 runs: both kills, no need to wait for the rejoin


def unbroken(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m unbroken ARGS`` in a session of its own (``os.killpg`` ends it and its children)."""
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def committed(run_dir: Path) -> int:
    """The newest step in the run's metrics (-1 before the first)."""
    return max((r["step"] for r in read_records(run_dir, "step")), default=-1)


def same_final(a: Path, b: Path, step: int) -> None:
    """The checkpoints of ``step`` in run directories ``a`` and ``b`` hold bitwise the same parameters."""
    sa, sb = ckpt.verify(a, step), ckpt.verify(b, step)
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])


def worker_pids(token: str) -> dict[int, int]:
    """Worker id -> pid of every live worker process of the job whose token is ``token`` (read from
    ``/proc/*/environ``: how an operator finds a job's workers whatever started them)."""
    found: dict[int, int] = {}
    wanted = f"UNBROKEN_TOKEN={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in env and (worker := worker_of(int(entry.name))) is not None:
            found[worker] = int(entry.name)
    return found
