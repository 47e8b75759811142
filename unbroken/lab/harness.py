"""What every ``unbroken bench`` shares: how a sample of times is summarised (median, quartiles, range, size),
and how a baseline's ranks (plain DDP, FSDP2 HSDP) are started as processes of a module of ours and report
their step times (and, asked to keep them, their final parameters and the work they did: ``keep_final``)."""

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
from typing import Any

from unbroken.control.store.netif import free_port


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
    module: str,
    flag: str,
    config_toml: str,
    workers: int,
    around: contextlib.AbstractContextManager[object],
    keep: Path | None = None,
) -> list[float]:
    """Start ``workers`` ranks of a baseline, ``python -m module flag RANK ...`` (its ``rank_main``), on the
    config ``config_toml``; wait for them inside ``around`` (e.g. a peak-memory sampler); return the step times
    rank 0 wrote. With ``keep``, each rank also writes its final state there (``keep_final``). Raises
    RuntimeError if a rank failed."""
    with tempfile.TemporaryDirectory(prefix="baseline-bench-") as tmp:
        config_path = Path(tmp) / "config.toml"
        config_path.write_text(config_toml)
        out = Path(tmp) / "times.json"
        port = free_port()
        env = {**os.environ, "UNBROKEN_LOCAL_WORKERS": str(workers)}
        args = ["--world", str(workers), "--port", str(port), "--config", str(config_path), "--out", str(out)]
        args += ["--keep", str(keep)] if keep is not None else []
        with around:
            procs = [
                subprocess.Popen([sys.executable, "-m", module, flag, str(rank), *args], env=env)
                for rank in range(workers)
            ]
            codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"{module} {flag}: the baseline failed, exit codes {codes}")
        return json.loads(out.read_text())


def rank_main(flag: str, worker: Callable[[int, int, int, str, str, str], None]) -> None:
    """The entry point of one rank started by ``run_ranks``: ``worker(rank, world, port, config, out, keep)``
    (``keep``: a folder for ``keep_final``, or empty)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(flag, type=int, required=True, dest="rank")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--keep", default="")
    a = parser.parse_args()
    worker(a.rank, a.world, a.port, a.config, a.out, a.keep)


def keep_final(keep: str, rank: int, model: Any, lane: int, work: list[list[list[int]]], **extra: Any) -> None:
    """Write a baseline rank's final parameters and its work into ``keep``/rank<N>.pt (tests/test_baselines.py
    compares them with unbroken's): the parameters whole, by name (a DTensor is gathered: a collective every
    rank makes, in the same order); ``work``: per step, the [microbatch id, tokens] this rank trained on;
    ``lane``: the ranks of one lane (its tensor ranks, its pipeline stages) compute the same microbatches."""
    import torch
    from torch.distributed.tensor import DTensor

    whole = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
    params = {name: p.detach().clone() for name, p in whole.items()}
    torch.save({"params": params, "lane": lane, "work": work, **extra}, Path(keep) / f"rank{rank}.pt")
