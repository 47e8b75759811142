"""``unbroken bench start``: what starting a worker costs, cold against forked by the agent's zygote.

A cold worker is a new interpreter that imports torch, ``torch._dynamo`` and the package before its first line of
training; a forked one is a fork of the zygote (``control.host.zygote``) that already has. Measured from the agent's
request to the worker's registration with the coordinator: the ``admitted`` records' ``start_s`` (wall time) and
``start_cpu_s`` (the worker's own CPU). Registration comes after the worker built its model and opened its data,
so both include that work, the same in both modes.

Each round runs one job per mode, the first mode alternating: the tiny config with W workers, worker 1 killed
(``kill -9`` from its agent) at step 2 and restarted at once, so a run has W first starts and one restart. A
restart is what a replacement costs during training; first starts overlap each other and the coordinator's
start. The zygote's own imports are paid once per agent, while the coordinator starts (the first forked worker
may wait for them): reported on their own row.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from unbroken.control.host.zygote import ZYGOTE_ENV, ready_cost
from unbroken.core.config import preset_path
from unbroken.core.records import RecordKind, read_records
from unbroken.lab.harness import stats

STEPS = 60  # long enough that a cold restart registers before the run ends
MODES = {"cold": "0", "forked": "1"}


def _run(mode: str, workers: int, overrides: list[str], run_dir: Path) -> list[dict]:
    """The ``admitted`` records of one job run with the workers started ``mode``."""
    cmd = [
        sys.executable,
        "-m",
        "unbroken",
        "train",
        str(preset_path("tiny")),
        "--workers",
        str(workers),
        "--out",
        str(run_dir),
        "--quiet",
        f"--train.steps={STEPS}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--failures.schedule=kill:worker=1,step=2,phase=backward,rejoin=0",
        *overrides,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, ZYGOTE_ENV: MODES[mode]})
    if result.returncode != 0:
        raise RuntimeError(f"the {mode} run failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    return read_records(run_dir, RecordKind.ADMITTED)


def bench_start(workers: int, repeats: int, overrides: list[str]) -> dict[str, list[float]]:
    """Samples (seconds) per row: ``{mode} {first|restart} {wall|cpu}`` and ``zygote {wall|cpu}``."""
    if workers < 2:
        raise ValueError(f"bench start needs at least 2 workers (worker 1 is killed and restarted); got {workers}")
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-start-") as tmp:
        for round_ in range(repeats):
            for mode in sorted(MODES, reverse=round_ % 2 == 1):
                run_dir = Path(tmp) / f"{mode}-{round_}"
                seen: set[int] = set()
                for record in sorted(_run(mode, workers, overrides, run_dir), key=lambda r: r["time"]):
                    if record["forked"] != (mode == "forked") or record["start_s"] is None:
                        raise RuntimeError(f"a {mode} run admitted a worker started otherwise: {record}")
                    kind = "restart" if record["worker"] in seen else "first"
                    seen.add(record["worker"])
                    samples.setdefault(f"{mode} {kind} wall", []).append(record["start_s"])
                    samples.setdefault(f"{mode} {kind} cpu", []).append(record["start_cpu_s"])
                if mode == "forked" and (ready := ready_cost(run_dir / "logs" / "zygote.log")) is not None:
                    samples.setdefault("zygote wall", []).append(ready[0])
                    samples.setdefault("zygote cpu", []).append(ready[1])
    return samples


def format_start(samples: dict[str, list[float]], workers: int) -> str:
    """The markdown table of ``bench_start``'s samples, and the cold / forked ratios of the medians."""

    def cell(key: str) -> str:
        if key not in samples:
            return "not measured"
        st = stats(samples[key])
        return f"{st['median']:.2f} [{st['min']:.2f}, {st['max']:.2f}] (n={st['n']})"

    names = {"first": "first start", "restart": "restart"}
    lines = [
        f"Tiny config, {workers} workers a run, worker 1 killed at step 2 and restarted at once. Seconds from the "
        "agent's request to the worker's registration (`admitted` records): median [min, max] (n samples).",
        "",
        "| start | wall s | worker CPU s |",
        "|---|---|---|",
    ]
    for mode in MODES:
        for kind in ("first", "restart"):
            label = f"{mode}, {names[kind]}"
            lines.append(f"| {label} | {cell(f'{mode} {kind} wall')} | {cell(f'{mode} {kind} cpu')} |")
    lines.append(f"| the zygote's imports (once per agent) | {cell('zygote wall')} | {cell('zygote cpu')} |")
    ratios = []
    for kind in ("first", "restart"):
        for measure in ("wall", "cpu"):
            cold, forked = samples.get(f"cold {kind} {measure}"), samples.get(f"forked {kind} {measure}")
            if cold and forked:
                ratio = stats(cold)["median"] / max(stats(forked)["median"], 1e-9)
                ratios.append(f"{names[kind]} {measure}: cold / forked = {ratio:.1f}")
    lines += ["", "; ".join(ratios) + "."]
    return "\n".join(lines)
