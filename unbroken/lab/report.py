"""``unbroken report RUN_DIR [REFERENCE_RUN_DIR]``: plots and a markdown summary of a finished (or interrupted) run.

Owns turning a run directory's ``metrics.jsonl`` into ``report/``: ``loss.png`` (loss against step, overlaid
on a reference run's with the per-step difference), ``throughput.png`` (tokens/s over wall time),
``membership.png`` (which workers were alive when, with failure, detection, re-formation and rejoin markers),
``goodput.png`` (where the badput went, ``core.goodput``: by bucket, and over the steps from the run's ``goodput``
records) and ``report.md`` (steps, losses, throughput, goodput, failures survived and what they cost, and, with a
reference, whether the two loss trajectories are bitwise equal).

It only reads: it never imports torch (a report runs anywhere the files are), and matplotlib, an optional
extra (``pip install 'unbroken[plots]'``), is imported only when the plots are drawn. Everything is read and
checked before anything is written, so bad input raises ``ValueError`` and leaves no partial report.
"""

from __future__ import annotations

import json
import math
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.core.config import config_change_lines
from unbroken.core.goodput import account
from unbroken.core.records import Quotas, committed_steps, formed_after_epoch, is_join, sessions, wall_s

PLOTS = ("loss.png", "throughput.png", "membership.png", "goodput.png")
# The fields the report reads unconditionally, per record type (metrics.py lists the types).
REQUIRED = {
    "step": ("step", "loss", "time"),
    "eval": ("step", "val_loss", "val_ppl"),
    "membership": ("epoch", "members", "time"),
    "failure": ("worker", "time"),
    "restart": ("time",),
    "final": ("checksums",),
}


@dataclass(frozen=True)
class Run:
    """One run directory's metrics records, checked and sorted into what the report uses."""

    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any]
    torn_last_line: bool  # the writer was killed mid-line; that line is ignored

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind]

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Committed step records in step order; a step repeated after a resume keeps its last record.
        Records re-published by a new leader carry no timing and are used only for a step otherwise missing."""
        return list(committed_steps(self.records).values())

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.steps}

    @property
    def t0(self) -> float:
        """Wall-clock origin of the time axes: the first timed record, which is the coordinator's ``coordinator``
        record, written as it starts (in a file older than that record, the first epoch)."""
        return min(r["time"] for r in self.records if "time" in r)

    @property
    def t_end(self) -> float:
        return max(r["time"] for r in self.records if "time" in r)


def load_run(run_dir: Path, role: str = "run") -> Run:
    """Read and check ``run_dir/metrics.jsonl`` (and ``config.toml`` when present).

    Raises:
        ValueError: the directory or its metrics are missing, a line is not a JSON object with a ``type``,
            a step record lacks its step or loss, or no step was recorded.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{role} {run_dir}: no such directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{role} {run_dir}: not a run directory (no metrics.jsonl)")
    text = path.read_text()
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    quotas = Quotas()
    torn = False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                torn = True  # the same leniency as metrics.read_records: a killed writer leaves half a line
                continue
            raise ValueError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise ValueError(f"{path}:{n}: not a metrics record (a JSON object with a 'type')")
        missing = [k for k in REQUIRED.get(record["type"], ()) if k not in record]
        if missing:
            raise ValueError(f"{path}:{n}: a {record['type']} record without {', '.join(map(repr, missing))}")
        if record["type"] == "step" and not (
            isinstance(record["step"], int) and isinstance(record["loss"], int | float)
        ):
            raise ValueError(f"{path}:{n}: a step record needs an integer 'step' and a numeric 'loss'")
        if "time" in record and not isinstance(record["time"], int | float):
            raise ValueError(f"{path}:{n}: 'time' must be a number")
        records.append(quotas.expand(record))
    if not any(r["type"] == "step" for r in records):
        raise ValueError(f"{role} {run_dir}: metrics.jsonl records no training step; nothing to report")
    config: dict[str, Any] = {}
    if (run_dir / "config.toml").is_file():
        try:
            config = tomllib.loads((run_dir / "config.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{run_dir / 'config.toml'}: {e}") from None
    return Run(run_dir, records, config, torn)


# -- analysis -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """A run's loss trajectory against a reference's, over the steps both recorded."""

    common_steps: int
    only_run: int  # steps the run has and the reference lacks
    only_reference: int
    max_abs_diff: float
    max_diff_step: int | None
    bitwise_equal: bool  # same steps and every loss identical to the last bit
    final_params_equal: bool | None  # parameter checksums at the end (None: one of the runs did not finish)


def compare(run: Run, reference: Run) -> Comparison:
    a, b = run.losses, reference.losses
    common = sorted(a.keys() & b.keys())
    diffs = {s: abs(a[s] - b[s]) for s in common}
    worst = max(diffs, key=lambda s: diffs[s]) if diffs else None
    # NaN != NaN, so a NaN loss anywhere makes the runs unequal, which is what we want.
    equal = a.keys() == b.keys() and all(a[s] == b[s] for s in common)
    finals = [
        next(iter(r.of("final")[-1]["checksums"].values()), None) if r.of("final") else None for r in (run, reference)
    ]
    return Comparison(
        common_steps=len(common),
        only_run=len(a.keys() - b.keys()),
        only_reference=len(b.keys() - a.keys()),
        max_abs_diff=diffs[worst] if worst is not None else math.nan,
        max_diff_step=worst,
        bitwise_equal=equal,
        final_params_equal=None if None in finals else finals[0] == finals[1],
    )


@dataclass(frozen=True)
class Failure:
    """One worker failure and what surviving it took; times in seconds since the run's origin."""

    worker: int
    what: str
    injected_at: float | None  # only injected faults know when they happened
    detected_at: float
    detection_s: float | None
    step: int | None  # the step during which the group re-formed without the worker
    reform_s: float | None  # a survivor's wait for the new group, 0 where it was formed ahead (worker-measured)
    formed_after_epoch_s: float | None  # the epoch without the worker published -> the survivors' group on it
    committed_after_s: float | None  # from the fault (or its detection) to that step's commit


def _recovery_after(run: Run, time: float, epoch: int, join: bool = False) -> dict[str, Any] | None:
    """The first group re-formation into ``epoch`` or later after ``time`` that admitted workers (``join``) or
    survived a failure (not ``join``, ``records.is_join``); a restart (which renumbers the epochs from 1) ends
    the search."""
    members: dict[int, list[int]] = {}
    for r in run.records:
        if r["type"] == "membership":
            members[r["epoch"]] = r["members"]
        if r.get("time", -math.inf) < time:
            continue
        if r["type"] == "restart":
            return None
        if r["type"] == "recovery" and r.get("epoch", 0) >= epoch and is_join(r, members) == join:
            return r
    return None


def _formed_after_epoch(run: Run, recovery: dict[str, Any]) -> float | None:
    """``records.formed_after_epoch`` of ``recovery``, the epochs' publications read up to it."""
    published: dict[int, float] = {}
    for r in run.records:
        if r is recovery:
            break
        if r["type"] == "membership":
            published[r["epoch"]] = r["time"]
    return formed_after_epoch(recovery, published)


def failures(run: Run) -> list[Failure]:
    out = []
    commits = {r["step"]: r["time"] for r in run.steps if "time" in r}
    for f in run.of("failure"):
        detection = f.get("detection_s")
        injected = f["time"] - detection if detection is not None else None
        recovery = _recovery_after(run, f["time"], f.get("epoch", 0))
        step = recovery["step"] if recovery else None
        commit = commits.get(step) if step is not None else None
        start = injected if injected is not None else f["time"]
        out.append(
            Failure(
                worker=f["worker"],
                what=f.get("event") or f.get("why", "?"),
                injected_at=injected - run.t0 if injected is not None else None,
                detected_at=f["time"] - run.t0,
                detection_s=detection,
                step=step,
                reform_s=recovery.get("reform_s") if recovery else None,
                formed_after_epoch_s=_formed_after_epoch(run, recovery) if recovery else None,
                committed_after_s=commit - start if commit is not None else None,
            )
        )
    return out


def rejoins(run: Run) -> list[dict[str, Any]]:
    """Membership changes that admitted a worker, with the group re-formation that followed."""
    out = []
    for m in run.of("membership"):
        if not str(m.get("reason", "")).startswith("joined"):
            continue
        recovery = _recovery_after(run, m["time"], m["epoch"], join=True)
        out.append(
            {
                "workers": m["reason"].split(":", 1)[1].strip(),
                "at": m["time"] - run.t0,
                "members": m["members"],
                "step": recovery["step"] if recovery else None,
            }
        )
    return out


def summary(run: Run) -> dict[str, Any]:
    steps = run.steps
    timed = [r for r in steps if _finite(r.get("step_time_s")) and _finite(r.get("tokens_per_s"))]
    train_time = sum(r["step_time_s"] for r in timed)
    tokens = sum(r.get("tokens", 0) for r in steps)
    evals = run.of("eval")
    last = steps[-10:]
    final = run.of("final")
    return {
        "steps": len(steps),
        "last_step": steps[-1]["step"],
        "planned_steps": run.config.get("train", {}).get("steps"),
        "tokens": tokens,
        "first_loss": steps[0]["loss"],
        "final_loss": steps[-1]["loss"],
        "mean_last_loss": sum(r["loss"] for r in last) / len(last),
        "val": evals[-1] if evals else None,
        "tokens_per_s": sum(r.get("tokens", 0) for r in timed) / train_time if train_time else math.nan,
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed) if timed else math.nan,
        "median_step_s": statistics.median(r["step_time_s"] for r in timed) if timed else math.nan,
        "wall_s": wall_s(run.records),
        "sessions": len(sessions(run.records)),
        "resumed_at": [r["step"] for r in run.of("resume")],
        "recomputed": sum(r.get("recomputed", 0) for r in steps),
        "dropped": sum(r.get("dropped", 0) for r in steps),
        "efficient": sum(r.get("efficient", 0) for r in steps),
        "restarts": run.of("restart"),
        "identical": final[-1].get("identical") if final else None,
        "finished": bool(final),
    }


# -- markdown -----------------------------------------------------------------------------------------
def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _ms(x: float | None) -> str:
    return f"{x * 1000:.0f} ms" if x is not None else "-"


def _s(x: float | None) -> str:
    return f"{x:.2f} s" if x is not None else "-"


def render_markdown(run: Run, reference: Run | None) -> str:
    s = summary(run)
    recovery = run.config.get("recovery", {})
    lines = [f"# unbroken run report: `{run.path}`", ""]
    model = run.config.get("model", {})
    setup = [
        f"policy `{recovery['policy']}`" if "policy" in recovery else "",
        f"reduction `{recovery['reduction']}`" if "reduction" in recovery else "",
        f"model: Hugging Face `{model['hf_config']}`"
        if model.get("hf_config")
        else f"model.flavour `{model['flavour']}`"
        if "flavour" in model
        else "",
    ]
    if any(setup):
        lines += ["Configuration: " + ", ".join(x for x in setup if x) + ".", ""]
    planned = f" of {s['planned_steps']}" if s["planned_steps"] is not None else ""
    val = s["val"]
    unfinished = "" if s["finished"] else "; the run did not finish"
    lines += [
        "| | |",
        "|---|---|",
        f"| steps | {s['steps']}{planned} (last step {s['last_step']}){unfinished} |",
        f"| tokens | {s['tokens']:,} |",
        f"| train loss | {s['first_loss']:.4f} -> {s['final_loss']:.4f} (final step; "
        f"mean of the last 10: {s['mean_last_loss']:.4f}) |",
        f"| validation | loss {val['val_loss']:.4f}, perplexity {val['val_ppl']:.1f} (after step {val['step']}) |"
        if val
        else "| validation | none recorded |",
        f"| throughput | {s['tokens_per_s']:,.0f} tokens/s over training time "
        f"(median step {s['median_tokens_per_s']:,.0f} tokens/s, {s['median_step_s'] * 1000:.0f} ms) |",
        f"| wall time | {s['wall_s']:.1f} s from the coordinator's start to the last record"
        + (f" (summed over {s['sessions']} sessions)" if s["sessions"] > 1 else "")
        + " |",
        f"| microbatches | {s['recomputed']} recomputed in-step, {s['dropped']} dropped, "
        f"{s['efficient']} in efficient (MeCeFO) mode |",
    ]
    if s["sessions"] > 1:
        at = ", ".join(map(str, s["resumed_at"])) or "-"
        lines.append(
            f"| sessions | {s['sessions']} (resumed at step {at}); a step trained again is counted once, "
            "with its later record |"
        )
    lines += [f"| config changed | {line} |" for line in config_change_lines(run.records)]
    if s["identical"] is not None:
        lines.append(f"| workers' parameters at the end | {'identical' if s['identical'] else 'DIFFERENT'} |")
    if run.torn_last_line:
        lines.append("| note | the last line of metrics.jsonl was cut off (the writer was killed) and is ignored |")

    found = failures(run)
    joined = rejoins(run)
    lines += ["", f"## Failures survived: {len(found)}", ""]
    recovered = sum(1 for f in found if f.step is not None)
    lines += [f"{recovered} recovered in-step, {len(joined)} rejoined (a join is not counted as a recovery).", ""]
    if found:
        lines += [
            "Times are seconds since the coordinator started. *Detected after*: from the injected fault to the "
            "coordinator publishing the epoch without the worker. *Survivors waited*: from a survivor's "
            "abandoning the old group to its new group, 0 where the group was formed before it noticed. *Formed "
            "after epoch*: from that epoch's publication to the survivors' group formed on it (a worker's clock "
            "against the coordinator's). *Committed after*: from the fault to the commit of the step it "
            "interrupted.",
            "",
            "| worker | fault | at | detected after | step | survivors waited | formed after epoch | committed after |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for f in found:
            at = f.injected_at if f.injected_at is not None else f.detected_at
            lines.append(
                f"| {f.worker} | `{f.what}` | {at:.2f} s | {_ms(f.detection_s)} | "
                f"{f.step if f.step is not None else '-'} | {_ms(f.reform_s)} | {_ms(f.formed_after_epoch_s)} | "
                f"{_s(f.committed_after_s)} |"
            )
    if joined:
        lines += ["", "| rejoined | at | members after | trains from step |", "|---|---|---|---|"]
        for j in joined:
            step = j["step"] if j["step"] is not None else "-"
            lines.append(f"| worker {j['workers']} | {j['at']:.2f} s | {j['members']} | {step} |")
    for r in s["restarts"]:
        lines.append(
            f"\nRestart (checkpoint-and-restart policy) at {r['time'] - run.t0:.2f} s: stopped and relaunched "
            f"workers {r.get('workers')} in {_s(r.get('stop_and_relaunch_s'))}, "
            "then rolled back to the last checkpoint."
        )

    g = account(run.records)
    lines += ["", "## Goodput", "", g.line() + ".", "", "| badput | seconds | share |", "|---|---|---|"]
    for bucket, seconds in sorted(g.buckets.items(), key=lambda item: -abs(item[1])):
        if seconds:
            share = f"{100 * seconds / g.badput_s:.1f} %" if g.badput_s > 0 else "-"
            lines.append(f"| {bucket} | {seconds:.2f} | {share} |")

    if reference is not None:
        c = compare(run, reference)
        lines += ["", f"## Against the reference `{reference.path}`", ""]
        coverage = f"{c.common_steps} steps in common"
        if c.only_run or c.only_reference:
            coverage += f" ({c.only_run} only in this run, {c.only_reference} only in the reference)"
        worst = f" (step {c.max_diff_step})" if c.max_diff_step is not None and c.max_abs_diff > 0 else ""
        lines += [
            f"- {coverage}",
            f"- max |loss difference|: {c.max_abs_diff:.6g}{worst}",
            f"- loss trajectories bitwise equal: **{'yes' if c.bitwise_equal else 'no'}**",
        ]
        if c.final_params_equal is not None:
            lines.append(f"- final parameters identical (checksums): **{'yes' if c.final_params_equal else 'no'}**")

    lines += ["", "## Plots", ""] + [f"![{p.removesuffix('.png')}]({p})" for p in PLOTS] + [""]
    return "\n".join(lines)


# -- plots --------------------------------------------------------------------------------------------
def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("the report's plots need matplotlib: pip install 'unbroken[plots]'") from None
    return Figure


def _figure(rows: int = 1, height: float = 3.6) -> tuple[Any, list[Any]]:
    # matplotlib.figure.Figure, not pyplot: no global state and no GUI backend, so it works headless.
    fig = _figure_class()(figsize=(8, height * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]
    return fig, list(axes)


def plot_loss(run: Run, reference: Run | None, path: Path) -> None:
    a = run.losses
    fig, axes = _figure(2 if reference else 1, 3.2)
    ax = axes[0]
    if reference is not None:
        b = reference.losses
        ax.plot(list(b), list(b.values()), color="0.6", lw=3, label=f"reference ({reference.path.name})")
    ax.plot(list(a), list(a.values()), color="C0", lw=1.2, marker=".", label=f"run ({run.path.name})")
    evals = run.of("eval")
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "s", color="C2", ms=4, label="validation")
    for f in failures(run):
        if f.step is not None:
            ax.axvline(f.step, color="C3", ls="--", lw=0.8)
    ax.set_ylabel("loss")
    ax.set_title("training loss (dashed: steps that lost a worker)")
    ax.legend(loc="upper right", fontsize=8)
    if reference is not None:
        b = reference.losses
        common = sorted(a.keys() & b.keys())
        c = compare(run, reference)
        axes[1].plot(common, [a[s] - b[s] for s in common], color="C1", marker=".")
        axes[1].axhline(0, color="0.5", lw=0.6)
        axes[1].set_ylabel("loss: run - reference")
        axes[1].set_title("bitwise equal" if c.bitwise_equal else f"max |difference| {c.max_abs_diff:.3g}")
    axes[-1].set_xlabel("step")
    fig.savefig(path, dpi=100)


def _event_lines(ax: Any, run: Run) -> None:
    for f in failures(run):
        ax.axvline(f.injected_at if f.injected_at is not None else f.detected_at, color="C3", ls="--", lw=0.8)
    for j in rejoins(run):
        ax.axvline(j["at"], color="C2", ls="--", lw=0.8)


def plot_throughput(run: Run, path: Path) -> None:
    points = [
        (r["time"] - run.t0, r["tokens_per_s"]) for r in run.steps if _finite(r.get("tokens_per_s")) and "time" in r
    ]
    fig, (ax,) = _figure()
    ax.plot([t for t, _ in points], [v for _, v in points], color="C0", marker=".")
    _event_lines(ax, run)
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, run.t_end - run.t0)
    ax.set_xlabel("wall time since the coordinator started (s)")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput per committed step (red: failure, green: rejoin)")
    fig.savefig(path, dpi=100)


def plot_membership(run: Run, path: Path) -> None:
    epochs = sorted(run.of("membership"), key=lambda m: m["time"])
    workers = sorted({w for m in epochs for w in m["members"]} | {f["worker"] for f in run.of("failure")})
    fig, (ax,) = _figure(height=max(2.4, 0.5 * len(workers) + 1.4))
    t0, end = run.t0, run.t_end
    alive: dict[int, list[list[float]]] = {w: [] for w in workers}  # worker -> [start, stop] intervals
    for i, m in enumerate(epochs):
        start = m["time"] - t0
        stop = (epochs[i + 1]["time"] if i + 1 < len(epochs) else end) - t0
        for w in m["members"]:
            if alive[w] and alive[w][-1][1] == start:
                alive[w][-1][1] = stop
            else:
                alive[w].append([start, stop])
    for w, spans in alive.items():
        ax.broken_barh([(a, b - a) for a, b in spans], (w - 0.3, 0.6), color="C0", alpha=0.7)
    # Legend entries are added once per kind.
    seen: set[str] = set()

    def mark(t: float, w: float, style: str, color: str, label: str) -> None:
        ax.plot([t], [w], style, color=color, ms=9, mew=2, label=None if label in seen else label)
        seen.add(label)

    for f in failures(run):
        if f.injected_at is not None:
            mark(f.injected_at, f.worker, "x", "C3", "fault injected")
        mark(f.detected_at, f.worker, "v", "C1", "detected")
    for r in run.of("recovery"):
        if "time_reformed" in r:
            mark(r["time_reformed"] - t0, -0.75, "|", "C4", "group re-formed")
    for j in rejoins(run):
        for w in j["workers"].split(","):
            if w.strip().isdigit():
                mark(j["at"], int(w), "^", "C2", "rejoined")
    for r in run.of("restart"):
        ax.axvline(r["time"] - t0, color="k", ls=":", lw=1)
    ax.set_yticks([-0.75, *workers], ["re-formed", *[f"worker {w}" for w in workers]])
    ax.set_ylim(-1.2, max(workers, default=0) + 0.8)
    ax.set_xlim(0, end - t0)
    ax.set_xlabel("wall time since the coordinator started (s)")
    ax.set_title("membership: alive workers over time")
    if seen:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(seen), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)


def plot_goodput(run: Run, path: Path) -> None:
    """Where the badput went: the run's account (core.goodput), seconds by bucket; over the steps too when the
    run has ``goodput`` records (stacked)."""
    g = account(run.records)
    over_time = [r for r in run.of("goodput") if isinstance(r.get("buckets"), dict)]
    fig, axes = _figure(rows=2 if over_time else 1, height=3.2)
    named = sorted(((b, s) for b, s in g.buckets.items() if s), key=lambda item: item[1])
    ax = axes[-1] if over_time else axes[0]
    ax.barh(
        [str(b) for b, _ in named],
        [s for _, s in named],
        color=["C7" if b == "unattributed" else "C3" for b, _ in named],
    )
    ax.set_xlabel("badput (s)")
    ax.set_title(g.line(), fontsize=8)
    if over_time:
        top = axes[0]
        steps = [r["step"] for r in over_time]
        buckets = [b for b in g.buckets if b != "unattributed"]
        stacks = [[max(0.0, r["buckets"].get(str(b), 0.0)) for r in over_time] for b in buckets]
        top.stackplot(steps, stacks, labels=[str(b) for b in buckets])
        top.set_ylabel("badput so far (s)")
        top.set_xlabel("step")
        top.legend(loc="upper left", fontsize=6, ncol=4, frameon=False)
    fig.savefig(path, dpi=100)


# -- entry point --------------------------------------------------------------------------------------
def write_report(run_dir: Path, reference_dir: Path | None = None, out: Path | None = None) -> Path:
    """Write the plots and ``report.md`` to ``out`` (default ``run_dir/report``); returns ``report.md``'s path.

    Raises:
        ValueError: bad input (see ``load_run``) or matplotlib missing; nothing is written then.
    """
    run = load_run(Path(run_dir))
    reference = load_run(Path(reference_dir), "reference") if reference_dir is not None else None
    markdown = render_markdown(run, reference)
    _figure_class()  # fail on a missing matplotlib before creating the output directory
    out = Path(out) if out is not None else run.path / "report"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    plot_loss(run, reference, out / "loss.png")
    plot_throughput(run, out / "throughput.png")
    plot_membership(run, out / "membership.png")
    plot_goodput(run, out / "goodput.png")
    (out / "report.md").write_text(markdown)
    return out / "report.md"
