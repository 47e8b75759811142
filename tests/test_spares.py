"""Warm spares (issue 31): ``--spares S`` starts S workers that build everything a worker builds and wait outside
the group; a dead worker's place goes to one of them, which joins in the next epoch with the state, and a new
spare is started. Real processes and real ``kill -9``; the oracle is the failure-free run, bitwise (exact
reduction: the trajectory does not depend on who computes which microbatch)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
from runner import CONTROL_COMMON, CONTROL_STEPS, TINY, committed, same_final, train_cmd, wait_for, worker_pids

from unbroken.control.gateway import TOKEN_ENV, new_token
from unbroken.core.records import read_records, step_losses

pytestmark = pytest.mark.timeout(400)


def test_spares_take_the_places_of_a_scheduled_and_an_outside_kill_and_the_run_stays_bitwise(
    tmp_path: Path, data_cache_dir: Path, control_reference: Path
) -> None:
    """3 workers and 1 spare. Worker 1 is killed mid-backward at step 5 (the schedule) and worker 2 by an outside
    ``kill -9`` at a random step: spare 0 takes worker 1's place and spare 1, started when spare 0 was promoted,
    takes worker 2's. Each joins under the dead worker's id; from its join on every step is computed by 3
    workers; the summary names both promotions; the final parameters are the failure-free run's."""
    run, token = tmp_path / "run", new_token()
    schedule = "--failures.schedule=kill:worker=1,step=5,phase=backward"
    cmd = train_cmd(data_cache_dir, TINY, "--out", str(run), *CONTROL_COMMON, "--spares", "1", schedule, workers=3)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, TOKEN_ENV: token})  # fmt: skip
    try:
        at = random.Random().randint(12, 28)
        wait_for(lambda: committed(run) >= at, 300, f"step {at}")
        wait_for(lambda: 2 in worker_pids(token), 60, "worker 2")
        os.kill(worker_pids(token)[2], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    spares = read_records(run, "spare")
    promoted = {r["worker"]: r["spare"] for r in spares if r["state"] == "promoted"}
    assert promoted == {1: 0, 2: 1}, spares
    started = sorted(r["spare"] for r in spares if r["state"] == "started")
    assert started == [0, 1, 2]  # one at launch, one after each promotion
    assert {r["spare"] for r in spares if r["state"] == "ready"} >= {0, 1}  # each was built before promoted
    joins = [m for m in read_records(run, "membership") if m["reason"].startswith("joined")]
    assert [m["members"] for m in joins] == [[0, 1, 2], [0, 1, 2]], joins
    last_join = max(r["step"] for r in read_records(run, "recovery") if r["epoch"] == joins[-1]["epoch"])
    steps = [r for r in read_records(run, "step") if not r.get("republished")]
    assert all(r["alive"] == 3 for r in steps if r["step"] >= last_join)
    assert "spare 0 took worker 1's place" in out and "spare 1 took worker 2's place" in out, out[-3000:]
    assert step_losses(run) == step_losses(control_reference)
    same_final(control_reference, run, CONTROL_STEPS)
