"""``unbroken simulate SCENARIO.toml [--section.key=value ...] [--out DIR]``: runs ``unbroken.sim.simulate`` and
owns what it prints and writes: the markdown tables (throughput, committed / dropped / recomputed
microbatches, GPU-hours, time lost by cause), and with ``--out`` the resolved ``scenario.toml``,
``summary.md``, ``results.json`` and the plots ``tokens_vs_time.png``, ``tokens_vs_gpu_hours.png``,
``lost_time.png`` and ``replicas.png``.

No torch; matplotlib (the ``plots`` extra) is imported only to draw, and its absence is reported before the
simulation runs. Everything is checked before anything is written, so bad input leaves no partial output.
``--dry-run`` (``dry_run_line``, for a sweep too) loads and checks the scenario and says in one line what would
be simulated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.core.config import to_toml
from unbroken.core.goodput import Bucket
from unbroken.sim.engine import LOST_CAUSES
from unbroken.sim.scenario import HOUR, Scenario, load_scenario
from unbroken.sim.simulate import PolicyResult, SimResult, simulate

PLOTS = ("tokens_vs_time.png", "tokens_vs_gpu_hours.png", "lost_time.png", "replicas.png")


def _unit(seconds: float) -> tuple[str, float]:
    if seconds >= 2 * HOUR:
        return "h", HOUR
    if seconds >= 120:
        return "min", 60.0
    return "s", 1.0


def _num(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def format_markdown(res: SimResult) -> str:
    """The scenario in three lines, then one table of outcomes and one of the time lost, per policy."""
    sc, c, tl = res.scenario, res.costs, res.timeline
    m = sc.model
    tokens_per_step = m.microbatches * c.tokens_per_microbatch
    how_mb = "measured" if sc.cost.microbatch_s else f"{m.flavour} FLOPs at {sc.cost.mfu:g} MFU"
    if not sc.cost.microbatch_s and sc.cluster.tensor > 1 and sc.cost.tensor_bandwidth_gbs > 0:
        how_mb += " + tensor-parallel all-reduces"
    if c.bubble:
        how_mb += f"; a pipeline pass adds {c.bubble} to a replica's microbatches"
    how_ar = "measured" if sc.cost.allreduce_s else "ring all-reduce"
    wall = max(r.wall_s for r in res.policies)
    unit, scale = _unit(wall)
    k, p, t = sc.cluster.degrees
    lines = [
        f"{sc.cluster.gpus:,} GPUs in {sc.cluster.replicas:,} replicas of {sc.cluster.replica_gpus} "
        f"(shard {k} x pipeline {p} x tensor {t}; spares {sc.cluster.spares}); model {m.flavour}, "
        f"M = {m.microbatches:,} microbatches of {c.tokens_per_microbatch:,} tokens ({tokens_per_step:,} tokens/step)",
        f"microbatch {c.microbatch_s:.4g} s ({how_mb}), all-reduce {c.allreduce_s(sc.cluster.replicas):.4g} s "
        f"({how_ar}); failure-free step {res.failure_free_step_s:.4g} s, "
        f"{sc.model.microbatches * c.tokens_per_microbatch / res.failure_free_step_s:,.0f} tokens/s",
        f"{tl.gpu_failures:,} GPU failures in the timeline, taking down {tl.replica_failures:,} replicas of "
        f"{sc.cluster.replica_gpus}; detect {c.detect_s:g} s, re-form {c.reform_s:g} s, "
        f"rejoin {c.rejoin_s:.3g} s, restart {c.restart_s:g} s; checkpoint every {sc.checkpoint.every} steps "
        f"(restart) / {sc.checkpoint.in_place_every} (the others), {c.save_s:g} s each; "
        f"{res.planner_calls} calls into unbroken.core.plan",
        "",
    ]
    budget = sc.run.report_gpu_hours
    first = res.policies[0]
    header = (
        f"| policy | wall ({unit}) | steps | committed tokens | tokens/s | vs failure-free | vs {first.policy} "
        "| committed mb | dropped mb | recomputed mb | failures | restarts | GPU-hours |"
    )
    if budget:
        header += f" tokens at {budget:g} GPU-h | vs {first.policy} |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for r in res.policies:
        row = (
            f"| {r.policy}{'' if r.finished else ' (unfinished)'} | {r.wall_s / scale:.3g} | {r.steps:,} "
            f"| {r.committed_tokens:,} | {r.tokens_per_s:,.0f} | {r.tokens_per_s / r.failure_free_tokens_per_s:.3f} "
            f"| {r.tokens_per_s / first.tokens_per_s if first.tokens_per_s else math.nan:.3f} "
            f"| {r.committed_microbatches:,} | {r.dropped_microbatches:,} | {r.recomputed_microbatches:,} "
            f"| {r.failures:,} | {r.restarts:,} | {_num(r.gpu_hours)} |"
        )
        if budget:
            ratio = r.tokens_at_gpu_hours / first.tokens_at_gpu_hours if first.tokens_at_gpu_hours else math.nan
            row += f" {_num(r.tokens_at_gpu_hours)} | {ratio:.3f} |"
        lines.append(row)
    lines += ["", f"Time lost by cause ({unit}; degraded = running slower on fewer replicas or in efficient mode)", ""]
    lines.append("| policy | " + " | ".join(LOST_CAUSES) + " | share of wall |")
    lines.append("|---|" + "---|" * (len(LOST_CAUSES) + 1))
    for r in res.policies:
        lost = [r.lost_s[k] for k in LOST_CAUSES]
        share = sum(lost) / r.wall_s if r.wall_s else 0.0
        lines.append(f"| {r.policy} | " + " | ".join(f"{v / scale:.3g}" for v in lost) + f" | {share:.1%} |")
    # The same time in the buckets a real run's goodput is accounted in (core.goodput; docs/goodput.md).
    badput = [r.badput() for r in res.policies]
    used = [b for b in Bucket if any(x[b] for x in badput)]
    if used:
        lines += ["", f"The same in goodput buckets ({unit}), as a real run's summary and report give them", ""]
        lines += ["| policy | " + " | ".join(map(str, used)) + " |", "|---|" + "---|" * len(used)]
        for r, x in zip(res.policies, badput, strict=True):
            lines.append(f"| {r.policy} | " + " | ".join(f"{x[b] / scale:.3g}" for b in used) + " |")
    return "\n".join(lines)


def _json(res: SimResult) -> dict[str, Any]:
    def policy(r: PolicyResult) -> dict[str, Any]:
        return {
            "policy": r.policy,
            "finished": r.finished,
            "wall_s": r.wall_s,
            "steps": r.steps,
            "committed_tokens": r.committed_tokens,
            "tokens_per_s": r.tokens_per_s,
            "failure_free_tokens_per_s": r.failure_free_tokens_per_s,
            "committed_microbatches": r.committed_microbatches,
            "dropped_microbatches": r.dropped_microbatches,
            "recomputed_microbatches": r.recomputed_microbatches,
            "failures": r.failures,
            "restarts": r.restarts,
            "gpu_hours": r.gpu_hours,
            "tokens_at_gpu_hours": None if math.isnan(r.tokens_at_gpu_hours) else r.tokens_at_gpu_hours,
            "lost_s": r.lost_s,
            "series": {
                "t_s": r.series_t.tolist(),
                "committed_microbatches": r.series_microbatches.tolist(),
                "replicas": r.series_members.tolist(),
            },
        }

    return {
        "failure_free_step_s": res.failure_free_step_s,
        "microbatch_s": res.costs.microbatch_s,
        "allreduce_s": res.costs.allreduce_s(res.scenario.cluster.replicas),
        "gpu_failures": res.timeline.gpu_failures,
        "replica_failures": res.timeline.replica_failures,
        "policies": [policy(r) for r in res.policies],
    }


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--out draws plots and needs matplotlib: pip install 'unbroken[plots]'") from None
    return Figure


def _figure(height: float = 3.6) -> tuple[Any, Any]:
    # matplotlib.figure.Figure, not pyplot: no global state and no GUI backend, so it works headless.
    fig = _figure_class()(figsize=(8, height), layout="constrained")
    return fig, fig.add_subplot(1, 1, 1)


def plot(res: SimResult, out: Path) -> None:
    """The four PNGs of ``PLOTS`` into ``out``."""
    unit, scale = _unit(max(r.wall_s for r in res.policies))
    fig, ax = _figure()
    for r in res.policies:
        ax.plot(r.series_t / scale, r.series_microbatches * r.tokens_per_microbatch, label=r.policy)
    ax.set(xlabel=f"wall time ({unit})", ylabel="committed tokens", title="Committed tokens")
    ax.legend()
    fig.savefig(out / "tokens_vs_time.png", dpi=100)

    fig, ax = _figure()
    for r in res.policies:
        ax.plot(res.timeline.gpu_hours(r.series_t), r.series_microbatches * r.tokens_per_microbatch, label=r.policy)
    if res.scenario.run.report_gpu_hours:
        ax.axvline(res.scenario.run.report_gpu_hours, color="grey", linestyle=":")
    ax.set(xlabel="GPU-hours held by the job", ylabel="committed tokens", title="Committed tokens per GPU-hour")
    ax.legend()
    fig.savefig(out / "tokens_vs_gpu_hours.png", dpi=100)

    fig, ax = _figure(height=1.6 + 0.5 * len(res.policies))
    left = np.zeros(len(res.policies))
    names = [r.policy for r in res.policies]
    for cause in LOST_CAUSES:
        values = np.array([max(0.0, r.lost_s[cause]) / scale for r in res.policies])
        ax.barh(names, values, left=left, label=cause)
        left += values
    ax.set(xlabel=f"time lost ({unit})", title="Time lost by cause")
    ax.invert_yaxis()
    fig.legend(loc="outside lower center", fontsize="small", ncols=4)
    fig.savefig(out / "lost_time.png", dpi=100)

    fig, ax = _figure()
    for r in res.policies:
        ax.step(r.series_t / scale, r.series_members, where="post", label=r.policy)
    ax.set(xlabel=f"wall time ({unit})", ylabel="replicas in the group", title="Replicas training")
    ax.legend()
    fig.savefig(out / "replicas.png", dpi=100)


def write_outputs(res: SimResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.toml").write_text(to_toml(res.scenario))
    (out / "summary.md").write_text(format_markdown(res) + "\n")
    (out / "results.json").write_text(json.dumps(_json(res), indent=1) + "\n")
    plot(res, out)


def check_out(out: Path | None) -> None:
    """Refuse an ``--out`` that cannot be written (not a directory, or no matplotlib for the plots)."""
    if out is not None:
        _figure_class()
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a directory")


def dry_run_line(what: str, sc: Scenario, out: Path | None, written: str, layout: bool = True) -> str:
    """The one line of ``unbroken simulate ... --dry-run``: the scenario ``sc`` (loaded and checked; ``layout``:
    its replicas said too) and what a run would print and write."""
    c, run = sc.cluster, sc.run
    replicas = f" ({c.replicas} replicas of {c.replica_gpus})" if layout else ""
    length = f"{run.hours:g} h" if run.hours > 0 else f"{run.steps} steps"
    into = f", writing {written} into {out}" if out is not None else ""
    return (
        f"dry run: would simulate {what}: {', '.join(str(p) for p in run.policies)} on {c.gpus} GPUs{replicas} "
        f"for {length}, printing the tables{into}; nothing simulated or written"
    )


def run_simulate(scenario: str | None, overrides: list[str], out: Path | None, dry_run: bool = False) -> int:
    """Entry point of ``unbroken simulate``; ValueError (one line) for bad input, before anything runs.
    ``dry_run``: the scenario loaded and checked, one line said, nothing simulated or written."""
    sc = load_scenario(scenario, overrides)
    check_out(out)
    if dry_run:
        print(
            dry_run_line(scenario or "the default scenario", sc, out, "scenario.toml, summary.md, results.json, plots")
        )
        return 0
    res = simulate(sc)
    print(format_markdown(res))
    if out is not None:
        write_outputs(res, out)
        print(f"\nwrote {', '.join(['scenario.toml', 'summary.md', 'results.json', *PLOTS])} to {out}")
    return 0
