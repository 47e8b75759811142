"""``unbroken simulate SCENARIO.toml --sweep SECTION.KEY=V1,V2,... [--sweep ...]``: one scenario run at every
point of a grid of overrides (the product of the ``--sweep`` axes), and one table that compares the policies
across the points, e.g. replicas of 1, 8 and 64 GPUs on one GPU-failure timeline
(configs/sim/replicas_512.toml, docs/simulation.md).

Owns the sweep: parsing ``--sweep``, the comparison table, ``sweep.md`` and ``sweep.json``. Each point is an
ordinary ``simulate`` run whose own tables are printed and, with ``--out``, written to its own folder by
``sim.report``. Every point is loaded and simulated before anything is written, so bad input leaves no
partial output; ``--dry-run`` loads every point and simulates none. No torch.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.core.config import parse_overrides
from unbroken.sim.report import check_out, dry_run_line, format_markdown, write_outputs
from unbroken.sim.scenario import Scenario, load_scenario
from unbroken.sim.simulate import PolicyResult, SimResult, simulate

EXAMPLE = "cluster.gpus_per_replica=1,8,64"


@dataclass(frozen=True)
class Axis:
    """One ``--sweep``: a scenario key (``section.key``) and the values it takes, as override text."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid: its settings (key, value) in ``--sweep`` order and the simulation there."""

    settings: tuple[tuple[str, str], ...]
    result: SimResult

    @property
    def label(self) -> str:
        return _label(self.settings)

    @property
    def folder(self) -> str:
        return _folder(self.settings)


def _label(settings: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{key} = {value}" for key, value in settings)


def _folder(settings: tuple[tuple[str, str], ...]) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(f"{key}={value}" for key, value in settings))


def grid(axes: list[Axis]) -> list[tuple[tuple[str, str], ...]]:
    """The points of the axes' product, the first axis varying slowest, as (key, value) settings."""
    keys = [a.key for a in axes]
    return [tuple(zip(keys, values, strict=True)) for values in itertools.product(*(a.values for a in axes))]


def parse_sweeps(specs: list[str], overrides: list[str]) -> list[Axis]:
    """The axes of ``--sweep`` specs ``section.key=v1,v2,...``.

    Raises:
        ValueError: one line, for a malformed spec, an empty or repeated value, or a key swept twice or
            also given as an override (which of the two would win is not obvious, so neither does).
    """
    given = {f"{section}.{key}" for section, keys in parse_overrides(overrides).items() for key in keys}
    axes: list[Axis] = []
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or "." not in key:
            raise ValueError(f"--sweep {spec!r} is malformed; expected SECTION.KEY=V1,V2,... (e.g. {EXAMPLE})")
        values = tuple(v.strip() for v in text.split(","))
        if not all(values):
            raise ValueError(f"--sweep {spec!r} has an empty value; expected SECTION.KEY=V1,V2,...")
        if len(set(values)) != len(values):
            raise ValueError(f"--sweep {spec!r} repeats a value")
        if key in given:
            raise ValueError(f"--sweep {key} is also given as the override --{key}=...; give it once")
        if any(a.key == key for a in axes):
            raise ValueError(f"--sweep {key} is given twice; list its values in one --sweep {key}=V1,V2,...")
        axes.append(Axis(key, values))
    return axes


def load_points(scenario: str | None, overrides: list[str], axes: list[Axis]) -> list[Scenario]:
    """The scenario of every point of the grid, each loaded and checked (ValueError, one line, naming the point)."""
    scenarios = []
    for settings in grid(axes):
        try:
            scenarios.append(load_scenario(scenario, [*overrides, *(f"--{k}={v}" for k, v in settings)]))
        except ValueError as e:
            raise ValueError(f"--sweep at {_label(settings)}: {e}") from None
    return scenarios


def run_points(scenario: str | None, overrides: list[str], axes: list[Axis]) -> list[SweepPoint]:
    """Simulate every point of the grid (the product of the axes' values, the first axis slowest).

    Raises:
        ValueError: one line, for a point's bad scenario (all are loaded before any is simulated) or one
            that would never finish.
    """
    points = []
    for settings, sc in zip(grid(axes), load_points(scenario, overrides, axes), strict=True):
        try:
            points.append(SweepPoint(settings, simulate(sc)))
        except ValueError as e:
            raise ValueError(f"--sweep at {_label(settings)}: {e}") from None
    return points


def failure_loss_s(r: PolicyResult) -> float:
    """Wall time the failures cost a policy: all it lost (``lost_s`` adds up to the wall time minus the
    failure-free time of the committed work) but its checkpoint saves, which it pays with no failure too."""
    return sum(r.lost_s.values()) - r.lost_s["checkpoint"]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _per_failure_min(seconds: float, failures: int) -> str:
    return f"{seconds / failures / 60:.3g}" if failures else "-"


def _rows(point: SweepPoint) -> list[dict[str, Any]]:
    res = point.result
    first = res.policies[0]
    rows = []
    for r in res.policies:
        gpu_failures = res.timeline.gpu_failures_until(r.wall_s)
        rows.append(
            {
                "policy": r.policy,
                "finished": r.finished,
                "failure_free_tokens_per_s": r.failure_free_tokens_per_s,
                "tokens_per_s": r.tokens_per_s,
                "vs_failure_free": r.tokens_per_s / r.failure_free_tokens_per_s,
                "vs_first": r.tokens_per_s / first.tokens_per_s if first.tokens_per_s else None,
                "gpu_failures": gpu_failures,
                "replica_failures": r.failures,
                "restarts": r.restarts,
                "recomputed_microbatches": r.recomputed_microbatches,
                "failure_loss_s": failure_loss_s(r),
                "degraded_s": r.lost_s["degraded"],
                "committed_tokens": r.committed_tokens,
                "wall_s": r.wall_s,
                "lost_s": r.lost_s,
            }
        )
    return rows


def format_sweep(points: list[SweepPoint]) -> str:
    """One row per point and policy: throughput against the failure-free run and the point's first policy,
    the failures (GPUs, and the replicas they took down while in the group), and the time the failures cost
    per GPU failure, with its share from running degraded (fewer replicas) rather than stalled."""
    keys = [key for key, _ in points[0].settings]
    firsts = {p.result.policies[0].policy for p in points}
    first = firsts.pop() if len(firsts) == 1 else "first policy"
    header = (
        "| " + " | ".join(keys) + f" | replicas | policy | failure-free tokens/s | tokens/s | vs failure-free "
        f"| vs {first} | GPU failures | replica failures | restarts | recomputed mb "
        "| lost per GPU failure (min) | of it degraded (min) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for point in points:
        values = " | ".join(value for _, value in point.settings)
        for row in _rows(point):
            name = row["policy"] + ("" if row["finished"] else " (unfinished)")
            lines.append(
                f"| {values} | {point.result.scenario.cluster.replicas:,} | {name} "
                f"| {row['failure_free_tokens_per_s']:,.0f} | {row['tokens_per_s']:,.0f} "
                f"| {row['vs_failure_free']:.3f} | {_ratio(row['vs_first'])} | {row['gpu_failures']:,} "
                f"| {row['replica_failures']:,} | {row['restarts']:,} | {row['recomputed_microbatches']:,} "
                f"| {_per_failure_min(row['failure_loss_s'], row['gpu_failures'])} "
                f"| {_per_failure_min(row['degraded_s'], row['gpu_failures'])} |"
            )
    return "\n".join(lines)


def _json(axes: list[Axis], points: list[SweepPoint]) -> dict[str, Any]:
    return {
        "axes": [{"key": a.key, "values": list(a.values)} for a in axes],
        "points": [
            {
                "settings": dict(p.settings),
                "folder": p.folder,
                "replicas": p.result.scenario.cluster.replicas,
                "gpus_per_replica": p.result.scenario.cluster.replica_gpus,
                "shard_pipeline_tensor": list(p.result.scenario.cluster.degrees),
                "failure_free_step_s": p.result.failure_free_step_s,
                "gpu_failures": p.result.timeline.gpu_failures,
                "replica_failures": p.result.timeline.replica_failures,
                "policies": _rows(p),
            }
            for p in points
        ],
    }


def run_sweep(
    scenario: str | None, overrides: list[str], specs: list[str], out: Path | None, dry_run: bool = False
) -> int:
    """Entry point of ``unbroken simulate ... --sweep``: prints each point's tables, then the comparison;
    with ``out``, each point's files in ``out/<key>=<value>/`` and the comparison in ``sweep.md`` and
    ``sweep.json``. ValueError (one line) for bad input, before anything is written. ``dry_run``: every point
    loaded and checked, one line said, nothing simulated or written."""
    axes = parse_sweeps(specs, overrides)
    check_out(out)
    folders = [_folder(settings) for settings in grid(axes)]
    if len(set(folders)) < len(folders):
        raise ValueError("--sweep: two points would share a folder name; use values that differ in [A-Za-z0-9._-]")
    if dry_run:
        first = load_points(scenario, overrides, axes)[0]
        swept = "; ".join(f"{a.key} = {', '.join(a.values)}" for a in axes)
        what = f"{scenario or 'the default scenario'} at {len(folders)} points ({swept})"
        print(dry_run_line(what, first, out, "sweep.md, sweep.json and a folder per point", layout=False))
        return 0
    points = run_points(scenario, overrides, axes)
    for p in points:
        print(f"## {p.label}\n\n{format_markdown(p.result)}\n")
    table = format_sweep(points)
    print(f"## The sweep: {', '.join(a.key for a in axes)}\n\n{table}")
    if out is not None:
        for p in points:
            write_outputs(p.result, out / p.folder)
        (out / "sweep.md").write_text(table + "\n")
        (out / "sweep.json").write_text(json.dumps(_json(axes, points), indent=1) + "\n")
        print(f"\nwrote sweep.md, sweep.json and one folder per point ({', '.join(p.folder for p in points)}) to {out}")
    return 0
