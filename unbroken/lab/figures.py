"""What every ``unbroken bench`` shares: how a sample of times is summarised (median, quartiles, range, size),
and how a baseline's ranks (plain DDP, FSDP2 HSDP) are started as processes of a module of ours and report
their step times."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from unbroken.control.netif import free_port


def stats(times: list[float]) -> dict[str, float]:
    """Median, first and third quartiles, min, max and n of ``times`` (at least one value)."""
    ordered = sorted(times)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "q1": q[0],
        "q3": q[2],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def run_ranks(
    module: str, flag: str, config_toml: str, workers: int, around: contextlib.AbstractContextManager[object]
) -> list[float]:
    """Start ``workers`` ranks of a baseline, ``python -m module flag RANK ...`` (its ``rank_main``), on the
    config ``config_toml``; wait for them inside ``around`` (e.g. a peak-memory sampler); return the step times
    rank 0 wrote. Raises RuntimeError if a rank failed."""
    with tempfile.TemporaryDirectory(prefix="baseline-bench-") as tmp:
        config_path = Path(tmp) / "config.toml"
        config_path.write_text(config_toml)
        out = Path(tmp) / "times.json"
        port = free_port()
        env = {**os.environ, "UNBROKEN_LOCAL_WORKERS": str(workers)}
        args = ["--world", str(workers), "--port", str(port), "--config", str(config_path), "--out", str(out)]
        with around:
            procs = [
                subprocess.Popen([sys.executable, "-m", module, flag, str(rank), *args], env=env)
                for rank in range(workers)
            ]
            codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"{module} {flag}: the baseline failed, exit codes {codes}")
        return json.loads(out.read_text())


def rank_main(flag: str, worker: Callable[[int, int, int, str, str], None]) -> None:
    """The entry point of one rank started by ``run_ranks``: ``worker(rank, world, port, config, out)``."""
    parser = argparse.ArgumentParser()
    parser.add_argument(flag, type=int, required=True, dest="rank")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    worker(a.rank, a.world, a.port, a.config, a.out)
