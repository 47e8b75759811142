"""One reading of a run's records: ``RunFacts`` folds ``metrics.jsonl`` (every session, in file order), one record
at a time, into typed facts: the steps, the sessions and their wall time, the failures and what became of each,
the recoveries, the joins, the warm spares and their promotions, the evaluations, the config changes, the final
record. Every reader of a run reads these and nothing else of the records: the console summary
(``control.status.progress``), ``unbroken report`` (``lab.report``), ``unbroken status`` and the status page
(``control.status.model.RunView``, which folds the records as they arrive) and the goodput account
(``core.goodput``). Records are told apart by ``RecordKind`` only; a kind this version does not know is skipped.
Pure Python.

The definitions they share:

- **steps**: each step once, by its last record (a step trained again after a resume or a relaunch is recorded
  again); a record re-published by a new leader (``republished``: no tokens or timing of its own) only fills a
  step otherwise missing, as ``records.committed_steps``. ``steps_done`` counts them, ``last_step`` is the highest.
- **tokens**: those of the committed steps (a step skipped for a non-finite gradient trained none); a step known
  only from a re-published record counts the run's usual tokens per step, less what it dropped.
- **tokens/s** (training): the tokens of the steps with a timing over their summed step time
  (``core.throughput.run_throughput``).
- **sessions** (``records.sessions``): a launch, a ``--resume``, a restart-policy relaunch each begin one.
  **wall**: each session from its first record to its last, summed, plus the time the job was down before a
  restart-policy relaunch (the time before a ``--resume`` is nobody's: the run had ended).
- **failure**: a worker that left the group, opened by the epoch without it or by its ``failure`` record,
  whichever comes first; ``declared`` once that record came (only those are the run's failures: the other ranks
  of a replica that went down with a dead one have none). Each holds the fault delivered (``injected``), the
  re-formation that survived it, the step record that redid its work, and its return.
- **recovery**: a re-formation (``recovery`` record) that survived a failure or a stall: not only an admission
  (``records.is_join``).
- **join**: an epoch that admitted workers (members the session's epoch before it did not have); its ``step`` is
  the first re-formation of its session onto that epoch or a later one (the step the joiners compute from; None
  until then). A worker admitted in the place of a dead one by a warm spare (a ``spare`` record ``promoted``) is
  that spare's **promotion**, not a rejoin.

Memory: a ``Step`` (a dozen numbers) per step record, kept for the goodput account's walk over every attempt and
the report's curves; the rest grows with the events, not the steps.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from unbroken.core.config import config_change_lines
from unbroken.core.records import RecordKind, SpareState, formed_after_epoch, is_join

Record = Mapping[str, Any]


def number(x: Any) -> float | None:
    """``x`` as a finite float, else None (a field missing or NaN: a re-published step has no timing)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def _number_or_0(x: Any) -> float:
    value = number(x)
    return 0.0 if value is None else value


def kind_of(record: Any) -> RecordKind | None:
    """The record's kind, None for one this version does not know (or not a record)."""
    name = record.get("type") if isinstance(record, Mapping) else None
    return RecordKind._value2member_map_.get(name) if isinstance(name, str) else None  # type: ignore[return-value]


def slow_wait(record: Record) -> float:
    """The seconds a step waited for its slowest member beyond the median member: each member's microbatches
    (``quotas``) times its seconds per microbatch (``speeds``)."""
    quotas, speeds = record.get("quotas") or {}, record.get("speeds") or {}
    busy = []
    for worker, quota in quotas.items():
        count, per_microbatch = number(quota), number(speeds.get(worker))
        if count is not None and per_microbatch is not None:
            busy.append(count * per_microbatch)
    return max(busy) - statistics.median(busy) if len(busy) > 1 else 0.0


@dataclass(slots=True)
class Step:
    """A step record as the readers use it (``slow_wait_s``: ``slow_wait`` of its members)."""

    step: int
    session: int
    time: float | None
    loss: float
    step_time_s: float | None  # None: no timing of its own (a re-published record)
    tokens: int
    tokens_per_s: float | None
    alive: int
    committed: bool  # its update was applied (not skipped for a non-finite gradient)
    republished: bool
    recoveries: int
    recomputed: int
    dropped: int
    efficient: int
    overflow_redos: int
    microbatches: int
    slow_wait_s: float
    rates: tuple[int, int, float, float]  # workers, gpus, flops_per_token, peak_tflops (core.throughput)

    @classmethod
    def of(cls, r: Record, session: int) -> Step:
        def count(name: str) -> int:
            return int(r.get(name) or 0)

        loss = r.get("loss")
        return cls(
            step=int(r["step"]),
            session=session,
            time=number(r.get("time")),
            loss=float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else math.nan,
            step_time_s=number(r.get("step_time_s")),
            tokens=count("tokens"),
            tokens_per_s=number(r.get("tokens_per_s")),
            alive=count("alive"),
            committed=bool(r.get("committed", True)) and not r.get("skipped"),
            republished=bool(r.get("republished")),
            recoveries=count("recoveries"),
            recomputed=count("recomputed"),
            dropped=count("dropped"),
            efficient=count("efficient"),
            overflow_redos=count("overflow_redos"),
            microbatches=count("microbatches"),
            slow_wait_s=slow_wait(r),
            rates=(
                count("workers"),
                count("gpus"),
                _number_or_0(r.get("flops_per_token")),
                _number_or_0(r.get("peak_tflops")),
            ),
        )

    def throughput(self) -> dict[str, float]:
        """Its fields as ``core.throughput.run_throughput`` reads them."""
        workers, gpus, flops, peak = self.rates
        seconds = math.nan if self.step_time_s is None else self.step_time_s
        fields = {"step_time_s": seconds, "tokens": self.tokens, "workers": workers, "gpus": gpus}
        return fields | {"flops_per_token": flops, "peak_tflops": peak}


@dataclass(frozen=True, slots=True)
class Mark:
    """A record other than a step's on its session's timeline: what the goodput account finds between steps."""

    time: float
    kind: RecordKind
    seconds: float = 0.0  # what it measured: a checkpoint's writing, a failure's detection, a re-formation
    transfer: tuple[float, float] | None = None  # a join's state transfer: the group formed, the state received
    lost: bool = False  # the coordinator was lost, or a new one took over


@dataclass(slots=True)
class Session:
    """A coordinator started from disk and what was recorded until the next one."""

    index: int
    begin: float | None = None  # its first record's time
    end: float | None = None  # its last record's
    relaunch: bool = False  # a restart-policy relaunch (its ``restart`` record)
    resumed_at: int | None = None  # the step its ``resume`` record continued at
    records: int = 0
    steps: list[Step] = field(default_factory=list)  # every step record with a timing, in file order
    marks: list[Mark] = field(default_factory=list)  # its other records with a time, in file order
    epochs: dict[int, list[int]] = field(default_factory=dict)  # epoch -> its members
    published: dict[int, float] = field(default_factory=dict)  # epoch -> when its record was written
    members: list[int] | None = None  # the newest epoch's

    def saw(self, t: float) -> None:
        self.begin = t if self.begin is None else min(self.begin, t)
        self.end = t if self.end is None else max(self.end, t)

    @property
    def wall_s(self) -> float:
        return 0.0 if self.begin is None or self.end is None else self.end - self.begin


@dataclass(slots=True)
class Recovery:
    """A re-formation of the group (a ``recovery`` record); ``join``: it only admitted workers."""

    step: int | None
    epoch: int
    from_epoch: int
    session: int
    time: float | None
    alive: int | None
    reform_s: float | None  # a survivor's wait for the new group, 0 where it was formed ahead
    missing: list[int]
    time_reformed: float | None
    formed_after_epoch_s: float | None  # ``records.formed_after_epoch``
    join: bool


@dataclass(slots=True)
class Join:
    """Workers admitted by an epoch (``relaunch``: taken back by a later session's first epoch, not a join)."""

    epoch: int
    session: int
    time: float | None
    workers: list[int]
    members: list[int]
    in_progress: int  # the step in progress when they were admitted
    spares: dict[int, int] = field(default_factory=dict)  # an admitted worker -> the warm spare in its place
    step: int | None = None  # the step of the re-formation that took them in
    relaunch: bool = False

    @property
    def rejoined(self) -> list[int]:
        """The admitted workers that came back themselves (not a spare in their place)."""
        return [w for w in self.workers if w not in self.spares]

    @property
    def from_step(self) -> int:
        """The step they compute from: their re-formation's, else the one in progress at their admission."""
        return self.in_progress if self.step is None else self.step


@dataclass(slots=True)
class Failure:
    """A worker that left the group, and what became of it (times are the records', Unix seconds)."""

    worker: int
    epoch: int  # the first without it
    session: int
    in_progress: int  # the step in progress when it left
    detected_at: float | None
    declared: bool = False  # its ``failure`` record came
    why: str | None = None
    event: str | None = None  # the scheduled fault, when one was injected
    detection_s: float | None = None  # from the fault's delivery to its declaration
    injected_at: float | None = None
    recovery: Recovery | None = None  # the re-formation that survived it
    redone: Step | None = None  # the first step record from that re-formation's step: what was recomputed
    back: Join | None = None  # its return

    @property
    def step(self) -> int | None:
        """The step its re-formation interrupted (None: the group never re-formed without it)."""
        return None if self.recovery is None else self.recovery.step

    @property
    def what(self) -> str:
        return self.event or self.why or "?"

    @property
    def fault_at(self) -> float | None:
        return self.injected_at if self.injected_at is not None else self.detected_at

    @property
    def down_s(self) -> float | None:
        start = self.fault_at
        return None if self.back is None or self.back.time is None or start is None else self.back.time - start


@dataclass(slots=True)
class Promotion:
    """A warm spare promoted to a dead worker's place; ``join``: its admission under that worker's id."""

    spare: int
    worker: int
    time: float | None
    join: Join | None = None
    died_at: float | None = None  # the worker's failure record, the last before the join

    @property
    def after_death_s(self) -> float | None:
        """From the death's declaration to the spare in the group."""
        if self.join is None or self.join.time is None or self.died_at is None:
            return None
        return self.join.time - self.died_at


@dataclass(slots=True)
class Spare:
    """A warm spare's newest ``spare`` record."""

    spare: int
    state: str  # ``SpareState``
    worker: int  # the worker whose place it took, -1 before
    since: float | None
    why: str | None = None


@dataclass(frozen=True, slots=True)
class Evaluation:
    step: int
    val_loss: float
    val_ppl: float
    time: float | None


@dataclass(frozen=True, slots=True)
class Epoch:
    time: float | None
    epoch: int
    members: list[int]
    reason: str
    session: int


@dataclass(frozen=True, slots=True)
class Restart:
    time: float | None
    workers: Any
    stop_and_relaunch_s: float | None


@dataclass(slots=True)
class ConfigChange:
    """A ``config_change`` record and the ``resume`` record of its session, once read."""

    record: Record
    resume: Record | None = None

    def line(self) -> str:
        """``at step 8: train.steps = 8 -> 10; the earlier config is config.1.toml``."""
        return config_change_lines([self.record, *([self.resume] if self.resume is not None else [])])[0]


@dataclass(frozen=True, slots=True)
class Final:
    step: int
    identical: bool | None
    checksums: dict[str, Any]
    time: float | None


class _Group:
    """The group's side of the fold: the epochs, the failures and what became of each, the re-formations, the
    joins, the warm spares and their promotions (``RunFacts`` names its lists)."""

    def __init__(self) -> None:
        self.epochs: list[Epoch] = []
        self.members: list[int] | None = None  # the newest epoch's
        self.failures: list[Failure] = []  # in the order they were opened
        self.reformations: list[Recovery] = []  # every re-formation, joins' included
        self.recoveries: list[Recovery] = []  # those that survived a failure or a stall
        self.joins: list[Join] = []
        self.promotions: list[Promotion] = []
        self.spares: dict[int, Spare] = {}
        self._injections: dict[int, tuple[Any, float | None]] = {}  # worker -> a delivered fault not yet declared
        self._promoted: dict[int, Promotion] = {}  # worker -> a spare promoted to its place, not yet admitted
        self._unformed: list[Join] = []  # joins of this session waiting for their re-formation
        self._redo: list[Failure] = []  # failures re-formed, waiting for the step record that redid their work

    def new_session(self) -> None:
        self._unformed, self._redo = [], []

    def redone(self, s: Step) -> None:
        """A step record: the failures re-formed in or before its step were redone by it."""
        still = []
        for f in self._redo:
            if f.step is None or s.step >= f.step:
                f.redone = s
            else:
                still.append(f)
        self._redo = still

    def membership(self, r: Record, t: float | None, session: Session, in_progress: int) -> None:
        epoch, members = int(r.get("epoch", 0)), sorted(int(w) for w in r.get("members") or [])
        previous = session.members
        session.epochs[epoch] = members
        if t is not None:
            session.published[epoch] = t
        session.members = self.members = members
        self.epochs.append(Epoch(t, epoch, members, str(r.get("reason", "")), session.index))
        if previous is None:  # a session's first epoch: nobody joins, workers of earlier sessions are back
            back = Join(epoch, session.index, t, members, members, in_progress, relaunch=True)
            for f in self.failures:
                if f.back is None and f.worker in members:
                    f.back = back
            return
        for worker in sorted(set(previous) - set(members)):
            self.failure_of(worker, epoch, t, session, in_progress)
        if added := sorted(set(members) - set(previous)):
            self._admitted(Join(epoch, session.index, t, added, members, in_progress))

    def _admitted(self, join: Join) -> None:
        for worker in join.workers:
            if (promotion := self._promoted.pop(worker, None)) is not None:
                self._promote(promotion, join)
            for f in self.failures:
                if f.worker == worker and f.back is None:
                    f.back = join
        self.joins.append(join)
        self._unformed.append(join)

    def _promote(self, promotion: Promotion, join: Join) -> None:
        """``promotion``'s spare is the worker ``join`` admitted in its place."""
        join.spares[promotion.worker] = promotion.spare
        promotion.join = join
        died = [f.detected_at for f in self.failures if f.worker == promotion.worker and f.declared]
        until = math.inf if join.time is None else join.time
        promotion.died_at = next((d for d in reversed(died) if d is not None and d <= until), None)

    def failure_of(self, worker: int, epoch: int, t: float | None, session: Session, in_progress: int) -> Failure:
        """The failure of ``worker`` leaving in ``epoch`` (opened by the epoch or its record, whichever first)."""
        for f in reversed(self.failures):
            if f.worker == worker and f.epoch == epoch and f.session == session.index:
                return f
        f = Failure(worker, epoch, session.index, in_progress, t)
        if (injected := self._injections.pop(worker, None)) is not None:
            f.event, f.injected_at = injected
        self.failures.append(f)
        return f

    def failure(self, r: Record, t: float | None, session: Session, in_progress: int) -> None:
        worker = int(r.get("worker", -1))
        f = self.failure_of(worker, int(r.get("epoch", max(session.epochs, default=0))), t, session, in_progress)
        f.declared, f.why, f.detected_at = True, r.get("why"), t
        f.detection_s = number(r.get("detection_s"))
        if r.get("event") is not None:
            f.event = r["event"]
        pending = self._injections.get(worker)
        if pending is not None and pending[0] == f.event:
            f.injected_at = self._injections.pop(worker)[1]
        if f.injected_at is None and f.detection_s is not None and t is not None:
            f.injected_at = t - f.detection_s

    def injected(self, r: Record, t: float | None) -> None:
        """A fault delivered; the launcher's record may come after the failure it caused."""
        worker = int(r.get("worker", -1))
        late = [f for f in self.failures if f.worker == worker and f.event == r.get("event")]
        if late and t is not None:
            late[-1].injected_at = t
        else:
            self._injections[worker] = (r.get("event"), t)

    def not_injected(self, r: Record) -> None:
        """A scheduled fault that was not delivered: no failure will follow it."""
        self._injections.pop(int(r.get("worker", -1)), None)

    def recovery(self, r: Record, t: float | None, session: Session) -> None:
        step = r.get("step")
        rec = Recovery(
            step=None if step is None else int(step),
            epoch=int(r.get("epoch", 0)),
            from_epoch=int(r.get("from_epoch", -1)),
            session=session.index,
            time=t,
            alive=r.get("alive"),
            reform_s=number(r.get("reform_s")),
            missing=list(r.get("missing") or []),
            time_reformed=number(r.get("time_reformed")),
            formed_after_epoch_s=formed_after_epoch(r, session.published),
            join=is_join(r, session.epochs),
        )
        self.reformations.append(rec)
        for join in [j for j in self._unformed if j.epoch <= rec.epoch]:
            join.step = rec.step
            self._unformed.remove(join)
        if rec.join:
            return
        self.recoveries.append(rec)
        for f in self.failures:
            if f.session == session.index and f.recovery is None and rec.from_epoch < f.epoch <= rec.epoch:
                f.recovery = rec
                self._redo.append(f)

    def spare(self, r: Record, t: float | None) -> None:
        spare, state, worker = int(r.get("spare", -1)), str(r.get("state")), int(r.get("worker", -1))
        self.spares[spare] = Spare(spare, state, worker, t, r.get("why"))
        if state != SpareState.PROMOTED:
            return
        promotion = Promotion(spare, worker, t)
        self.promotions.append(promotion)
        # Its record may come after the epoch that admitted it (the agent's, through the store).
        late = [j for j in self.joins if worker in j.workers and worker not in j.spares and (j.time or 0) >= (t or 0)]
        if late:
            self._promote(promotion, late[0])
        else:
            self._promoted[worker] = promotion


class RunFacts:
    """The fold (``add`` one record at a time, in file order; ``of`` a run's records) and its facts."""

    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.last_step = -1
        self.trained_again: set[int] = set()  # steps recorded more than once (a resume or relaunch repeated them)
        self.evaluations: list[Evaluation] = []
        self._group = group = _Group()
        self.epochs, self.failures, self.joins, self.promotions = (
            group.epochs,
            group.failures,
            group.joins,
            group.promotions,
        )
        self.reformations, self.recoveries, self.spares = group.reformations, group.recoveries, group.spares
        self.checkpoints = 0
        self.resumes: list[int] = []
        self.restarts: list[Restart] = []
        self.skipped: list[int] = []  # steps skipped on every member (``nonfinite_skip``)
        self.slow: list[Record] = []  # fail-slow verdicts (``control.coordinator.failslow``)
        self.impure: list[Record] = []  # the data check's findings
        self.start_states: list[Record] = []
        self.config_changes: list[ConfigChange] = []
        self.goodput: list[Record] = []  # the coordinator's periodic ``goodput`` records
        self.final: Final | None = None
        self.latest: Step | None = None  # the newest step record (not a re-published copy)
        self.stopped: str | None = None
        self._steps: dict[int, Step] = {}
        self._trained: set[int] = set()
        self._next_step = 0  # the step after the newest step record (the one in progress)
        self._held: float | None = None  # a config change's time, until the record after it says whose it is
        self._tokens = 0  # of the committed steps with tokens of their own
        self._usual: Counter[int] = Counter()  # ... by tokens per step
        self._microbatches: Counter[str] = Counter()  # recomputed, dropped, efficient: summed over the steps
        self._untimed: dict[int, Step] = {}  # committed steps known only from a re-published record
        self._timed = [0.0, 0.0]  # tokens, seconds of the steps with a timing
        self._resumable: list[ConfigChange] = []  # config changes waiting for their session's resume record
        self._handlers: dict[RecordKind, Callable[[Record, float | None, Session], None]] = {
            RecordKind.STEP: self._step,
            RecordKind.MEMBERSHIP: lambda r, t, s: group.membership(r, t, s, self._next_step),
            RecordKind.FAILURE: lambda r, t, s: group.failure(r, t, s, self._next_step),
            RecordKind.INJECTED: lambda r, t, s: group.injected(r, t),
            RecordKind.INJECTION_SKIPPED: lambda r, t, s: group.not_injected(r),
            RecordKind.RECOVERY: group.recovery,
            RecordKind.SPARE: lambda r, t, s: group.spare(r, t),
            RecordKind.EVAL: self._eval,
            RecordKind.RESUME: self._resume,
            RecordKind.RESTART: self._restart,
            RecordKind.CONFIG_CHANGE: lambda r, t, s: self._resumable.append(ConfigChange(r)),
            RecordKind.FINAL: self._final,
        }
        self._lists: dict[RecordKind, list[Record]] = {
            RecordKind.SLOW: self.slow,
            RecordKind.IMPURE_DATA: self.impure,
            RecordKind.START_STATE: self.start_states,
            RecordKind.GOODPUT: self.goodput,
        }

    @classmethod
    def of(cls, records: Iterable[Record]) -> RunFacts:
        facts = cls()
        for r in records:
            facts.add(r)
        return facts

    # -- the fold -----------------------------------------------------------------------------------------------
    def add(self, record: Record) -> None:
        """Fold the next record of the file (any kind; a kind this version does not know is skipped)."""
        kind = kind_of(record)
        if kind is None:
            return
        t = number(record.get("time"))
        session = self._session_of(kind, record)
        if kind is RecordKind.CONFIG_CHANGE:
            self._held = t  # its session is the next record's when that starts one, else this one's
        else:
            session.records += 1
            if t is not None:
                session.saw(t)
        if t is not None:
            self.first_time = t if self.first_time is None else min(self.first_time, t)
            self.last_time = t if self.last_time is None else max(self.last_time, t)
            if kind not in (RecordKind.STEP, RecordKind.CONFIG_CHANGE):
                session.marks.append(self._mark(kind, record, t, session))
        if (handler := self._handlers.get(kind)) is not None:
            handler(record, t, session)
        elif kind in self._lists:
            self._lists[kind].append(record)
        elif kind is RecordKind.CHECKPOINT:
            self.checkpoints += 1
        elif kind is RecordKind.NONFINITE_SKIP:
            self.skipped.append(int(record["step"]))
        elif kind is RecordKind.STOPPED:
            self.stopped = str(record.get("reason", ""))

    def _session_of(self, kind: RecordKind, record: Record) -> Session:
        """The session ``record`` belongs to: a coordinator started from disk begins one (with the config change
        written just before it), unless the one so far holds nothing else (``records.sessions``)."""
        held, self._held = self._held, None
        if not self.sessions or (
            kind is RecordKind.COORDINATOR and not record.get("restored_epoch") and self.sessions[-1].records
        ):
            self.sessions.append(Session(len(self.sessions)))
            self._group.new_session()
        session = self.sessions[-1]
        if held is not None:
            session.saw(held)
        return session

    def _mark(self, kind: RecordKind, r: Record, t: float, session: Session) -> Mark:
        if kind is RecordKind.CHECKPOINT:
            return Mark(t, kind, number(r.get("seconds")) or 0.0)
        if kind is RecordKind.FAILURE:
            return Mark(t, kind, number(r.get("detection_s")) or 0.0)  # known for a delivered fault
        if kind is RecordKind.RECOVERY:
            formed, received = number(r.get("time_reformed")), number(r.get("time_recovered"))
            sent = is_join(r, session.epochs) and r.get("state_bytes") and formed is not None and received is not None
            return Mark(t, kind, number(r.get("reform_s")) or 0.0, (formed, received) if sent else None)  # type: ignore[arg-type]
        lost = kind is RecordKind.COORDINATOR_LOST or (kind is RecordKind.COORDINATOR and bool(r.get("restored_epoch")))
        return Mark(t, kind, lost=lost)

    def _step(self, r: Record, t: float | None, session: Session) -> None:
        s = Step.of(r, session.index)
        if s.step_time_s is not None:
            session.steps.append(s)
        if not s.republished:
            self.latest = s
            (self.trained_again if s.step in self._trained else self._trained).add(s.step)
            self._next_step = s.step + 1
            self._group.redone(s)
        old = self._steps.get(s.step)
        if old is not None and s.republished:
            return  # the step's record is here: a re-published copy adds nothing
        if old is not None:
            self._count(old, -1)
        self._steps[s.step] = s
        self._count(s, 1)
        self.last_step = max(self.last_step, s.step)

    def _count(self, s: Step, sign: int) -> None:
        if s.committed and s.republished:
            if sign > 0:
                self._untimed[s.step] = s
            else:
                self._untimed.pop(s.step, None)
        elif s.committed:
            self._tokens += sign * s.tokens
            self._usual[s.tokens] += sign
        self._microbatches.update(
            {"recomputed": sign * s.recomputed, "dropped": sign * s.dropped, "efficient": sign * s.efficient}
        )
        if s.step_time_s is not None and s.step_time_s > 0:
            self._timed[0] += sign * s.tokens
            self._timed[1] += sign * s.step_time_s

    def _eval(self, r: Record, t: float | None, session: Session) -> None:
        loss, ppl = number(r.get("val_loss")), number(r.get("val_ppl"))
        nan = math.nan
        self.evaluations.append(
            Evaluation(int(r["step"]), nan if loss is None else loss, nan if ppl is None else ppl, t)
        )

    def _resume(self, r: Record, t: float | None, session: Session) -> None:
        session.resumed_at = self._next_step = int(r["step"])
        self.resumes.append(session.resumed_at)
        for change in self._resumable:
            change.resume = r
        self.config_changes += self._resumable
        self._resumable = []

    def _restart(self, r: Record, t: float | None, session: Session) -> None:
        session.relaunch = True
        self.restarts.append(Restart(t, r.get("workers"), number(r.get("stop_and_relaunch_s"))))

    def _final(self, r: Record, t: float | None, session: Session) -> None:
        identical = None if r.get("identical") is None else bool(r["identical"])
        self.final = Final(int(r.get("step", 0)), identical, dict(r.get("checksums") or {}), t)

    # -- the facts ----------------------------------------------------------------------------------------------
    @property
    def members(self) -> list[int] | None:
        """The newest epoch's members."""
        return self._group.members

    @property
    def steps(self) -> dict[int, Step]:
        """Step -> its record (each once, the last), in step order."""
        return {s: self._steps[s] for s in sorted(self._steps)}

    @property
    def steps_done(self) -> int:
        return len(self._steps)

    @property
    def declared_failures(self) -> list[Failure]:
        """The run's failures: those a ``failure`` record declared."""
        return [f for f in self.failures if f.declared]

    @property
    def changes(self) -> list[ConfigChange]:
        """Every config change, those whose session has not resumed yet last."""
        return [*self.config_changes, *self._resumable]

    @property
    def rejoins(self) -> list[Join]:
        """The joins of workers that came back themselves (a spare's join is its promotion)."""
        return [j for j in self.joins if j.rejoined]

    def untimed_tokens(self) -> list[tuple[float, int]]:
        """(When it was recorded, its tokens) of each committed step known only from a re-published record: the
        run's usual tokens per step, less what it dropped."""
        if not self._untimed or not +self._usual:
            return []
        usual = statistics.median((+self._usual).elements())
        out = []
        for s in self._untimed.values():
            m = s.microbatches or 1
            out.append((s.time if s.time is not None else math.nan, round(usual * (m - s.dropped) / m)))
        return out

    @property
    def tokens(self) -> int:
        return self._tokens + sum(n for _, n in self.untimed_tokens())

    @property
    def recomputed(self) -> int:
        """Microbatches recomputed in-step (each step once, as every count here)."""
        return self._microbatches["recomputed"]

    @property
    def dropped(self) -> int:
        return self._microbatches["dropped"]

    @property
    def efficient(self) -> int:
        """Microbatches computed in MeCeFO's approximate mode."""
        return self._microbatches["efficient"]

    @property
    def train_s(self) -> float:
        """The summed time of the steps with a timing (each step once)."""
        return self._timed[1]

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of training time (nan before a timed step)."""
        return self._timed[0] / self._timed[1] if self._timed[1] > 0 else math.nan

    @property
    def wall_s(self) -> float:
        """Each session's span, plus the time the job was down before each restart-policy relaunch."""
        total, previous = 0.0, None
        for n, s in enumerate(self.sessions):
            begin, end = s.begin, s.end
            if self._held is not None and n == len(self.sessions) - 1:  # a config change, the file's last record
                begin = self._held if begin is None else min(begin, self._held)
                end = self._held if end is None else max(end, self._held)
            if begin is None or end is None:
                continue
            total += end - begin
            if s.relaunch and previous is not None and begin > previous:
                total += begin - previous
            previous = end
        return total
