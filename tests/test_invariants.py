"""Invariants whose violation would corrupt training are explicit checks, not ``assert``: they hold under
``python -O`` (every process of the job below runs with ``PYTHONOPTIMIZE=1``, and ``make test`` runs this file
under ``python -O``), and when one fails the run stops cleanly with one line naming the step and the evidence,
keeping its last good checkpoint."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from runner import TINY, train_cmd

from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(240)


def test_optimised_python_still_checks_the_microbatch_accounting(tmp_path: Path, data_cache_dir: Path) -> None:
    """Worker 1 reports one of its microbatches twice at step 3 (an injected accounting fault). The count
    vector then holds a 2: every member sees it in the reduced counts, nobody commits, the run stops."""
    out = tmp_path / "dup"
    env = {**os.environ, "PYTHONOPTIMIZE": "1"}  # every process of the run, workers included, runs as -O
    # No member may leave before step 3 (the duplicated id is worker 1's first of 4 members' plan): the heartbeat
    # timeout is no part of the claim, and 2 s of silence happen to a worker of a loaded machine.
    cmd = train_cmd(
        data_cache_dir,
        TINY,
        "--out",
        str(out),
        "--checkpoint.every=2",
        "--failures.schedule=dup:worker=1,step=3",
        "--comm.heartbeat_timeout_s=10",
    )
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    epochs = [(r["members"], r["reason"]) for r in read_records(out, "membership")]
    assert "step 3" in lines[0] and "microbatch ids [1] were counted [2] times" in lines[0], (lines[0], epochs)
    assert [r["step"] for r in read_records(out, "step")] == [0, 1, 2]  # step 3 was never committed
    assert ckpt.load_latest(out).step == 2  # the last good checkpoint, intact
    assert not read_records(out, "final")
