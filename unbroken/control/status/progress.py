"""What a person watching a local run sees: the live progress bar (or plain lines off a terminal), read from the
run's metrics records as they arrive, and the summary table at the end (``summary_rows``, ``print_summary``),
read from the run's facts (``core.runfacts``: every session, the same counts and times as ``unbroken report``
and ``unbroken status`` state).

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
from unbroken.core.failures import parse_event
from unbroken.core.goodput import account
from unbroken.core.records import RecordKind, SpareState, WorkerError, committed_steps, is_join
from unbroken.core.runfacts import Failure, RunFacts
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
        self._spares: dict[int, int] = {}  # a worker -> the spare promoted to its place, until the spare joins
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
            self._spares[record["worker"]] = record["spare"]
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
            self.note(describe_recovery(record, self.members, self.microbatches, self._spares))
            epoch, first = int(record["epoch"]), int(record["from_epoch"])
            for e in range(first + 1, epoch + 1):  # whoever this re-formation admitted is no spare's place now
                for w in set(self.members.get(e, ())) - set(self.members.get(e - 1, ())):
                    self._spares.pop(w, None)
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
    kind = RecordKind(record["type"])
    if kind is RecordKind.MEMBERSHIP:
        return f"epoch {record['epoch']}: members {record['members']} ({record['reason']})"
    if kind is RecordKind.FAILURE:
        detected = f", detected in {record['detection_s'] * 1000:.0f} ms" if "detection_s" in record else ""
        return f"worker {record['worker']} failed: {record.get('event') or record['why']}{detected}"
    if kind is RecordKind.RESUME:
        return f"resumed at step {record['step']} from {record['path']}"
    if kind is RecordKind.CHECKPOINT_REJECTED:
        return f"checkpoint rejected: {record['detail']}"
    if kind is RecordKind.NONFINITE_SKIP:
        return (
            f"step {record['step']} skipped on every worker: non-finite gradient in microbatches "
            f"{record['microbatches']} of workers {record['workers']} (first: {record['parameter']})"
        )
    if kind is RecordKind.STALL:
        return f"collective timed out in epoch {record['epoch']}: {record['decision']} (suspects {record['suspects']})"
    if kind is RecordKind.STOPPED:
        return f"stopped: {record['reason']}"
    if kind is RecordKind.REFUSED:
        return record["reason"]
    return str(kind)


def describe_recovery(
    record: dict[str, Any],
    members: dict[int, list[int]],
    microbatches: int | None,
    spares: dict[int, int] | None = None,
) -> str:
    """One line about a group re-formation: a recovery (in the step it interrupted) or a join; ``microbatches``
    a step has (a group formed at a step boundary misses all of them: nothing to redo); ``spares``: the workers
    whose places warm spares were promoted to (a spare's join is said as one, and leaves the map)."""
    step, epoch = record["step"], record["epoch"]
    if is_join(record, members):
        joined = sorted(set(members[epoch]) - set(members[record["from_epoch"]]))
        alive = f"at step {step} (epoch {epoch}, {record['alive']} alive)"
        if spares is None or not set(joined) & spares.keys():
            return f"worker {', '.join(map(str, joined))} rejoined {alive}"
        named = [f"spare {spares.pop(w)} (in worker {w}'s place)" if w in spares else f"worker {w}" for w in joined]
        return f"{', '.join(named)} joined {alive}"
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


def _rows_run(facts: RunFacts, total_steps: int) -> list[tuple[str, str]]:
    """The summary's rows about the training itself: steps, sessions, tokens, losses, speed, goodput."""
    rows = [("steps", f"{facts.steps_done} of {total_steps}")]
    sessions = len(facts.sessions)
    if sessions > 1:
        at = f"resumed at step {', '.join(map(str, facts.resumes))}" if facts.resumes else "relaunched"
        again = sorted(facts.trained_again)
        count = f"; steps {_steps(again)} trained again count once" if again else ""
        rows.append(("sessions", f"{sessions} ({at}{count})"))
    rows += [("config changed", c.line()) for c in facts.changes]  # what a resume changed
    if facts.skipped:
        rows.append(("skipped steps", f"{sorted(facts.skipped)} (a non-finite gradient: no optimizer step)"))
    steps = list(facts.steps.values())
    last = steps[-10:]
    mean = f"mean of the last {len(last)} steps" if len(last) > 1 else "the last step"
    first = steps[0].loss if steps else math.nan
    train = sum(s.loss for s in last) / len(last) if last else math.nan
    rows += [("tokens", f"{facts.tokens:,}"), ("train loss", f"{first:.4f} -> {train:.4f} ({mean})")]
    evaluation = facts.evaluations[-1] if facts.evaluations else None
    rows.append(
        ("validation", f"loss {evaluation.val_loss:.4f}, perplexity {evaluation.val_ppl:.1f}")
        if evaluation is not None
        else ("validation", "none recorded (ctx.evaluate records one)")
    )
    over = f", summed over {sessions} sessions" if sessions > 1 else ""
    wall = f"wall {facts.wall_s:.1f} s (coordinator start to last record{over})"
    speed = f"{_rate(facts.tokens_per_s)} tokens/s (training), {wall}"
    rows += [("throughput", speed), ("per device", _per_device(run_throughput(s.throughput() for s in steps)))]
    rows.append(("goodput", account(facts).line()))
    return rows


def _rate(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f}"


def _rows_failures(facts: RunFacts) -> list[tuple[str, str]]:
    """Each failure survived and what surviving them took, the restarts, MeCeFO's approximate microbatches."""
    failures = facts.declared_failures
    rows = []
    for f in failures:
        where = f" in step {f.step}" if f.step is not None else ""
        detected = f" (detected in {f.detection_s * 1000:.0f} ms)" if f.detection_s is not None else ""
        rows.append(("failure survived", f"worker {f.worker}{where}: {f.what}{detected}"))
    if failures and facts.recoveries:
        waited = f"{max(r.reform_s or 0.0 for r in facts.recoveries) * 1000:.0f} ms"
        formed = [r.formed_after_epoch_s for r in facts.recoveries if r.formed_after_epoch_s is not None]
        group = (
            f"group re-formed {max(formed) * 1000:.0f} ms after its epoch at most, the survivors waiting {waited} for "
            "it at most"
            if formed
            else f"group re-formed in {waited} at most"
        )
        steps = list(facts.steps.values())
        times = [s.step_time_s for s in steps if s.step_time_s is not None]
        median = statistics.median(times) if times else 0.0
        extra = sum(s.step_time_s - median for s in steps if s.recoveries and s.step_time_s is not None)
        rows.append(
            (
                "recovery",
                f"{_plural(len(facts.recoveries), 'recovery')}: {group}; {_plural(facts.recomputed, 'microbatch')} "
                f"recomputed in-step, {facts.dropped} dropped, {extra:.2f} s over the median step time in total",
            )
        )
    if failures and facts.restarts:
        rows.append(("restarts", f"{len(facts.restarts)} (restart policy: rollback to the last checkpoint)"))
    if not failures:
        rows.append(("failures", "none"))
    if facts.efficient:
        efficient = [s.step for s in facts.steps.values() if s.efficient]
        words = f"{_plural(facts.efficient, 'microbatch')} in efficient mode, in steps {_steps(efficient)}"
        rows.append(("approximate (MeCeFO)", words))
    return rows


def _rows_members(facts: RunFacts) -> list[tuple[str, str]]:
    """Spares promoted, workers that rejoined, and those that did not come back."""
    rows = []
    for p in facts.promotions:
        after = p.after_death_s
        since = f"in the group {after:.2f} s after its death, " if after is not None else ""
        join = p.join
        joined = join is not None and join.step is not None
        computing = f"computing from step {join.step} (epoch {join.epoch})" if joined else "not joined"  # type: ignore[union-attr]
        rows.append(("spare promoted", f"spare {p.spare} took worker {p.worker}'s place {since}{computing}"))
    for j in facts.rejoins:
        who = ", ".join(map(str, j.rejoined))
        at = f"at step {j.step}" if j.step is not None else "admitted, the run ended before its group formed"
        rows.append(("rejoined", f"worker {who} {at} (epoch {j.epoch}): members {j.members}"))
    at_end = set(facts.members or ())
    gone = {f.worker: f for f in facts.declared_failures if f.worker not in at_end}
    rows += [("not rejoined", _not_rejoined(gone[w])) for w in sorted(gone)]
    return rows


def _not_rejoined(failure: Failure) -> str:
    """Why a failed worker is not among the members at the end."""
    rejoin = None
    if failure.event:
        try:
            rejoin = parse_event(failure.event).rejoin_after_s
        except ValueError:
            rejoin = None
    if rejoin is None:
        return f"worker {failure.worker}: no restart was scheduled"
    return f"worker {failure.worker}: restart due {rejoin:g} s after the failure; the run ended before it rejoined"


def _per_device(rates: dict[str, float]) -> str:
    """Throughput in the units GPU users compare (core.throughput): per worker, per GPU and MFU where known."""
    parts = []
    if not math.isnan(rates["tokens_per_s_per_worker"]):
        parts.append(f"{rates['tokens_per_s_per_worker']:,.0f} tokens/s per worker")
    if not math.isnan(rates["tokens_per_s_per_gpu"]):
        parts.append(f"{rates['tokens_per_s_per_gpu']:,.0f} per GPU")
        if not math.isnan(rates["mfu"]):
            parts.append(f"MFU {100 * rates['mfu']:.1f} %")
        else:
            parts.append("MFU unknown (a GPU not in the table: --train.peak_tflops)")
    return ", ".join(parts) or "-"


def summary_rows(facts: RunFacts, total_steps: int) -> list[tuple[str, str]]:
    """The rows of the run's summary table (name, text), from its facts (``core.runfacts``: every session)."""
    rows = [*_rows_run(facts, total_steps), *_rows_failures(facts), *_rows_members(facts)]
    rows += [("fail-slow", describe_slow(r)) for r in facts.slow]
    if facts.final is not None and facts.final.identical is not None:
        rows.append(("workers' parameters", "identical" if facts.final.identical else "DIFFERENT"))
    if facts.impure:
        rows.append(("data check", f"FAILED at step {facts.impure[0].get('step')}: the data is not a pure function of "
                     "(seed, step, id), so recovered steps are not the failure-free ones"))  # fmt: skip
    return rows


def print_summary(run_dir: Path, records: list[dict[str, Any]], total_steps: int) -> None:
    """The summary table of a run's records (every session: its wall time is the report's and the status
    view's, ``core.runfacts``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"unbroken run summary ({run_dir})", show_header=False)
    for name, text in summary_rows(RunFacts.of(records), total_steps):
        table.add_row(name, text)
    Console().print(table)
