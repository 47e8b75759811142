"""``unbroken bench simulator``: the cluster simulator against real runs of this machine.

Three real 4-worker runs of the ``tiny`` model (20 steps, M = 8, a checkpoint every 5 steps) under
``recover``, ``drop`` and ``restart`` share one kill schedule. The simulator is calibrated from what each run
measured (nothing is tuned) and predicts its committed tokens and wall time; the figures, with the command,
go to docs/simulation.md ("Checked against real runs"). A wall-clock comparison on a shared machine is a
benchmark, not a test: what the simulator must compute exactly is tested in tests/test_simulate.py.

Calibration: the failure-free step period (median commit-to-commit before the first kill), the checkpoint
save time, the detection and re-formation latencies and, for restart, the time from the failure to the
first step after the relaunch. The step period is split into compute and the rest (reduction, optimizer)
with the rest measured where nothing else runs: under drop, between the group's re-formation and the
commit. The workers may outnumber the cores, so the simulator time-shares ``os.cpu_count()`` cores among
them, each process beyond the cores slowing the others by the share measured in the drop run (its period
with 4 workers against its period with 2 after the kills). Wall time is counted from the commit of step 0.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.core.records import RecordKind, committed_steps

REAL_STEPS = 20
REAL_M = 8
REAL_EVERY = 5
REAL_SCHEDULE = "kill:worker=1,step=6,phase=backward; kill:worker=2,step=13,phase=reduction"
POLICIES = ("drop", "recover", "restart")


def _final_steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The committed trajectory: the last record of each step (a restart redoes the steps it rolled back)."""
    return committed_steps(sorted(records, key=lambda r: r["time"]))


def _period(records: list[dict[str, Any]], alive: int, before: float = math.inf) -> float:
    """Median commit-to-commit time of failure-free steps run by ``alive`` workers (no save in between)."""
    steps = _final_steps([r for r in records if r["time"] < before])
    saves = [r["time"] for r in records if r["type"] == RecordKind.CHECKPOINT]
    intervals = [
        b["time"] - a["time"]
        for a, b in ((steps[s - 1], steps[s]) for s in sorted(steps) if s - 1 in steps and steps[s]["recoveries"] == 0)
        if a["alive"] == b["alive"] == alive
        and not (a.get("republished") or b.get("republished"))  # published late: no commit time
        and not any(a["time"] < t < b["time"] for t in saves)
    ]
    return statistics.median(intervals)


def _oversubscription(records: list[dict[str, Any]], allreduce_s: float, cores: int) -> float:
    """The slowdown per process beyond the cores (the simulator's ``cluster.oversubscription``), from one run:
    its period with 4 workers against its period with 2 after the failures. 0 where 4 workers do not
    outnumber the cores."""
    from unbroken.sim.engine import makespan

    if cores >= 4 or cores < 2:
        return 0.0
    microbatch_s = (_period(records, 2) - allreduce_s) / (REAL_M / 2)
    shared = (_period(records, 4) - allreduce_s) / (makespan(np.full(4, REAL_M / 4), cores) * microbatch_s)
    return max(0.0, shared - 1.0)


def _measure(records: list[dict[str, Any]], allreduce_s: float, cores: int, penalty: float) -> dict[str, float]:
    """What the run measured before its first failure (step period, saves), at its failures (detection,
    re-formation, restart), converted to the simulator's costs."""
    from unbroken.sim.engine import makespan

    first_failure = min(r["time"] for r in records if r["type"] == RecordKind.FAILURE)
    period = _period(records, 4, before=first_failure)
    units = makespan(np.full(4, REAL_M / 4), cores, penalty)  # 4 replicas x 2 microbatches on the cores
    measured = {
        "period": period,
        "microbatch_s": (period - allreduce_s) / units,
        "save_s": statistics.median(r["seconds"] for r in records if r["type"] == RecordKind.CHECKPOINT),
        "detect_s": statistics.median(r["detection_s"] for r in records if r["type"] == RecordKind.FAILURE),
    }
    reforms = [r["reform_s"] for r in records if r["type"] == RecordKind.RECOVERY and r.get("missing") is not None]
    if reforms:
        measured["reform_s"] = statistics.median(reforms)
    restarts = []
    for restart in (r for r in records if r["type"] == RecordKind.RESTART):
        failed = max(r["time"] for r in records if r["type"] == RecordKind.FAILURE and r["time"] < restart["time"])
        resumed = min(r["time"] for r in records if r["type"] == RecordKind.STEP and r["time"] > restart["time"])
        restarts.append(resumed - period - failed)
    if restarts:
        measured["restart_s"] = statistics.median(restarts)
    return measured


def _real_run(config: str, out: Path, policy: str, overrides: list[str]) -> list[dict[str, Any]]:
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.core.config import load_config
    from unbroken.core.records import read_records

    common = [
        f"--train.steps={REAL_STEPS}",
        f"--train.microbatches={REAL_M}",
        "--train.eval_every=0",
        "--train.eval_microbatches=1",
        f"--checkpoint.every={REAL_EVERY}",
        f"--failures.schedule={REAL_SCHEDULE}",
        # Kills are detected from the process exit; a generous heartbeat timeout keeps a loaded machine's late
        # heartbeats from passing for failures.
        "--comm.heartbeat_timeout_s=10",
        f"--recovery.policy={policy}",
    ]
    cfg = load_config(config, [*common, *overrides])
    run_dir = out / policy
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    plan = plan_launch(cfg, run_dir, 4, False, "127.0.0.1", 0, trainer_worker, validate_launch)
    code = Launcher(plan, False, False).run()
    if code != 0:
        raise RuntimeError(f"the {policy} run failed (exit {code}); logs in {run_dir / 'logs'}")
    return read_records(run_dir)


def bench_simulator(config: str, overrides: list[str]) -> dict[str, Any]:
    """Run the three real runs, calibrate the simulator from each and compare; returns the rows."""
    from unbroken.sim.scenario import load_scenario
    from unbroken.sim.simulate import simulate

    with tempfile.TemporaryDirectory(prefix="unbroken-bench-sim-") as tmp:
        records = {policy: _real_run(config, Path(tmp), policy, overrides) for policy in POLICIES}
    drop_steps = _final_steps(records["drop"])
    rest = [
        drop_steps[r["step"]]["time"] - r["time_reformed"]
        for r in records["drop"]
        # Only recoveries from a step under way: under drop nothing is computed after those, while a step
        # nobody had started (every id missing) is planned and computed as usual.
        if r["type"] == RecordKind.RECOVERY
        and r.get("missing")
        and len(r["missing"]) < REAL_M
        and not drop_steps[r["step"]].get("republished")
    ]
    allreduce_s = statistics.median(rest)
    cores = os.cpu_count() or 1
    penalty = _oversubscription(records["drop"], allreduce_s, cores)
    rows = []
    for policy, recs in records.items():
        m = _measure(recs, allreduce_s, cores, penalty)
        steps = _final_steps(recs)
        real_tokens = sum(r["tokens"] * (REAL_M - r["dropped"]) / REAL_M for r in steps.values())
        real_wall = steps[REAL_STEPS - 1]["time"] - steps[0]["time"]
        scenario = [
            "--cluster.gpus=4",
            "--cluster.gpus_per_replica=1",
            f"--cluster.shared_cores={cores}",
            f"--cluster.oversubscription={penalty}",
            "--model.flavour=tiny",
            "--model.seq_len=64",
            "--model.microbatch_size=2",
            f"--model.microbatches={REAL_M}",
            "--run.hours=0",
            f"--run.steps={REAL_STEPS}",
            f"--run.policies={policy}",
            f"--checkpoint.every={REAL_EVERY}",
            f"--checkpoint.in_place_every={REAL_EVERY}",
            f"--failures.schedule={REAL_SCHEDULE}",
            f"--cost.microbatch_s={m['microbatch_s']}",
            f"--cost.allreduce_s={allreduce_s}",
            f"--cost.save_s={m['save_s']}",
            f"--cost.detect_s={m['detect_s']}",
            *([f"--cost.reform_s={m['reform_s']}"] if "reform_s" in m else []),
            *([f"--cost.restart_s={m['restart_s']}"] if "restart_s" in m else []),
        ]
        res = simulate(load_scenario(None, scenario))
        sim = res.policies[0]
        rows.append(
            {
                "policy": policy,
                "real_tokens": real_tokens,
                "sim_tokens": sim.committed_tokens,
                "real_wall_s": real_wall,
                "sim_wall_s": sim.wall_s - res.failure_free_step_s,
                "calibration": m,
            }
        )
    return {"oversubscription": penalty, "allreduce_s": allreduce_s, "rows": rows}


def format_simulator(result: dict[str, Any]) -> str:
    lines = [
        "| policy | committed tokens, real / simulated | wall, real / simulated |",
        "|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['real_tokens']:,.0f} / {r['sim_tokens']:,.0f} | {r['real_wall_s']:.2f} s / "
            f"{r['sim_wall_s']:.2f} s ({r['sim_wall_s'] / r['real_wall_s'] - 1:+.1%}) |"
        )
    lines.append("")
    lines.append(
        f"Calibration: oversubscription {result['oversubscription']:.3f}, reduction + optimizer "
        f"{result['allreduce_s']:.3f} s; per policy: "
        + "; ".join(
            f"{r['policy']} " + ", ".join(f"{k} {v:.3f}" for k, v in r["calibration"].items()) for r in result["rows"]
        )
    )
    return "\n".join(lines)
