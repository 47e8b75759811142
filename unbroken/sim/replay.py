"""``unbroken simulate --replay RUN_DIR``: a finished real run against the simulator, bucket by bucket.

Owns fitting the simulator's costs to one run from its own records, and the side-by-side table. The run's
scheduled kills (``failures.schedule``: its ``kill`` events, rejoins included) are replayed step for step
with the run's policy, layout, M, steps and checkpoint interval; the costs come from what the run measured:

- ``microbatch_s``: the median clean step (``core.goodput``'s) over the slowest member's microbatches (the
  records do not split a step into compute and reduction); with ``--cores C`` (the workers shared C cores,
  as on a CPU host) that time is converted to a core's own (x C / processes) and the simulator time-shares
  the C cores;
- ``allreduce_s``: the part of a step that does not scale: the usual time between steps (the cadence);
- ``detect_s``, ``reform_s``, ``rejoin_s``, ``save_s``: the medians of the failure, recovery (a failure's, a
  join's with its state transfer) and checkpoint records; ``restart_s`` (restart policy): from a failure to the
  first step after the relaunch, less a step.

Both sides are given in ``core.goodput.Bucket``s: the real run's account, and the simulator's time lost by
cause (``sim.engine.LOST_CAUSES``) in the buckets they are (``BUCKET_OF``). What the simulator does not model
is said, not hidden: the start-up, evaluations, the kills not in the schedule (from outside), the other
scheduled faults (slow workers, NaNs), and noise. ``--dry-run`` reads the run and fits the costs, and simulates
nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.core.config import RunConfig, load_config
from unbroken.core.failures import FailureEvent, FailureKind, FailureSchedule
from unbroken.core.flavours import FLAVOURS
from unbroken.core.goodput import Bucket, Goodput, account
from unbroken.core.records import RecordKind, committed_steps, is_join, read_records
from unbroken.sim.scenario import load_scenario
from unbroken.sim.simulate import SimResult, simulate


@dataclass(frozen=True)
class Replay:
    run_dir: Path
    real: Goodput
    sim: SimResult
    costs: dict[str, float]  # what was fitted
    not_modelled: list[str]  # what the real run had that the simulator does not replay

    def sim_buckets(self) -> dict[Bucket, float]:
        return self.sim.policies[0].badput()


MIN_COST_S = 1e-6  # what a cost measured as 0 is given to the simulator (its scenario needs costs > 0)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fit(
    records: list[dict[str, Any]], real: Goodput, events: Sequence[FailureEvent], cfg: RunConfig, cores: int
) -> tuple[dict[str, float], list[str]]:
    """The simulator's cost overrides from one run's records, its account ``real`` and its scheduled ``events``
    (see the module's doc), and the scenario's other keys; ValueError when the records cannot calibrate it."""
    steps = list(committed_steps(records).values())
    full = max((int(r["alive"]) for r in steps), default=0)
    if not full or math.isnan(real.ideal_step_s):
        raise ValueError("replay: the run has no committed step to calibrate the simulator from")
    layout = cfg.parallel
    processes = full * layout.shard * layout.pipeline * layout.tensor
    quota = math.ceil(cfg.train.microbatches / full)
    # The records do not split a step into compute and reduction: the step itself is taken as compute, of the
    # slowest member's microbatches (at a core's own speed when the workers shared the cores), and the usual
    # time between steps as the part that does not scale (0 would ask the simulator for its ring formula).
    compute = real.ideal_step_s - real.cadence_s
    costs: dict[str, float] = {
        "microbatch_s": compute / quota * (min(1.0, cores / processes) if cores else 1.0),
        "allreduce_s": max(real.cadence_s, MIN_COST_S),
    }
    failures = [r for r in records if r.get("type") == RecordKind.FAILURE]
    members = {int(r["epoch"]): r["members"] for r in records if r.get("type") == RecordKind.MEMBERSHIP}
    recoveries = [r for r in records if r.get("type") == RecordKind.RECOVERY]
    measured = {
        "detect_s": _median([float(r["detection_s"]) for r in failures if "detection_s" in r]),
        "reform_s": _median([float(r["reform_s"]) for r in recoveries if not is_join(r, members)]),
        "rejoin_s": _median(
            [float(r["reform_s"]) + r["time_recovered"] - r["time_reformed"] for r in recoveries if is_join(r, members)]
        ),
        "save_s": _median([float(r["seconds"]) for r in records if r.get("type") == RecordKind.CHECKPOINT]),
    }
    restarts = []
    for restart in (r for r in records if r.get("type") == RecordKind.RESTART):
        failed = [f["time"] for f in failures if f["time"] < restart["time"]]
        resumed = [r["time"] for r in steps if r["time"] > restart["time"]]
        if failed and resumed:
            restarts.append(min(resumed) - real.ideal_step_s - max(failed))
    measured["restart_s"] = _median(restarts)
    # A cost measured as 0 is real (a group formed on the watcher's thread before the step needed it re-forms in
    # no time on the critical path); the scenario takes only positive costs, so it becomes the smallest one.
    costs |= {k: max(MIN_COST_S, v) for k, v in measured.items() if v is not None}
    kills = [e for e in events if e.kind is FailureKind.KILL]
    flavour = cfg.model.flavour if cfg.model.flavour in FLAVOURS and not cfg.model.hf_config else "tiny"
    scenario = [
        f"--cluster.gpus={processes}",
        f"--cluster.shard={layout.shard}",
        f"--cluster.pipeline={layout.pipeline}",
        f"--cluster.tensor={layout.tensor}",
        f"--cluster.shared_cores={cores}",
        f"--model.flavour={flavour}",
        f"--model.seq_len={cfg.data.seq_len}",
        f"--model.microbatch_size={cfg.data.microbatch_size}",
        f"--model.microbatches={cfg.train.microbatches}",
        "--run.hours=0",
        f"--run.steps={cfg.train.steps}",
        f"--run.policies={cfg.recovery.policy}",
        f"--checkpoint.every={cfg.checkpoint.every}",
        f"--checkpoint.in_place_every={cfg.checkpoint.every}",
        f"--failures.schedule={'; '.join(_event_text(e) for e in kills)}",
        *(f"--cost.{k}={v!r}" for k, v in costs.items()),
    ]
    return costs, scenario


def _event_text(event: FailureEvent) -> str:
    parts = [f"kill:worker={event.worker}", f"step={event.step}", f"phase={event.phase}"]
    if event.rejoin_after_s is not None:
        parts.append(f"rejoin={event.rejoin_after_s}")
    return ",".join(parts)


Fitted = tuple[RunConfig, list[dict[str, Any]], Goodput, list[FailureEvent], tuple[dict[str, float], list[str]]]


def _fitted(run_dir: Path, cores: int) -> Fitted:
    """The run's config, records, account and scheduled events, and the costs and scenario fitted from them."""
    if not (run_dir / "config.toml").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"--replay {run_dir}: not a run directory (config.toml and metrics.jsonl needed)")
    if cores < 0:
        raise ValueError(f"--cores {cores} must be >= 0 (0: the workers had devices of their own)")
    cfg = load_config(run_dir / "config.toml")
    records = read_records(run_dir)
    real = account(records)
    events = list(FailureSchedule.parse(cfg.failures.schedule).events)
    return cfg, records, real, events, fit(records, real, events, cfg, cores)


def replay(run_dir: Path, cores: int = 0) -> Replay:
    """Simulate ``run_dir``'s own failure timeline with costs fitted from its records.

    Raises:
        ValueError: not a finished run directory, or one the records cannot calibrate the simulator from.
    """
    run_dir = Path(run_dir)
    cfg, records, real, events, (costs, scenario) = _fitted(run_dir, cores)
    other = sorted({str(e.kind) for e in events if e.kind is not FailureKind.KILL})
    outside = sum(1 for r in records if r.get("type") == RecordKind.FAILURE and not r.get("event"))
    not_modelled = ["the start-up", "evaluations", "noise"]
    if other:
        not_modelled.append(f"the scheduled {', '.join(other)} events")
    if outside:
        not_modelled.append(f"{outside} failure{'s' if outside > 1 else ''} not in the schedule (from outside)")
    return Replay(run_dir, real, simulate(load_scenario(None, scenario)), costs, not_modelled)


def format_replay(r: Replay) -> str:
    sim = r.sim.policies[0]
    simulated = r.sim_buckets()
    start = r.real.buckets[Bucket.START]
    lines = [
        f"replay of {r.run_dir} ({sim.policy}): costs fitted from its records: "
        + ", ".join(f"{k} {v:.4g} s" for k, v in r.costs.items()),
        f"not modelled: {', '.join(r.not_modelled)}",
        "",
        "| | real | simulated |",
        "|---|---|---|",
        f"| committed tokens | {r.real.tokens:,} | {sim.committed_tokens:,} |",
        f"| wall (s), the start-up left out | {r.real.wall_s - start:.2f} | {sim.wall_s:.2f} |",
        f"| ideal step (s) | {r.real.ideal_step_s:.4f} | {r.sim.failure_free_step_s:.4f} |",
    ]
    for bucket in Bucket:
        real_s, sim_s = r.real.buckets[bucket], simulated[bucket]
        if real_s or sim_s:
            lines.append(f"| {bucket} (s) | {real_s:.2f} | {sim_s:.2f} |")
    lines += ["", "(The simulator's reformation includes admitting a joiner, whose state transfer the run says apart.)"]
    return "\n".join(lines)


def run_replay(run_dir: str, cores: int, dry_run: bool = False) -> int:
    """Entry point of ``unbroken simulate --replay``; ValueError (one line) for bad input. ``dry_run``: the run read
    and the simulator's costs fitted from it, one line said, nothing simulated."""
    if dry_run:
        _cfg, _records, _real, events, (costs, scenario) = _fitted(Path(run_dir), cores)
        load_scenario(None, scenario)  # the fitted scenario checked as the simulation would load it
        kills = sum(1 for e in events if e.kind is FailureKind.KILL)
        print(
            f"dry run: would replay {run_dir} ({kills} scheduled kill{'s' * (kills != 1)}) in the simulator with "
            f"costs fitted from its records ({', '.join(sorted(costs))}); nothing simulated or written"
        )
        return 0
    print(format_replay(replay(Path(run_dir), cores)))
    return 0
