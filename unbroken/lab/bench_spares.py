"""``unbroken bench spares``: how long a job runs short of a worker after a ``kill -9``, a restart (cold or forked)
against a warm spare (issue 31).

Per model (``small`` and ``60m`` unless a config is given) and per round, three runs of ``unbroken train`` with 2
workers, each with worker 1 killed in its backward at step ``KILL_STEP``:

- **cold restart**: the agent starts a new process for worker 1 at once (``rejoin=0``), cold
  (``UNBROKEN_ZYGOTE=0``): it imports torch, builds the model, optimizer and data, registers, joins and
  receives the state;
- **forked restart**: the same, the process forked by the agent's zygote (torch and the package imported
  already), as the built-in trainer's workers are by default;
- **warm spare**: ``--spares 1``: spare 0, started with the job and waiting initialised, is given worker 1's id.

With replicas of several ranks (``--parallel.shard=2``, say), 2 replicas: worker 1's kill takes its replica down,
a restart restarts the replica's ranks, and the warm one has one whole spare replica (``--spares`` = its size).

From the run's records, in seconds from the kill (the ``injected`` record): the replacement's join (the
membership epoch that admits it again), the state received (the join's ``recovery`` record: ``time_recovered``),
and the replacement's first committed step (the step record of the join's step), at which the run is stopped (a
fast device would otherwise finish a fixed number of steps before a cold start is back). The state transfer is
reported apart: its bytes and the seconds from the group's formation to the state's arrival; and per round the
first committed step less that transfer (issue 31's target for a spare: at most 1 s).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
from enum import Enum
from pathlib import Path
from typing import Any

from unbroken.core.config import RunConfig, load_config, preset_path
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind, read_records

KILL_STEP = 4
STEPS_AFTER = 100_000  # at most this many steps after the kill (``--steps``): a run ends once the replacement commits
WATCH_S = 0.25  # how often the run's records are read for the replacement's first committed step
MODELS = ("small", "60m")
WORKERS = 2


class Replacement(Enum):
    """How the killed worker is replaced (the table's rows, in this order)."""

    COLD = "cold restart"  # a new process started cold (``UNBROKEN_ZYGOTE=0``): it imports torch
    FORKED = "forked restart"  # a new process forked by the agent's zygote (the built-in trainer's default)
    WARM = "warm spare"  # ``--spares 1``


def _config(config: str | None, flavour: str, overrides: list[str]) -> RunConfig:
    base = config or str(preset_path("tiny"))
    chosen = [] if config else [f"--model.flavour={flavour}"]
    return load_config(base, [*chosen, "--checkpoint.every=0", "--train.eval_every=0", *overrides])


def figures(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """The replacement's figures in seconds from the kill; None until its first step has committed."""
    kill = next((r["time"] for r in records if r["type"] == RecordKind.INJECTED), None)
    join = next((m for m in records if m["type"] == RecordKind.MEMBERSHIP and m["reason"].startswith("joined")), None)
    if kill is None or join is None:
        return None
    recovery = next((r for r in records if r["type"] == RecordKind.RECOVERY and r["epoch"] == join["epoch"]), None)
    if recovery is None:
        return None
    steps = [r["time"] for r in records if r["type"] == RecordKind.STEP and r["step"] == recovery["step"]]
    if not steps:
        return None
    return {
        "joined": join["time"] - kill,
        "state_received": recovery["time_recovered"] - kill,
        "first_step": min(steps) - kill,
        "state_bytes": float(recovery.get("state_bytes", 0)),
        "transfer_s": recovery["time_recovered"] - recovery["time_reformed"],
    }


def run_once(cfg: RunConfig, mode: Replacement, steps: int) -> dict[str, float]:
    """One run with worker 1 killed at ``KILL_STEP`` and replaced as ``mode`` says, stopped once its replacement
    has committed a step (so a fast device need not run a fixed number of steps while a cold start comes back);
    the figures."""
    from dataclasses import replace

    from unbroken.control.host.zygote import ZYGOTE_ENV
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    warm = mode is Replacement.WARM
    rejoin = "" if warm else ",rejoin=0"
    failures = replace(cfg.failures, schedule=f"kill:worker=1,step={KILL_STEP},phase=backward{rejoin}")
    cfg = replace(cfg, train=replace(cfg.train, steps=steps), failures=failures)
    run_dir = Path(tempfile.mkdtemp(prefix="unbroken-bench-spares-")) / "run"
    size = ReplicaLayout.of(cfg.parallel).size  # a spare replica is whole
    workers, spares = WORKERS * size, size if warm else 0
    plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0, trainer_worker, validate_launch, spares)
    zygote = os.environ.get(ZYGOTE_ENV)
    if mode is Replacement.COLD:
        os.environ[ZYGOTE_ENV] = "0"  # read by the launcher as it starts: its processes and workers start cold
    try:
        launcher = Launcher(plan, show_progress=False, show_summary=False)
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        if zygote is not None:
            os.environ[ZYGOTE_ENV] = zygote
    ended = threading.Event()

    def watch() -> None:
        while not ended.wait(WATCH_S):
            try:
                if figures(read_records(run_dir)) is not None:
                    launcher.interrupt("bench spares: the replacement has committed its first step")
                    return
            except (OSError, ValueError, KeyError):
                pass  # a record half-written: look again

    watcher = threading.Thread(target=watch, name="bench-spares-watch", daemon=True)
    watcher.start()
    code = launcher.run()
    ended.set()
    watcher.join()
    result = figures(read_records(run_dir))
    if result is None:  # the run is kept: its logs say why
        why = f"exit {code}" if code not in (0, 130) else "the replacement committed no step before the run ended"
        raise RuntimeError(f"bench spares: a {mode.value} run failed ({why}); see {run_dir}")
    shutil.rmtree(run_dir.parent)
    return result


def bench_spares(config: str | None, repeats: int, overrides: list[str], after: int = STEPS_AFTER) -> dict[str, Any]:
    """``repeats`` rounds of (cold restart, forked restart, warm spare) per model, alternating; runs of ``after``
    steps after the kill."""
    out: dict[str, Any] = {}
    for flavour in MODELS if config is None else ("config",):
        cfg = _config(config, flavour, overrides)
        rows: dict[Replacement, list[dict[str, float]]] = {mode: [] for mode in Replacement}
        for _ in range(repeats):
            for mode in Replacement:
                rows[mode].append(run_once(cfg, mode, KILL_STEP + after))
        out[cfg.model.flavour if config is None else Path(config).stem] = rows
    return out


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def format_spares(result: dict[str, Any]) -> str:
    lines = [
        f"{WORKERS} workers, worker 1 killed in its backward at step {KILL_STEP}; seconds from the kill, median "
        "[min, max] over the rounds",
        "",
        "| model | replacement | joined | state received | first committed step | state (MiB) | transfer (s) | "
        "first committed step less the transfer (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, rows in result.items():
        for mode in (m for m in Replacement if m in rows):
            r = rows[mode]
            mib = statistics.median(x["state_bytes"] for x in r) / 2**20
            lines.append(
                f"| {model} | {mode.value} (n={len(r)}) | "
                f"{_cell([x['joined'] for x in r])} | {_cell([x['state_received'] for x in r])} | "
                f"{_cell([x['first_step'] for x in r])} | {mib:.1f} | "
                f"{_cell([x['transfer_s'] for x in r])} | {_cell([x['first_step'] - x['transfer_s'] for x in r])} |"
            )
    return "\n".join(lines)
