"""What a person watching a local run sees: the live progress bar (or plain lines off a terminal) and the
summary table at the end, both read from the run's metrics records."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from unbroken.core.records import committed_steps


def format_step(record: dict[str, Any], total_steps: int) -> str:
    """The one-line step summary: ``step 120/200 | loss 4.1234 | lr 3.0e-04 | 812 ms | 40,210 tok/s | alive 4``."""
    return (
        f"step {record['step'] + 1}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.1e} | "
        f"{record['step_time_s'] * 1000:.0f} ms | {record['tokens_per_s']:,.0f} tok/s | "
        f"alive {record['alive']}"
    )


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("ch") else f"{n} {noun}s"


class ProgressView:
    """A live rich progress bar on a terminal; plain periodic lines otherwise (CI, pipes)."""

    def __init__(self, total_steps: int, enabled: bool) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.live = enabled and sys.stdout.isatty()
        self.every = max(1, total_steps // 20)
        self.val = ""
        self.alive: int | None = None  # members of the newest epoch (a step record's count lags a rejoin)
        self._bar: Any = None

    def __enter__(self) -> ProgressView:
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                refresh_per_second=2,  # its refresh thread shares the workers' cores
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total, info="starting workers")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        elif self.enabled:
            print(text, flush=True)

    def show(self, line: str) -> None:
        """A line the script printed (the group leader's): above the bar, as written; shown under ``--quiet``
        too (the script's output is not progress)."""
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def update(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "eval":
            self.val = f" | val {record['val_loss']:.3f}"
            self.note(
                f"eval at step {record['step'] + 1}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.1f}"
            )
        elif kind in ("membership", "failure", "resume", "checkpoint_rejected", "nonfinite_skip", "stall", "stopped"):
            if kind == "membership":
                self.alive = len(record["members"])
            self.note(describe(record))
        elif kind == "impure_data":  # a warning, shown under --quiet too
            print(f"unbroken: warning: {record['reason']}", file=sys.stderr, flush=True)
        elif kind == "step":
            if self._bar is not None:
                alive = self.alive if self.alive is not None else record["alive"]
                info = f"loss {record['loss']:.3f}{self.val} | {record['tokens_per_s']:,.0f} tok/s | alive {alive}"
                self._bar.update(self._task, completed=record["step"] + 1, info=info)
            elif self.enabled and ((record["step"] + 1) % self.every == 0 or record["step"] == 0):
                print(format_step(record, self.total), flush=True)


def describe(record: dict[str, Any]) -> str:
    """One line a person reads about a membership, failure or other event record."""
    kind = record["type"]
    if kind == "membership":
        return f"epoch {record['epoch']}: members {record['members']} ({record['reason']})"
    if kind == "failure":
        detected = f", detected in {record['detection_s'] * 1000:.0f} ms" if "detection_s" in record else ""
        return f"worker {record['worker']} failed: {record.get('event') or record['why']}{detected}"
    if kind == "resume":
        return f"resumed from step {record['step']} ({record['path']})"
    if kind == "checkpoint_rejected":
        return f"checkpoint rejected: {record['detail']}"
    if kind == "nonfinite_skip":
        return (
            f"step {record['step']} skipped on every worker: non-finite gradient in microbatches "
            f"{record['microbatches']} of workers {record['workers']} (first: {record['parameter']})"
        )
    if kind == "stall":
        return f"collective timed out in epoch {record['epoch']}: {record['decision']} (suspects {record['suspects']})"
    if kind == "stopped":
        return f"stopped: {record['reason']}"
    return kind


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Run totals from the metrics records: steps, tokens, losses, throughput, failures and their cost."""
    steps = committed_steps(records)
    evals = [r for r in records if r.get("type") == "eval"]
    ordered = [steps[s] for s in sorted(steps)]
    tokens = sum(r["tokens"] for r in ordered)
    times = [r["step_time_s"] for r in ordered if r["step_time_s"] == r["step_time_s"]]
    train_time = sum(times)
    last = ordered[-10:]
    failures = [r for r in records if r.get("type") == "failure"]
    recoveries = [r for r in records if r.get("type") == "recovery"]
    recovering = [r for r in ordered if r.get("recoveries")]
    median = statistics.median(times) if times else 0.0
    size = {r["epoch"]: len(r["members"]) for r in records if r.get("type") == "membership"}

    def shrank(recovery: dict[str, Any]) -> bool:  # re-formed after a failure, not after a rejoin
        return size.get(recovery["epoch"], 0) < size.get(recovery["from_epoch"], 0)

    return {
        "steps": len(ordered),
        "tokens": tokens,
        "first_loss": ordered[0]["loss"] if ordered else float("nan"),
        "train_loss": sum(r["loss"] for r in last) / len(last) if last else float("nan"),
        "val_loss": evals[-1]["val_loss"] if evals else float("nan"),
        "val_ppl": evals[-1]["val_ppl"] if evals else float("nan"),
        "tokens_per_s": tokens / train_time if train_time else 0.0,
        "wall_s": wall_s,
        "failures": failures,
        "skipped": sorted(r["step"] for r in records if r.get("type") == "nonfinite_skip"),
        "rejoins": [
            r for r in records if r.get("type") == "membership" and str(r.get("reason", "")).startswith("joined")
        ],
        "restarts": sum(1 for r in records if r.get("type") == "restart"),
        "detection_s": [f["detection_s"] for f in failures if "detection_s" in f],
        "reform_s": [r["reform_s"] for r in recoveries if shrank(r)],
        "rejoin_reform_s": [r["reform_s"] for r in recoveries if not shrank(r)],
        "recomputed": sum(r.get("recomputed", 0) for r in ordered),
        "dropped": sum(r.get("dropped", 0) for r in ordered),
        "recovery_extra_s": sum(r["step_time_s"] - median for r in recovering),
        "identical_params": next((r["identical"] for r in records if r.get("type") == "final"), None),
    }


def print_summary(run_dir: Path, records: list[dict[str, Any]], wall_s: float, total_steps: int) -> None:
    from rich.console import Console
    from rich.table import Table

    s = summarize(records, wall_s)
    table = Table(title=f"unbroken run summary ({run_dir})", show_header=False)
    table.add_row("steps", f"{s['steps']} of {total_steps}")
    if s["skipped"]:
        table.add_row("skipped steps", f"{s['skipped']} (a non-finite gradient: no optimizer step)")
    table.add_row("tokens", f"{s['tokens']:,}")
    last = min(10, s["steps"])
    mean = f"mean of the last {last} steps" if last > 1 else "the last step"
    table.add_row("train loss", f"{s['first_loss']:.4f} -> {s['train_loss']:.4f} ({mean})")
    if s["val_loss"] == s["val_loss"]:
        table.add_row("validation", f"loss {s['val_loss']:.4f}, perplexity {s['val_ppl']:.1f}")
    else:
        table.add_row("validation", "none recorded (ctx.evaluate records one)")
    table.add_row("throughput", f"{s['tokens_per_s']:,.0f} tokens/s (training), wall {s['wall_s']:.1f} s")
    if s["failures"]:
        for f in s["failures"]:
            what = f.get("event") or f["why"]
            table.add_row(
                "failure survived",
                f"worker {f['worker']}: {what}"
                + (f" (detected in {f['detection_s'] * 1000:.0f} ms)" if "detection_s" in f else ""),
            )
        if s["reform_s"]:
            table.add_row(
                "recovery",
                f"group re-formed in {max(s['reform_s']) * 1000:.0f} ms at most; "
                f"{_plural(s['recomputed'], 'microbatch')} recomputed in-step, {s['dropped']} dropped, "
                f"{s['recovery_extra_s']:.2f} s over the median step time in total",
            )
        for r, reform in zip(s["rejoins"], s["rejoin_reform_s"] + [None] * len(s["rejoins"]), strict=False):
            took = f" (group re-formed in {reform * 1000:.0f} ms)" if reform is not None else ""
            table.add_row("rejoined", f"worker {r['reason'].split(': ')[1]}: members {r['members']}{took}")
        if s["restarts"]:
            table.add_row("restarts", f"{s['restarts']} (restart policy: rollback to the last checkpoint)")
    else:
        table.add_row("failures", "none")
    if s["identical_params"] is not None:
        table.add_row("workers' parameters", "identical" if s["identical_params"] else "DIFFERENT")
    impure = [r for r in records if r.get("type") == "impure_data"]
    if impure:
        table.add_row("data check", f"FAILED at step {impure[0]['step']}: the data is not a pure function of (seed, "
                      "step, id), so recovered steps are not the failure-free ones")  # fmt: skip
    Console().print(table)
