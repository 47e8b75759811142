"""One ``unbroken train`` run of a benchmark, in this process's launcher, to its end: the benchmarks' way to run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from unbroken.core.config import RunConfig


def run_to_end(cfg: RunConfig, workers: int, keep: Path | None = None) -> list[dict[str, Any]]:
    """Run to the end and return the metrics records (the run directory is kept under ``keep`` if given)."""
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.core.records import read_records
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-"))
    run_dir = (keep or tmp) / "run"
    plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0, trainer_worker, validate_launch)
    code = Launcher(plan, show_progress=False, show_summary=False).run()
    if code != 0:
        raise RuntimeError(f"run failed (exit {code}); logs kept in {run_dir}/logs")
    records = read_records(run_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    return records
