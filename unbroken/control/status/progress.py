"""What a person watching a local run sees: the live progress bar (or plain lines off a terminal) and the
summary table at the end, both read from the run's metrics records.

Step numbers are the records' (from 0, as in the failure schedule and ``Step.index``: ``step 3`` is the
fourth step); a count of steps done is said as one (``4/8 done``)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.control.console import Channel, LeaderLine, Story
from unbroken.control.coordinator.failslow import describe as describe_slow
from unbroken.core.config import config_change_lines
from unbroken.core.failures import parse_event
from unbroken.core.goodput import account
from unbroken.core.records import (
    RecordKind,
    SpareState,
    WorkerError,
    committed_steps,
    formed_after_epoch,
    is_join,
    sessions,
)
from unbroken.core.throughput import run_throughput


def format_step(record: dict[str, Any], total_steps: int) -> str:
    """The one-line step summary: ``step 119 | loss 4.1234 | lr 3.0e-04 | 812 ms | 40,210 tok/s | alive 4 |
    120/200 done``."""
    return (
        f"step {record['step']} | loss {record['loss']:.4f} | lr {record['lr']:.1e} | "
        f"{record['step_time_s'] * 1000:.0f} ms | {record['tokens_per_s']:,.0f} tok/s | "
        f"alive {record['alive']} | {record['step'] + 1}/{total_steps} done"
    )


def format_steps(records: list[dict[str, Any]], total_steps: int) -> str:
    """The line of consecutive steps: ``format_step`` for one; for several, ``steps 10-19 | mean loss 4.1234 | lr
    3.0e-04 | 812 ms/step | 40,210 tok/s | alive 4 | 20/200 done``: the mean loss of the steps with a finite one,
    the mean step time, the tokens over the time, the last step's learning rate and members."""
    if len(records) == 1:
        return format_step(records[0], total_steps)
    first, last = records[0], records[-1]
    losses = [r["loss"] for r in records if math.isfinite(r["loss"])]
    loss = sum(losses) / len(losses) if losses else math.nan
    timed = [r for r in records if math.isfinite(r["step_time_s"])]
    seconds = sum(r["step_time_s"] for r in timed)
    rate = sum(r["tokens"] for r in timed) / seconds if seconds > 0 else 0.0
    per_step = seconds / len(timed) * 1000 if timed else math.nan
    return (
        f"steps {first['step']}-{last['step']} | mean loss {loss:.4f} | lr {last['lr']:.1e} | "
        f"{per_step:.0f} ms/step | {rate:,.0f} tok/s | "
        f"alive {last['alive']} | {last['step'] + 1}/{total_steps} done"
    )


def _plural(n: int, noun: str) -> str:
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}es" if noun.endswith("ch") else f"{n} {noun}s"


def _steps(steps: list[int]) -> str:
    """``3``, ``3-5`` or ``3, 7`` for a sorted list of step numbers."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


# Records said in a line of their own, where they stand in the file (the leader's in its order; a stall and a
# refusal when the coordinator decides them).
_SAID = frozenset(
    {RecordKind.RESUME, RecordKind.CHECKPOINT_REJECTED, RecordKind.NONFINITE_SKIP, RecordKind.STALL, RecordKind.REFUSED}
)


class ProgressView:
    """A live rich progress bar on a terminal; plain periodic lines otherwise (CI, pipes). Every line, the
    launcher's and the leader's, goes out through a ``Story`` (``control.console``): in the order of the run."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool,
        microbatches: int | None = None,
        log_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.live = enabled and sys.stdout.isatty()
        self.every = max(1, total_steps // 20)
        self.val = ""
        self.alive: int | None = None  # members of the newest epoch (a step record's count lags a rejoin)
        self.members: dict[int, list[int]] = {}  # epoch -> its members (a re-formation: a join or a recovery?)
        self.microbatches = microbatches  # a step's (train.microbatches)
        self.log_dir = log_dir  # the workers' logs (named under a worker's error)
        self.story = Story(self._emit, clock)
        self._session: dict[int, list[int]] = {}  # this session's epochs and their members
        self._range: list[dict[str, Any]] = []  # plain lines: the steps since the last step line, not said yet
        self._bar: Any = None

    def __enter__(self) -> ProgressView:
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} done"),
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
        self.story.release_all()
        self._say_range()
        if self._bar is not None:
            self._bar.stop()

    def _emit(self, text: str, channel: Channel) -> None:
        """Print one line of the story (the steps done before it first: never a silent gap)."""
        self._say_range()
        if channel is Channel.ERROR:
            print(text, file=sys.stderr, flush=True)
        elif channel is Channel.SCRIPT and self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        elif channel is Channel.SCRIPT:
            print(text, flush=True)
        elif self._bar is not None:
            self._bar.console.print(text)
        elif self.enabled:
            print(text, flush=True)

    def note(self, text: str) -> None:
        """A line of the launcher's (not under ``--quiet``), in the story's order."""
        self.story.say(text)

    def tick(self) -> None:
        """Called between looks at the records: what was held too long without a record is shown."""
        self.story.tick()

    def earlier(self, records: list[dict[str, Any]]) -> None:
        """The records of the run's earlier sessions (``--resume``): folded, not shown again line by line."""
        for r in records:
            if r.get("type") == RecordKind.MEMBERSHIP:
                self.members[int(r["epoch"])] = list(r["members"])
        steps = sorted(committed_steps(records))
        if steps:
            if self._bar is not None:
                self._bar.update(self._task, completed=steps[-1] + 1)
            done = f"committed steps {_steps(steps)}"
            self.note(f"continuing the run: its earlier sessions {done} (not shown again; metrics.jsonl has them)")

    def show(self, line: LeaderLine) -> None:
        """A line the script printed (the group leader's): above the bar, as ``[worker N] text``, once the
        records of its step were shown; shown under ``--quiet`` too (the script's output is not progress)."""
        self.story.script(line)

    def update(self, record: dict[str, Any]) -> None:
        """The next record of metrics.jsonl (in the file's order)."""
        self.story.heard()
        kind = record.get("type")
        if kind == RecordKind.COORDINATOR and not record.get("restored_epoch"):
            self.story.new_session()
            self._session = {}
        elif kind == RecordKind.STEP:
            self._step(record)
        elif kind in (RecordKind.MEMBERSHIP, RecordKind.FAILURE, RecordKind.RECOVERY, RecordKind.ERROR):
            self._reformation(record)
        elif kind == RecordKind.SPARE and record["state"] == SpareState.PROMOTED:
            # before the join that brings it in (the newest epoch seen is the death's)
            line = f"spare {record['spare']} takes the place of worker {record['worker']}"
            self.story.say(line, epoch=max(self._session, default=0) + 1, rank=1)
        elif kind in (RecordKind.STOPPED, RecordKind.FINAL):
            self.story.release_all()  # the story's end; a stop's reason is the launcher's last line (once)
        elif kind == RecordKind.EVAL:
            self.val = f" | val {record['val_loss']:.3f}"
            self.note(
                f"eval after step {record['step']}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.1f}"
            )
        elif kind in _SAID:
            self.note(describe(record))
        elif kind == RecordKind.IMPURE_DATA:  # a warning, shown under --quiet too
            self.story.say(f"unbroken: warning: {record['reason']}", Channel.ERROR)
        elif kind == RecordKind.START_STATE and record["differed"]:
            if record.get("warn"):  # exact mode: shown under --quiet too
                self.story.say(f"unbroken: warning: {record['reason']}", Channel.ERROR)
            else:
                self.note(record["reason"])

    def _reformation(self, record: dict[str, Any]) -> None:
        """A worker's error, a failure, a new epoch, the group re-formed: a new epoch's lines wait until the
        group's records reach it (the coordinator writes its records at once, the leader's come later), the
        error first, then the failure, then the epoch."""
        kind = record["type"]
        if kind == RecordKind.RECOVERY:
            self.story.reached(epoch=int(record["epoch"]))
            self.note(describe_recovery(record, self.members, self.microbatches))
        elif kind == RecordKind.ERROR:
            # Shown under --quiet too, before the re-formation it causes, or once its step is done without one.
            text = describe_error(record, self.log_dir or Path("logs"))
            self.story.say(text, Channel.ERROR, epoch=max(self._session, default=0) + 1, step=record["step"])
        elif kind == RecordKind.FAILURE:
            self.story.say(describe(record), epoch=int(record["epoch"]), rank=1)
        else:
            epoch, members = int(record["epoch"]), list(record["members"])
            before = [m for e, m in self._session.items() if e < epoch]
            changed = bool(before) and set(before[-1]) != set(members)  # the group must re-form
            self.alive = len(members)
            self.members[epoch] = self._session[epoch] = members
            self.story.say(describe(record), epoch=epoch if changed else None, rank=2)

    def _step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self._bar is not None:
            alive = self.alive if self.alive is not None else record["alive"]
            info = (
                f"step {step} | loss {record['loss']:.3f}{self.val} | "
                f"{record['tokens_per_s']:,.0f} tok/s | alive {alive}"
            )
            self._bar.update(self._task, completed=step + 1, info=info)
        elif self.enabled and not record.get("republished"):  # a new leader's copy of a step already said
            if self._range and step != self._range[-1]["step"] + 1:
                self._say_range()  # not the next step (a relaunch from a checkpoint): its own line
            first = not self._range and step == 0
            self._range.append(record)
            if first or (step + 1) % self.every == 0:
                self._say_range()
        self.story.reached(step=step, epoch=record.get("epoch"))

    def _say_range(self) -> None:
        """The plain line of the steps since the last one said (``step 9 | ...`` or ``steps 1-9 | ...``)."""
        if self._range:
            records, self._range = self._range, []
            print(format_steps(records, self.total), flush=True)


def describe(record: dict[str, Any]) -> str:
    """One line a person reads about a membership, failure or other event record."""
    kind = record["type"]
    if kind == "membership":
        return f"epoch {record['epoch']}: members {record['members']} ({record['reason']})"
    if kind == "failure":
        detected = f", detected in {record['detection_s'] * 1000:.0f} ms" if "detection_s" in record else ""
        return f"worker {record['worker']} failed: {record.get('event') or record['why']}{detected}"
    if kind == "resume":
        return f"resumed at step {record['step']} from {record['path']}"
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
    if kind == "refused":
        return record["reason"]
    return kind


def describe_recovery(record: dict[str, Any], members: dict[int, list[int]], microbatches: int | None) -> str:
    """One line about a group re-formation: a recovery (in the step it interrupted) or a join; ``microbatches``
    a step has (a group formed at a step boundary misses all of them: nothing to redo)."""
    step, epoch = record["step"], record["epoch"]
    if is_join(record, members):
        joined = sorted(set(members[epoch]) - set(members[record["from_epoch"]]))
        return f"worker {', '.join(map(str, joined))} rejoined at step {step} (epoch {epoch}, {record['alive']} alive)"
    missing = record.get("missing") or []
    redo = f"; microbatches {missing} to redo" if missing and len(missing) != microbatches else ""
    return f"step {step} goes on with {record['alive']} workers (epoch {epoch}){redo}"


def describe_error(record: dict[str, Any], log_dir: Path) -> str:
    """What the console shows the moment a worker dies of an exception (an ``error`` record): who raised what
    and where, then the last frames of its traceback and the message (the whole traceback is in its log)."""
    error = WorkerError.from_record(record)
    lines = [f"worker {error.worker} raised {error.headline()}"]
    lines += ["  " + line for line in error.traceback.splitlines()]
    lines.append(f"  (the whole traceback: {log_dir / f'worker-{error.worker}.log'})")
    return "\n".join(lines)


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Run totals from the metrics records (every session of the run; each step counted once): steps, tokens,
    losses, throughput, failures and their recoveries, joins, and workers that never came back."""
    steps = committed_steps(records)
    evals = [r for r in records if r.get("type") == "eval"]
    ordered = [steps[s] for s in sorted(steps)]
    tokens = sum(r["tokens"] for r in ordered)
    times = [r["step_time_s"] for r in ordered if r["step_time_s"] == r["step_time_s"]]
    train_time = sum(times)
    last = ordered[-10:]
    failures: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []  # re-formations after a failure (or a stall)
    joins: list[dict[str, Any]] = []  # re-formations that admitted workers: {worker(s), step, epoch, members}
    members: dict[int, list[int]] = {}
    published: dict[int, float] = {}  # each epoch's publication (the coordinator's clock), as read so far
    formed_after: list[float] = []  # each recovery's group, after its epoch's publication
    for r in records:
        kind = r.get("type")
        if kind == "membership":
            members[int(r["epoch"])] = list(r["members"])
            published[int(r["epoch"])] = r["time"]
        elif kind == "failure":
            failures.append({**r, "step": None})
        elif kind == "recovery":
            if is_join(r, members):
                joined = sorted(set(members[r["epoch"]]) - set(members[r["from_epoch"]]))
                joins.append(
                    {"workers": joined, "step": r["step"], "epoch": r["epoch"], "members": members[r["epoch"]]}
                )
                continue
            recoveries.append(r)
            if (formed := formed_after_epoch(r, published)) is not None:
                formed_after.append(formed)
            for f in failures:  # the failures this re-formation survived: the step each interrupted
                if f["step"] is None and r["from_epoch"] < f.get("epoch", 0) <= r["epoch"]:
                    f["step"] = r["step"]
    recovering = [r for r in ordered if r.get("recoveries")]
    median = statistics.median(times) if times else 0.0
    at_end = set(next((r["members"] for r in reversed(records) if r.get("type") == "membership"), []))
    gone: dict[int, dict[str, Any]] = {f["worker"]: f for f in failures if f["worker"] not in at_end}
    resumes = [r for r in records if r.get("type") == "resume"]
    promotions = []
    for p in (r for r in records if r.get("type") == "spare" and r["state"] == SpareState.PROMOTED):
        # The first epoch after the promotion that has the worker again, and the step its group formed in: where
        # the spare started computing. A spare can join before the survivors re-form without it (the one
        # re-formation is then a recovery and a join at once, between epochs with the same members).
        joined = next(
            (
                m
                for m in records
                if m.get("type") == "membership" and m["time"] >= p["time"] and p["worker"] in m["members"]
            ),
            None,
        )
        epoch = joined["epoch"] if joined else None
        # The agent promotes a spare as soon as it sees the exit, before the coordinator's failure record: the
        # time is the death's to the spare's join.
        until = joined["time"] if joined else -math.inf
        died = [f["time"] for f in failures if f["worker"] == p["worker"] and f["time"] <= until]
        formed = next((r for r in records if r.get("type") == "recovery" and r["epoch"] == epoch), None)
        promotions.append(
            {
                "spare": p["spare"],
                "worker": p["worker"],
                "after_death_s": until - died[-1] if died else None,
                "step": formed["step"] if formed else None,
                "epoch": epoch if formed else None,
            }
        )
    trained = [r["step"] for r in records if r.get("type") == "step" and not r.get("republished")]
    rates = run_throughput(ordered)
    return {
        "steps": len(ordered),
        "tokens": tokens,
        "first_loss": ordered[0]["loss"] if ordered else float("nan"),
        "train_loss": sum(r["loss"] for r in last) / len(last) if last else float("nan"),
        "val_loss": evals[-1]["val_loss"] if evals else float("nan"),
        "val_ppl": evals[-1]["val_ppl"] if evals else float("nan"),
        "tokens_per_s": tokens / train_time if train_time else 0.0,
        "tokens_per_s_per_worker": rates["tokens_per_s_per_worker"],
        "tokens_per_s_per_gpu": rates["tokens_per_s_per_gpu"],
        "mfu": rates["mfu"],
        "wall_s": wall_s,
        "sessions": len(sessions(records)),
        "resumed_at": [r["step"] for r in resumes],
        "retrained": sorted({s for s in trained if trained.count(s) > 1}),
        "failures": failures,
        "skipped": sorted(r["step"] for r in records if r.get("type") == "nonfinite_skip"),
        "rejoins": joins,
        "promotions": promotions,
        "not_rejoined": [gone[w] for w in sorted(gone)],
        "restarts": sum(1 for r in records if r.get("type") == "restart"),
        "detection_s": [f["detection_s"] for f in failures if "detection_s" in f],
        "recoveries": len(recoveries),
        "reform_s": [r["reform_s"] for r in recoveries],
        # ``reform_s`` is what a worker waited for its new group, 0 where it was formed ahead.
        "formed_after_epoch_s": formed_after,
        "recomputed": sum(r.get("recomputed", 0) for r in ordered),
        "dropped": sum(r.get("dropped", 0) for r in ordered),
        "efficient": sum(r.get("efficient", 0) for r in ordered),
        "efficient_steps": [r["step"] for r in ordered if r.get("efficient")],
        "recovery_extra_s": sum(r["step_time_s"] - median for r in recovering),
        "identical_params": next((r["identical"] for r in records if r.get("type") == "final"), None),
    }


def _not_rejoined(failure: dict[str, Any]) -> str:
    """Why a failed worker is not among the members at the end."""
    rejoin = None
    if failure.get("event"):
        try:
            rejoin = parse_event(failure["event"]).rejoin_after_s
        except ValueError:
            rejoin = None
    if rejoin is None:
        return f"worker {failure['worker']}: no restart was scheduled"
    return f"worker {failure['worker']}: restart due {rejoin:g} s after the failure; the run ended before it rejoined"


def _per_device(s: dict[str, Any]) -> str:
    """Throughput in the units GPU users compare (core.throughput): per worker, per GPU and MFU where known."""
    parts = []
    if s["tokens_per_s_per_worker"] == s["tokens_per_s_per_worker"]:
        parts.append(f"{s['tokens_per_s_per_worker']:,.0f} tokens/s per worker")
    if s["tokens_per_s_per_gpu"] == s["tokens_per_s_per_gpu"]:
        parts.append(f"{s['tokens_per_s_per_gpu']:,.0f} per GPU")
        if s["mfu"] == s["mfu"]:
            parts.append(f"MFU {100 * s['mfu']:.1f} %")
        else:
            parts.append("MFU unknown (a GPU not in the table: --train.peak_tflops)")
    return ", ".join(parts) or "-"


def print_summary(run_dir: Path, records: list[dict[str, Any]], wall_s: float, total_steps: int) -> None:
    """The summary table of a run's records (every session) and ``wall_s`` (``records.wall_s`` of the
    records this launch saw, the figure the report gives for the same records)."""
    from rich.console import Console
    from rich.table import Table

    s = summarize(records, wall_s)
    table = Table(title=f"unbroken run summary ({run_dir})", show_header=False)
    table.add_row("steps", f"{s['steps']} of {total_steps}")
    if s["sessions"] > 1:
        at = f"resumed at step {', '.join(map(str, s['resumed_at']))}" if s["resumed_at"] else "relaunched"
        again = f"; steps {_steps(s['retrained'])} trained again count once" if s["retrained"] else ""
        table.add_row("sessions", f"{s['sessions']} ({at}{again})")
    for line in config_change_lines(records):  # what a resume changed (--resume: train.steps; or with changes)
        table.add_row("config changed", line)
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
    table.add_row(
        "throughput",
        f"{s['tokens_per_s']:,.0f} tokens/s (training), wall {s['wall_s']:.1f} s (coordinator start to last record)",
    )
    table.add_row("per device", _per_device(s))
    table.add_row("goodput", account(records).line())
    if s["failures"]:
        for f in s["failures"]:
            what = f.get("event") or f["why"]
            table.add_row(
                "failure survived",
                f"worker {f['worker']}"
                + (f" in step {f['step']}" if f["step"] is not None else "")
                + f": {what}"
                + (f" (detected in {f['detection_s'] * 1000:.0f} ms)" if "detection_s" in f else ""),
            )
        if s["recoveries"]:
            waited = f"{max(s['reform_s']) * 1000:.0f} ms"
            formed = (
                f"group re-formed {max(s['formed_after_epoch_s']) * 1000:.0f} ms after its epoch at most, the "
                f"survivors waiting {waited} for it at most"
                if s["formed_after_epoch_s"]
                else f"group re-formed in {waited} at most"
            )
            table.add_row(
                "recovery",
                f"{_plural(s['recoveries'], 'recovery')}: {formed}; {_plural(s['recomputed'], 'microbatch')} "
                f"recomputed in-step, {s['dropped']} dropped, {s['recovery_extra_s']:.2f} s over the median step time "
                "in total",
            )
        if s["restarts"]:
            table.add_row("restarts", f"{s['restarts']} (restart policy: rollback to the last checkpoint)")
    else:
        table.add_row("failures", "none")
    if s["efficient"]:
        table.add_row(
            "approximate (MeCeFO)",
            f"{_plural(s['efficient'], 'microbatch')} in efficient mode, in steps {_steps(s['efficient_steps'])}",
        )
    promoted = {p["worker"]: p for p in s["promotions"]}
    for p in s["promotions"]:
        since = f"in the group {p['after_death_s']:.2f} s after its death, " if p["after_death_s"] is not None else ""
        joined = f"computing from step {p['step']} (epoch {p['epoch']})" if p["step"] is not None else "not joined"
        table.add_row("spare promoted", f"spare {p['spare']} took worker {p['worker']}'s place {since}{joined}")
    for j in s["rejoins"]:
        if all(w in promoted and promoted[w]["step"] == j["step"] for w in j["workers"]):
            continue  # said above
        who = ", ".join(map(str, j["workers"]))
        table.add_row("rejoined", f"worker {who} at step {j['step']} (epoch {j['epoch']}): members {j['members']}")
    for f in s["not_rejoined"]:
        table.add_row("not rejoined", _not_rejoined(f))
    for r in (r for r in records if r.get("type") == "slow"):
        table.add_row("fail-slow", describe_slow(r))
    if s["identical_params"] is not None:
        table.add_row("workers' parameters", "identical" if s["identical_params"] else "DIFFERENT")
    impure = [r for r in records if r.get("type") == "impure_data"]
    if impure:
        table.add_row("data check", f"FAILED at step {impure[0]['step']}: the data is not a pure function of (seed, "
                      "step, id), so recovered steps are not the failure-free ones")  # fmt: skip
    Console().print(table)
