"""The JSON model of a run (``RunView``): its metrics records folded, one at a time, into what an operator sees.

Owns the live view's content: which workers are alive, the step, the loss and step-time curves, every failure
with its recovery (detection, re-formation, recomputed microbatches, rejoin) as one incident, a timeline of
every event (``control.status.timeline``), each worker's share of the step and (when the workers publish it) its
speed, the warm spares, and the checkpoints. Its counts and times are the run's facts (``core.runfacts``, folded
here as the records arrive): the same steps, failures, recoveries, joins, promotions, sessions, wall time,
tokens/s and goodput as the console summary and ``unbroken report`` state. Steps are named as in the records
(from 0). It reads nothing but records and writes nothing: the coordinator hands it each record as it appends
it to ``RUN_DIR/metrics.jsonl`` (through ``MetricsTee``), and ``RunView.from_run_dir`` folds a run's file.
``snapshot()`` is a plain JSON-ready dict (layout ``SNAPSHOT_VERSION``, documented in docs/status.md) served by
``control.status.server`` and drawn by the page and by ``control.status.terminal``; once the run has ended its
``goodput`` columns end with the run's whole account.

Memory: the curves are thinned to ``max_points`` (every ``stride``-th step kept, the newest always shown), and
the timeline, the incidents and the checkpoints keep their newest; the facts keep a few numbers per step.
Pure Python; thread-safe (one writer, any number of readers).
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from unbroken.control.coordinator.failslow import SlowState
from unbroken.control.status.timeline import entry
from unbroken.core.goodput import Bucket, Goodput, Tracker, account
from unbroken.core.records import RecordKind, SpareState, decode, make, read_records
from unbroken.core.runfacts import Failure, RunFacts, kind_of, number

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
MAX_POINTS = 2000  # per curve; past it every other kept step is dropped and the stride doubles
MAX_EVENTS = 500  # timeline entries kept (the newest)
MAX_INCIDENTS = 200  # failures shown with their recovery (the newest)
MAX_CHECKPOINTS = 50
RECENT_STEPS = 20  # the step time and throughput shown are medians over this many of the newest steps
STRAGGLER_RATIO = 1.5  # a worker is a straggler when its seconds per microbatch exceed this x the others' median
TERMINAL_STATES = frozenset({"finished", "stopped", "failed", "coordinator_lost"})
INCIDENT_FIELDS = (  # one failure, from the fault to the worker's return (docs/status.md)
    *("worker", "epoch", "step", "event", "why", "injected_at", "detected_at", "detection_s"),
    *("reformed_at", "reform_s", "recovery_step", "missing", "recomputed", "dropped", "recovery_step_time_s"),
    *("rejoined_at", "rejoin_epoch", "rejoin_step", "down_s"),
)
GOODPUT_COLUMNS = ("step", "tokens_per_s", "ideal_tokens_per_s", "ratio", *map(str, Bucket))


def _num(x: Any) -> float | None:
    """``x`` as a finite float, else None (JSON has no NaN; a republished step has no timing)."""
    return number(x)


def _workers(mapping: Any) -> dict[int, Any]:
    """A record's per-worker dict (JSON object keys are strings) keyed by int worker id."""
    if not isinstance(mapping, dict):
        return {}
    out = {}
    for k, v in mapping.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            continue
    return out


def incident(f: Failure) -> dict[str, Any]:
    """A failure as the snapshot's ``incidents`` entry (``INCIDENT_FIELDS``)."""
    rec, redone, back = f.recovery, f.redone, f.back
    return {
        "worker": f.worker,
        "epoch": f.epoch,
        "step": f.in_progress if f.step is None else f.step,  # once re-formed, the step it interrupted
        "event": f.event,
        "why": f.why,
        "injected_at": f.injected_at,
        "detected_at": f.detected_at,
        "detection_s": f.detection_s,
        "reformed_at": None if rec is None else rec.time_reformed or rec.time,
        "reform_s": None if rec is None else rec.reform_s,
        "recovery_step": None if rec is None else rec.step,
        "missing": None if rec is None else rec.missing,
        "recomputed": None if redone is None else redone.recomputed,
        "dropped": None if redone is None else redone.dropped,
        "recovery_step_time_s": None if redone is None else redone.step_time_s,
        "rejoined_at": None if back is None else back.time,
        "rejoin_epoch": None if back is None else back.epoch,
        "rejoin_step": None if back is None else back.from_step,
        "down_s": f.down_s,
    }


def goodput_row(step: int, g: Goodput) -> tuple[Any, ...]:
    """The ``goodput`` columns' row of an account (``GOODPUT_COLUMNS``)."""
    return (
        step,
        _num(g.tokens_per_s),
        _num(g.ideal_tokens_per_s),
        _num(g.ratio),
        *(_num(g.buckets[b]) for b in Bucket),
    )


class _Series:
    """Rows (step first) in step order, thinned to at most ``max_points`` by keeping every ``stride``-th
    row; the newest row is always shown. A step that comes again (a resumed or restarted run replaying it)
    drops the rows from that step on: the later record wins, as in ``records.committed_steps``."""

    def __init__(self, names: tuple[str, ...], max_points: int) -> None:
        assert max_points >= 2
        self.names = names
        self.max_points = max_points
        self.rows: list[tuple[Any, ...]] = []
        self.stride = 1
        self.seen = 0
        self.latest: tuple[Any, ...] | None = None

    def add(self, row: tuple[Any, ...]) -> None:
        step = row[0]
        if self.latest is not None and self.latest[0] >= step:
            self.rows = [r for r in self.rows if r[0] < step]
        if self.seen % self.stride == 0:
            self.rows.append(row)
            if len(self.rows) > self.max_points:
                self.rows = self.rows[::2]
                self.stride *= 2
        self.seen += 1
        self.latest = row

    def columns(self) -> dict[str, Any]:
        rows = self.rows
        if self.latest is not None and (not rows or rows[-1] is not self.latest):
            rows = [*rows, self.latest]
        out: dict[str, Any] = {name: [r[i] for r in rows] for i, name in enumerate(self.names)}
        out["stride"] = self.stride
        return out


class RunView:
    """A run's live model, folded from its metrics records one at a time; thread-safe (the coordinator adds,
    the server's threads read).

    Args:
        total_steps: the run's configured steps (``train.steps``), if known.
        expected_workers: the workers the job was started with, if known (else those of the first epoch).
        run_dir: shown on the page.
        max_points: the most points kept per curve.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        expected_workers: int | None = None,
        run_dir: Path | str | None = None,
        max_points: int = MAX_POINTS,
    ) -> None:
        self._cond = threading.Condition()
        self._seq = 0
        self.total_steps = total_steps
        self.expected_workers = expected_workers
        self.run_dir = None if run_dir is None else str(run_dir)
        self.facts = RunFacts()
        self._state, self._state_detail = "starting", ""
        self._members: set[int] | None = None  # the newest epoch's (of any session: when a worker came or went)
        self._since: dict[int, float | None] = {}  # worker -> when it last came or went
        self._steps = _Series(("step", "loss", "step_time_s", "tokens_per_s", "alive", "lr", "grad_norm"), max_points)
        self._evals = _Series(("step", "val_loss"), max_points)
        self._goodput = _Series(GOODPUT_COLUMNS, max_points)  # the goodput records: the account at each
        self._last_step: dict[str, Any] | None = None
        self._last_val: float | None = None
        # (step time, tokens/s, tokens/s per GPU, MFU) of the newest steps (core.throughput's fields)
        self._recent: collections.deque[tuple[float | None, ...]] = collections.deque(maxlen=RECENT_STEPS)
        self._quotas: dict[int, int] = {}
        self._speeds: dict[int, float] = {}
        self._compute: dict[int, float] = {}
        self._fail_slow: set[int] = set()  # fail-slow by the ``slow`` records, not yet recovered
        self._timeline: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self._num_events = 0
        self._checkpoints: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_CHECKPOINTS)
        self._final: dict[str, Any] | None = None
        self._account: tuple[int, Goodput] | None = None  # the whole account once the run ended, and its seq
        self._handlers: dict[RecordKind, Callable[[Mapping[str, Any], float | None], None]] = {
            RecordKind.EVAL: self._on_eval,
            RecordKind.MEMBERSHIP: self._on_membership,
            RecordKind.FAILURE: lambda r, t: self._since.setdefault(int(r.get("worker", -1)), t),
            RecordKind.CHECKPOINT: self._on_checkpoint,
            RecordKind.SLOW: self._on_slow,
            RecordKind.GOODPUT: self._on_goodput,
            RecordKind.FINAL: self._on_final,
            RecordKind.COORDINATOR: self._on_coordinator,
            RecordKind.STOPPED: lambda r, t: self._set_state("stopped", str(r.get("reason", ""))),
            RecordKind.COORDINATOR_LOST: lambda r, t: self._set_state("coordinator_lost", str(r.get("path", ""))),
            RecordKind.RESUME: lambda r, t: self._set_state("training"),
        }

    @classmethod
    def from_run_dir(cls, run_dir: Path | str, max_points: int = MAX_POINTS) -> RunView:
        """The view of ``RUN_DIR/metrics.jsonl`` as it is now (``train.steps`` from its config.toml)."""
        run_dir = Path(run_dir)
        total = None
        config = run_dir / "config.toml"
        if config.is_file():
            total = tomllib.loads(config.read_text()).get("train", {}).get("steps")
        view = cls(total_steps=total, run_dir=run_dir, max_points=max_points)
        view.extend(read_records(run_dir))
        return view

    # -- input ------------------------------------------------------------------------------------------
    def write(self, record: Mapping[str, Any]) -> None:
        """Fold one metrics record (any kind; an unknown kind goes on the timeline as it is)."""
        with self._cond:
            self._fold(record)
            self._seq += 1
            self._cond.notify_all()

    def extend(self, records: Iterable[Mapping[str, Any]]) -> None:
        with self._cond:
            for record in records:
                self._fold(record)
                self._seq += 1
            self._cond.notify_all()

    def wait_for(self, seq: int, timeout_s: float) -> None:
        """Return once a record newer than ``seq`` was folded, the run ended, or after ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > seq or self._state in TERMINAL_STATES, timeout=timeout_s)

    @property
    def seq(self) -> int:
        """Records folded so far (a snapshot's version)."""
        return self._seq

    # -- folding ----------------------------------------------------------------------------------------
    def _fold(self, r: Mapping[str, Any]) -> None:
        known = self.facts.last_step  # the highest step before this record
        self.facts.add(r)
        if (event := entry(r, self.facts)) is not None:
            self._num_events += 1
            self._timeline.append(event)
        kind = kind_of(r)
        if kind is RecordKind.STEP:
            self._on_step(r, known)
        elif kind is not None and (handler := self._handlers.get(kind)) is not None:
            handler(r, number(r.get("time")))

    def _on_membership(self, r: Mapping[str, Any], t: float | None) -> None:
        members = set(self.facts.members or ())
        if self._members is None and self.expected_workers is None:
            self.expected_workers = len(members)
        for wid in members ^ (self._members or set()):
            self._since[wid] = t
        self._members = members
        if not members:
            self._set_state("failed", str(r.get("reason", "")) or "no worker left")
        elif self._state == "starting":
            self._set_state("training")

    def _on_step(self, r: Mapping[str, Any], known: int) -> None:
        step = int(r["step"])
        if r.get("republished") and step <= known:
            return  # a new leader re-published a step whose record arrived: nothing new
        step_time, tps = _num(r.get("step_time_s")), _num(r.get("tokens_per_s"))
        self._steps.add(
            (step, _num(r.get("loss")), step_time, tps, r.get("alive"), _num(r.get("lr")), _num(r.get("grad_norm")))
        )
        self._last_step = dict(r)
        self._recent.append((step_time, tps, _num(r.get("tokens_per_s_per_gpu")), _num(r.get("mfu"))))
        if "quotas" in r:
            self._quotas = {w: int(n) for w, n in _workers(r["quotas"]).items()}
        if "speeds" in r:
            self._speeds = {w: s for w, v in _workers(r["speeds"]).items() if (s := _num(v)) is not None}
        if "compute_s" in r:
            self._compute = {w: s for w, v in _workers(r["compute_s"]).items() if (s := _num(v)) is not None}
        if self._state == "starting":
            self._set_state("training")

    def _on_eval(self, r: Mapping[str, Any], t: float | None) -> None:
        self._last_val = _num(r.get("val_loss"))
        self._evals.add((int(r["step"]), self._last_val))

    def _on_checkpoint(self, r: Mapping[str, Any], t: float | None) -> None:
        self._checkpoints.append(
            {"step": r.get("step"), "path": r.get("path"), "seconds": _num(r.get("seconds")), "time": t}
        )

    def _on_slow(self, r: Mapping[str, Any], t: float | None) -> None:
        worker = int(r.get("worker", -1))
        if r.get("state") == SlowState.SLOW:
            self._fail_slow.add(worker)
        else:
            self._fail_slow.discard(worker)

    def _on_goodput(self, r: Mapping[str, Any], t: float | None) -> None:
        buckets = r.get("buckets") or {}
        head = (
            int(r.get("step", self.facts.last_step)),
            _num(r.get("tokens_per_s")),
            _num(r.get("ideal_tokens_per_s")),
        )
        self._goodput.add((*head, _num(r.get("ratio")), *(_num(buckets.get(str(b))) for b in Bucket)))

    def _on_final(self, r: Mapping[str, Any], t: float | None) -> None:
        checksums = {str(k): v for k, v in _workers(r.get("checksums")).items()}
        self._final = {"step": r.get("step"), "identical": r.get("identical"), "checksums": checksums}
        self._set_state("finished")

    def _on_coordinator(self, r: Mapping[str, Any], t: float | None) -> None:
        if not r.get("restored_epoch") and len(self.facts.sessions) > 1 and self._state in TERMINAL_STATES:
            self._set_state("starting")  # resumed or relaunched: the earlier session's end is not the run's

    def _set_state(self, state: str, detail: str = "") -> None:
        self._state, self._state_detail = state, detail

    # -- output -----------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The run as JSON-ready data (no NaN; see docs/status.md for every field)."""
        with self._cond:
            return {
                "version": SNAPSHOT_VERSION,
                "seq": self._seq,
                "server_time": time.time(),
                "run": self._run(),
                "workers": self._worker_rows(),
                "series": self._steps.columns(),
                "eval": self._evals.columns(),
                "incidents": [incident(f) for f in self.facts.failures[-MAX_INCIDENTS:]],
                # in time order: a record can arrive after a later one (the launcher's, through the store)
                "timeline": sorted((dict(e) for e in self._timeline), key=lambda e: e["time"] or 0.0),
                "timeline_dropped": self._num_events - len(self._timeline),
                "checkpoints": [dict(c) for c in self._checkpoints],
                "spares": [
                    {"spare": x.spare, "state": x.state, "worker": x.worker, "since": x.since}
                    for _, x in sorted(self.facts.spares.items())
                ],
                "goodput": self._goodput_columns(),
            }

    def _run(self) -> dict[str, Any]:
        """The snapshot's ``run``: the state, the counts and times (the run's facts), the newest figures."""
        f = self.facts
        recent = [[x for x in column if x is not None] for column in zip(*self._recent, strict=True)] or [[]] * 4
        times, rates, per_gpu, mfu = (statistics.median(c) if c else None for c in recent)
        last = self._last_step or {}
        return {
            "state": self._state,
            "state_detail": self._state_detail,
            "run_dir": self.run_dir,
            "total_steps": self.total_steps,
            "steps_done": f.steps_done,
            "last_step": f.last_step if f.last_step >= 0 else None,
            "epoch": f.epochs[-1].epoch if f.epochs else 0,
            "members": list(f.members or ()),
            "alive": len(f.members or ()),
            "expected_workers": self.expected_workers,
            "loss": _num(last.get("loss")),
            "val_loss": self._last_val,
            "lr": _num(last.get("lr")),
            "tokens": f.tokens,
            "step_time_s": times,
            "tokens_per_s": rates,
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": mfu,
            "train_tokens_per_s": _num(f.tokens_per_s),  # over the run's training time (the summary's)
            "wall_s": f.wall_s if f.sessions else None,
            "started_at": f.first_time,
            "updated_at": f.last_time,
            "failures": len(f.declared_failures),
            "recoveries": len(f.recoveries),
            "joins": len(f.joins),
            "rejoins": len(f.rejoins),
            "promotions": len(f.promotions),
            "sessions": len(f.sessions),
            "recomputed_microbatches": f.recomputed,
            "dropped_microbatches": f.dropped,
            "checkpoints": f.checkpoints,
            "last_checkpoint": self._checkpoints[-1] if self._checkpoints else None,
            "final": self._final,
            "spares": {
                state: sum(1 for x in f.spares.values() if x.state == state)
                for state in (SpareState.STARTED, SpareState.READY, SpareState.PROMOTED)
            },
        }

    def _goodput_columns(self) -> dict[str, Any]:
        """The goodput records as columns; once the run has ended, the run's whole account last (the summary's
        and the report's)."""
        columns = self._goodput.columns()
        if self._state not in TERMINAL_STATES or not self.facts.steps_done:
            return columns
        if self._account is None or self._account[0] != self._seq:
            self._account = (self._seq, account(self.facts))
        for name, value in zip(GOODPUT_COLUMNS, goodput_row(self.facts.last_step, self._account[1]), strict=True):
            columns[name].append(value)
        return columns

    def _worker_rows(self) -> list[dict[str, Any]]:
        members = self._members or set()
        failures: dict[int, list[Failure]] = {}
        for f in self.facts.failures:
            failures.setdefault(f.worker, []).append(f)
        rows = []
        for wid in sorted(set(self._since) | set(failures) | members):
            mine = failures.get(wid, [])
            declared = [f for f in mine if f.declared]
            alive = wid in members
            state = "alive" if alive else "dead" if mine and mine[-1].declared else "left"
            speed = self._speeds.get(wid) if alive else None
            quota = self._quotas.get(wid) if alive else None
            others = [s for w, s in self._speeds.items() if w != wid and w in members]
            compute = self._compute.get(wid) if alive else None
            if compute is None and speed is not None and quota is not None:
                compute = speed * quota
            rows.append(
                {
                    "id": wid,
                    "state": state,
                    "since": self._since.get(wid),
                    "failures": len(mine),
                    "last_failure": declared[-1].why if declared else None,
                    "quota": quota,
                    "s_per_microbatch": speed,
                    "compute_s": compute,
                    "straggler": None
                    if speed is None or not others
                    else speed > STRAGGLER_RATIO * statistics.median(others),
                    "fail_slow": alive and wid in self._fail_slow,
                }
            )
        return rows


class RecordSink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...


class MetricsTee:
    """The coordinator's metrics writer with the live views attached: every record appended to metrics.jsonl
    is also handed to each sink (``RunView``, ``LiveTensorBoard``). A sink that raises is logged and
    dropped: the page or TensorBoard failing must never take the coordinator down.

    ``metrics`` is ``records.MetricsFile`` (``write(record)``, ``write_line(line, record)``, ``close()``).
    """

    def __init__(self, metrics: Any, *sinks: RecordSink) -> None:
        self.metrics = metrics
        self.sinks = list(sinks)

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self._tee(record)

    def write_line(self, line: str, record: dict[str, Any] | None = None) -> None:
        """A line a worker published (already encoded), with ``record`` its decoding where the caller has it; a
        torn or unknown one reaches the file only."""
        if record is None:
            record = decode(line)
        self.metrics.write_line(line, record)
        if record is not None:
            self._tee(record)

    def _tee(self, record: Mapping[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception:
                log.exception(
                    "%s failed on a %s record; it gets no more records", type(sink).__name__, record.get("type")
                )
                self.sinks.remove(sink)

    def close(self) -> None:
        self.metrics.close()
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


class GoodputRecorder:
    """A sink that writes a ``goodput`` record (``core.goodput.Tracker``) into ``tee`` every ``every`` committed
    steps; ``records``: the run's so far (a restarted coordinator's account starts where the run is)."""

    def __init__(self, tee: MetricsTee, every: int, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self.tee = tee
        self.tracker = Tracker(every, records)

    def write(self, record: Mapping[str, Any]) -> None:
        fields = self.tracker.add(record)
        if fields is not None:
            self.tee.write(make(RecordKind.GOODPUT, time.time(), **fields))
