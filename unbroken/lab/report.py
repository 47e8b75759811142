"""``unbroken report RUN_DIR [REFERENCE_RUN_DIR]``: plots and a markdown summary of a finished (or interrupted) run.

Owns turning a run directory's ``metrics.jsonl`` into ``report/``: ``loss.png`` (loss against step, overlaid
on a reference run's with the per-step difference), ``throughput.png`` (tokens/s over wall time),
``membership.png`` (which workers were alive when, with failure, detection, re-formation, rejoin and spare
markers), ``goodput.png`` (where the badput went, ``core.goodput``: by bucket, and over the steps from the run's
``goodput`` records) and ``report.md`` (steps, losses, throughput, goodput, failures survived and what they cost,
rejoins and spares promoted, and, with a reference, whether the two loss trajectories are bitwise equal). Every
figure is read from the run's facts (``core.runfacts``: the records folded once, as the console summary and
``unbroken status`` read them, so the three state the same counts and times).

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

from unbroken.core.goodput import Bucket, account
from unbroken.core.records import Quotas, RecordKind
from unbroken.core.runfacts import Failure, Join, RunFacts, Step

PLOTS = ("loss.png", "throughput.png", "membership.png", "goodput.png")
# The fields the report reads unconditionally, per record kind.
REQUIRED = {
    RecordKind.STEP: ("step", "loss", "time"),
    RecordKind.EVAL: ("step", "val_loss", "val_ppl"),
    RecordKind.MEMBERSHIP: ("epoch", "members", "time"),
    RecordKind.FAILURE: ("worker", "time"),
    RecordKind.RESTART: ("time",),
    RecordKind.FINAL: ("checksums",),
}


@dataclass(frozen=True)
class Run:
    """One run directory's metrics records, checked, and their facts."""

    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any]
    torn_last_line: bool  # the writer was killed mid-line; that line is ignored
    facts: RunFacts

    @property
    def steps(self) -> list[Step]:
        """Each step once, in step order (``core.runfacts``)."""
        return list(self.facts.steps.values())

    @property
    def losses(self) -> dict[int, float]:
        return {s.step: s.loss for s in self.steps}

    @property
    def t0(self) -> float:
        """Wall-clock origin of the time axes: the first record, which is the coordinator's ``coordinator``
        record, written as it starts (in a file older than that record, the first epoch)."""
        return float(self.facts.first_time)  # type: ignore[arg-type]  # a step record has a time

    @property
    def t_end(self) -> float:
        return float(self.facts.last_time)  # type: ignore[arg-type]

    def since(self, t: float | None) -> float | None:
        """``t`` on the report's time axes (seconds since ``t0``)."""
        return None if t is None else t - self.t0


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
                torn = True  # the same leniency as records.read_records: a killed writer leaves half a line
                continue
            raise ValueError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
        _check(record, f"{path}:{n}")
        records.append(quotas.expand(record))
    if not any(r["type"] == RecordKind.STEP for r in records):
        raise ValueError(f"{role} {run_dir}: metrics.jsonl records no training step; nothing to report")
    config: dict[str, Any] = {}
    if (run_dir / "config.toml").is_file():
        try:
            config = tomllib.loads((run_dir / "config.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{run_dir / 'config.toml'}: {e}") from None
    return Run(run_dir, records, config, torn, RunFacts.of(records))


def _check(record: Any, where: str) -> None:
    """ValueError unless ``record`` is a metrics record with the fields the report reads."""
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise ValueError(f"{where}: not a metrics record (a JSON object with a 'type')")
    missing = [k for k in REQUIRED.get(record["type"], ()) if k not in record]  # type: ignore[call-overload]
    if missing:
        raise ValueError(f"{where}: a {record['type']} record without {', '.join(map(repr, missing))}")
    if record["type"] == RecordKind.STEP and not (
        isinstance(record["step"], int) and isinstance(record["loss"], int | float)
    ):
        raise ValueError(f"{where}: a step record needs an integer 'step' and a numeric 'loss'")
    if "time" in record and not isinstance(record["time"], int | float):
        raise ValueError(f"{where}: 'time' must be a number")


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
        None if r.facts.final is None else next(iter(r.facts.final.checksums.values()), None) for r in (run, reference)
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


def committed_after(failure: Failure) -> float | None:
    """From the fault (or its detection) to the commit of the step its re-formation interrupted."""
    redone, start = failure.redone, failure.fault_at
    if redone is None or redone.step != failure.step or redone.time is None or start is None:
        return None
    return redone.time - start


# -- markdown -----------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return f"{x * 1000:.0f} ms" if x is not None else "-"


def _s(x: float | None) -> str:
    return f"{x:.2f} s" if x is not None else "-"


def _setup(config: dict[str, Any]) -> list[str]:
    recovery, model = config.get("recovery", {}), config.get("model", {})
    setup = [
        f"policy `{recovery['policy']}`" if "policy" in recovery else "",
        f"reduction `{recovery['reduction']}`" if "reduction" in recovery else "",
        f"model: Hugging Face `{model['hf_config']}`"
        if model.get("hf_config")
        else f"model.flavour `{model['flavour']}`"
        if "flavour" in model
        else "",
    ]
    return ["Configuration: " + ", ".join(x for x in setup if x) + ".", ""] if any(setup) else []


def _table(run: Run) -> list[str]:
    """The run's figures: steps, tokens, losses, throughput, wall time, microbatches, sessions."""
    f, steps = run.facts, run.steps
    planned = run.config.get("train", {}).get("steps")
    of = "" if planned is None else f" of {planned}"
    unfinished = "" if f.final is not None else "; the run did not finish"
    last = steps[-10:]
    val = f.evaluations[-1] if f.evaluations else None
    timed = [s for s in steps if s.step_time_s is not None and s.tokens_per_s is not None]
    median_rate = statistics.median(s.tokens_per_s for s in timed) if timed else math.nan  # type: ignore[type-var]
    median_step = statistics.median(s.step_time_s for s in timed) if timed else math.nan  # type: ignore[type-var]
    sessions = len(f.sessions)
    lines = [
        "| | |",
        "|---|---|",
        f"| steps | {f.steps_done}{of} (last step {f.last_step}){unfinished} |",
        f"| tokens | {f.tokens:,} |",
        f"| train loss | {steps[0].loss:.4f} -> {steps[-1].loss:.4f} (final step; mean of the last 10: "
        f"{sum(s.loss for s in last) / len(last):.4f}) |",
        f"| validation | loss {val.val_loss:.4f}, perplexity {val.val_ppl:.1f} (after step {val.step}) |"
        if val is not None
        else "| validation | none recorded |",
        f"| throughput | {f.tokens_per_s:,.0f} tokens/s over training time "
        f"(median step {median_rate:,.0f} tokens/s, {median_step * 1000:.0f} ms) |",
        f"| wall time | {f.wall_s:.1f} s from the coordinator's start to the last record"
        + (f" (summed over {sessions} sessions)" if sessions > 1 else "")
        + " |",
        f"| microbatches | {f.recomputed} recomputed in-step, {f.dropped} dropped, {f.efficient} in efficient (MeCeFO) "
        "mode |",
    ]
    if sessions > 1:
        at = ", ".join(map(str, f.resumes)) or "-"
        lines.append(
            f"| sessions | {sessions} (resumed at step {at}); a step trained again is counted once, with its later "
            "record |"
        )
    lines += [f"| config changed | {c.line()} |" for c in f.changes]
    if f.final is not None and f.final.identical is not None:
        lines.append(f"| workers' parameters at the end | {'identical' if f.final.identical else 'DIFFERENT'} |")
    if run.torn_last_line:
        lines.append("| note | the last line of metrics.jsonl was cut off (the writer was killed) and is ignored |")
    return lines


def _failures(run: Run) -> list[str]:
    """Each failure survived and what it took; the rejoins, the spares promoted, the restarts."""
    f = run.facts
    found = f.declared_failures
    promoted = f", {len(f.promotions)} promoted from a warm spare" if f.promotions else ""
    lines = ["", f"## Failures survived: {len(found)}", ""]
    lines += [f"{len(f.recoveries)} recovered in-step, {len(f.rejoins)} rejoined{promoted} (a join is not counted "
              "as a recovery).", ""]  # fmt: skip
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
        for x in found:
            rec = x.recovery
            lines.append(
                f"| {x.worker} | `{x.what}` | {run.since(x.fault_at) or 0.0:.2f} s | {_ms(x.detection_s)} | "
                f"{x.step if x.step is not None else '-'} | {_ms(None if rec is None else rec.reform_s)} | "
                f"{_ms(None if rec is None else rec.formed_after_epoch_s)} | {_s(committed_after(x))} |"
            )
    if f.rejoins:
        lines += ["", "| rejoined | at | members after | trains from step |", "|---|---|---|---|"]
        for j in f.rejoins:
            step = j.step if j.step is not None else "-"
            workers = ", ".join(map(str, j.rejoined))
            lines.append(f"| worker {workers} | {run.since(j.time) or 0.0:.2f} s | {j.members} | {step} |")
    if f.promotions:
        lines += ["", "| spare promoted | in the place of | in the group after the death | trains from step |"]
        lines.append("|---|---|---|---|")
        for p in f.promotions:
            step = "-" if p.join is None or p.join.step is None else p.join.step
            lines.append(f"| spare {p.spare} | worker {p.worker} | {_s(p.after_death_s)} | {step} |")
    for r in f.restarts:
        lines.append(
            f"\nRestart (checkpoint-and-restart policy) at {run.since(r.time) or 0.0:.2f} s: stopped and relaunched "
            f"workers {r.workers} in {_s(r.stop_and_relaunch_s)}, then rolled back to the last checkpoint."
        )
    return lines


def _goodput(run: Run) -> list[str]:
    g = account(run.facts)
    lines = ["", "## Goodput", "", g.line() + ".", "", "| badput | seconds | share |", "|---|---|---|"]
    for bucket, seconds in sorted(g.buckets.items(), key=lambda item: -abs(item[1])):
        if seconds:
            share = f"{100 * seconds / g.badput_s:.1f} %" if g.badput_s > 0 else "-"
            lines.append(f"| {bucket} | {seconds:.2f} | {share} |")
    return lines


def _against(run: Run, reference: Run) -> list[str]:
    c = compare(run, reference)
    coverage = f"{c.common_steps} steps in common"
    if c.only_run or c.only_reference:
        coverage += f" ({c.only_run} only in this run, {c.only_reference} only in the reference)"
    worst = f" (step {c.max_diff_step})" if c.max_diff_step is not None and c.max_abs_diff > 0 else ""
    lines = [
        "",
        f"## Against the reference `{reference.path}`",
        "",
        f"- {coverage}",
        f"- max |loss difference|: {c.max_abs_diff:.6g}{worst}",
        f"- loss trajectories bitwise equal: **{'yes' if c.bitwise_equal else 'no'}**",
    ]
    if c.final_params_equal is not None:
        lines.append(f"- final parameters identical (checksums): **{'yes' if c.final_params_equal else 'no'}**")
    return lines


def render_markdown(run: Run, reference: Run | None) -> str:
    lines = [f"# unbroken run report: `{run.path}`", "", *_setup(run.config), *_table(run), *_failures(run)]
    lines += _goodput(run)
    if reference is not None:
        lines += _against(run, reference)
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
    evals = run.facts.evaluations
    if evals:
        ax.plot([e.step for e in evals], [e.val_loss for e in evals], "s", color="C2", ms=4, label="validation")
    for f in run.facts.declared_failures:
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


def _joins(run: Run) -> list[Join]:
    """The joins on the time axes: rejoins and spares' promotions."""
    return [j for j in run.facts.joins if j.time is not None]


def _event_lines(ax: Any, run: Run) -> None:
    for f in run.facts.declared_failures:
        ax.axvline(run.since(f.fault_at), color="C3", ls="--", lw=0.8)
    for j in _joins(run):
        ax.axvline(run.since(j.time), color="C2", ls="--", lw=0.8)


def plot_throughput(run: Run, path: Path) -> None:
    points = [(s.time - run.t0, s.tokens_per_s) for s in run.steps if s.tokens_per_s is not None and s.time is not None]
    fig, (ax,) = _figure()
    ax.plot([t for t, _ in points], [v for _, v in points], color="C0", marker=".")
    _event_lines(ax, run)
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, run.t_end - run.t0)
    ax.set_xlabel("wall time since the coordinator started (s)")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput per committed step (red: failure, green: a worker joined)")
    fig.savefig(path, dpi=100)


def _alive(run: Run) -> dict[int, list[list[float]]]:
    """Worker -> the [start, stop] intervals it was a member (seconds since ``t0``)."""
    epochs = sorted((e for e in run.facts.epochs if e.time is not None), key=lambda e: e.time)  # type: ignore[arg-type, return-value]
    workers = {w for e in epochs for w in e.members} | {f.worker for f in run.facts.declared_failures}
    alive: dict[int, list[list[float]]] = {w: [] for w in sorted(workers)}
    for i, e in enumerate(epochs):
        start = e.time - run.t0  # type: ignore[operator]
        stop = (epochs[i + 1].time if i + 1 < len(epochs) else run.t_end) - run.t0  # type: ignore[operator]
        for w in e.members:
            if alive[w] and alive[w][-1][1] == start:
                alive[w][-1][1] = stop
            else:
                alive[w].append([start, stop])
    return alive


def plot_membership(run: Run, path: Path) -> None:
    alive = _alive(run)
    workers = list(alive)
    fig, (ax,) = _figure(height=max(2.4, 0.5 * len(workers) + 1.4))
    for w, spans in alive.items():
        ax.broken_barh([(a, b - a) for a, b in spans], (w - 0.3, 0.6), color="C0", alpha=0.7)
    seen: set[str] = set()  # legend entries are added once per kind

    def mark(t: float | None, w: float, style: str, color: str, label: str) -> None:
        if t is not None:
            ax.plot([t], [w], style, color=color, ms=9, mew=2, label=None if label in seen else label)
            seen.add(label)

    for f in run.facts.declared_failures:
        if f.injected_at is not None:
            mark(run.since(f.injected_at), f.worker, "x", "C3", "fault injected")
        mark(run.since(f.detected_at), f.worker, "v", "C1", "detected")
    for r in run.facts.reformations:
        mark(run.since(r.time_reformed), -0.75, "|", "C4", "group re-formed")
    for j in _joins(run):
        for w in j.workers:
            label = "spare took its place" if w in j.spares else "rejoined"
            mark(run.since(j.time), w, "^", "C5" if w in j.spares else "C2", label)
    for r in run.facts.restarts:
        if r.time is not None:
            ax.axvline(r.time - run.t0, color="k", ls=":", lw=1)
    ax.set_yticks([-0.75, *workers], ["re-formed", *[f"worker {w}" for w in workers]])
    ax.set_ylim(-1.2, max(workers, default=0) + 0.8)
    ax.set_xlim(0, run.t_end - run.t0)
    ax.set_xlabel("wall time since the coordinator started (s)")
    ax.set_title("membership: alive workers over time")
    if seen:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(seen), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)


def plot_goodput(run: Run, path: Path) -> None:
    """Where the badput went: the run's account (core.goodput), seconds by bucket; over the steps too when the
    run has ``goodput`` records (stacked)."""
    g = account(run.facts)
    over_time = [r for r in run.facts.goodput if isinstance(r.get("buckets"), dict)]
    fig, axes = _figure(rows=2 if over_time else 1, height=3.2)
    named = sorted(((b, s) for b, s in g.buckets.items() if s), key=lambda item: item[1])
    ax = axes[-1] if over_time else axes[0]
    ax.barh(
        [str(b) for b, _ in named],
        [s for _, s in named],
        color=["C7" if b is Bucket.UNATTRIBUTED else "C3" for b, _ in named],
    )
    ax.set_xlabel("badput (s)")
    ax.set_title(g.line(), fontsize=8)
    if over_time:
        top = axes[0]
        steps = [r["step"] for r in over_time]
        buckets = [b for b in g.buckets if b is not Bucket.UNATTRIBUTED]
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
