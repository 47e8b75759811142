"""Metrics records: their kinds and fields, the one writer of ``RUN_DIR/metrics.jsonl`` and its one reader.

A record is a JSON object on one line with a ``type`` (``RecordKind``) and that kind's fields (``FIELDS``;
more may be present). Workers publish records through the coordinator, which appends them with
``MetricsFile``; a worker that outlives its coordinator appends what was not drained with
``append_records``. The launcher, the report, the benchmarks, chaos and the tests read them with
``read_records`` (a reader of its own lines expands them with ``Quotas``: the file names a step's ``quotas``
only where they changed). ``WorkerError`` is the typed report of a worker's exception: a worker writes it to the
coordinator's store, which records it here (kind ``error``). Pure Python.

Step numbers: a record's ``step`` is the step's index, from 0 (step 0 is the first step), as in the failure
schedule and ``Step.index``; a checkpoint (and ``resume``, ``final``, ``coordinator_lost``) names the steps
done, which is the step the run continues at. One file holds every session of a run: a ``--resume`` or a
restart-policy relaunch appends to it, starting at a ``coordinator`` record with ``restored_epoch`` 0
(``sessions``; a resume that changed the config writes a ``config_change`` record just before it); steps
trained again after a resume are recorded again, and ``committed_steps`` counts each step once (its last
record). ``is_join`` tells a re-formation that admitted workers from a recovery. What a run's records say (its
steps, sessions and wall time, failures, joins, goodput) is read once, by ``core.runfacts``; compare records by
``RecordKind``, never by a string.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


class RecordKind(StrEnum):
    STEP = "step"  # a committed (or skipped) step
    EVAL = "eval"  # a validation
    MEMBERSHIP = "membership"  # a new membership epoch
    FAILURE = "failure"  # a member declared dead
    RECOVERY = "recovery"  # the survivors re-formed their group
    CHECKPOINT = "checkpoint"  # a checkpoint written and verified
    CHECKPOINT_REJECTED = "checkpoint_rejected"  # a damaged checkpoint skipped on resume
    RESUME = "resume"  # the run continued from a checkpoint
    FINAL = "final"  # the run's end: every member's parameter checksum
    INJECTED = "injected"  # a scheduled fault delivered
    INJECTION_SKIPPED = "injection_skipped"  # a scheduled fault not delivered, and why
    COORDINATOR_LOST = "coordinator_lost"  # the workers saved the state after the coordinator died
    RESTART = "restart"  # the restart policy relaunched the job
    GATEWAY = "gateway"  # the coordinator's connection statistics at its end
    NONFINITE_SKIP = "nonfinite_skip"  # a step skipped on every member for a non-finite gradient
    STOPPED = "stopped"  # the run stopped on purpose (a broken invariant, train.nonfinite = stop)
    STALL = "stall"  # a collective timed out with every heartbeat arriving: what the coordinator decided
    COORDINATOR = "coordinator"  # a coordinator started (or restarted: restored_epoch > 0), and where
    ADMITTED = (
        "admitted"  # a worker registered: its host, fingerprint (what decides its bits, core.numerics), start cost
    )
    REFUSED = "refused"  # a worker kept out of the membership, and why (exact mode: another fingerprint)
    USER = "user"  # anything a user's script logs
    ERROR = "error"  # a worker died of an exception (``WorkerError``: where, and the traceback's last frames)
    IMPURE_DATA = "impure_data"  # the data check found a microbatch whose inputs differ between two workers
    SPARE = "spare"  # a warm spare started, ready (initialised, outside the group) or promoted to a dead worker
    GOODPUT = "goodput"  # the run's goodput account so far (core.goodput), every metrics.goodput_every steps
    SLOW = "slow"  # a worker found fail-slow, or recovered from it (control.coordinator.failslow), and what was decided
    CONFIG_CHANGE = "config_change"  # a resume changed the config: each key (core.config.KeyChange), the kept file
    START_STATE = "start_state"  # before the first step: whether the members' starting states differed (healed)


FIELDS: dict[RecordKind, frozenset[str]] = {
    RecordKind.STEP: frozenset(
        {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens", "alive", "epoch", "microbatches", "committed"}
        | {"recomputed", "dropped", "recoveries", "efficient"}
    ),
    RecordKind.EVAL: frozenset({"step", "val_loss", "val_ppl"}),
    RecordKind.MEMBERSHIP: frozenset({"epoch", "members", "reason", "elapsed_s"}),
    RecordKind.FAILURE: frozenset({"worker", "why", "epoch"}),
    RecordKind.RECOVERY: frozenset(
        {"step", "from_epoch", "epoch", "alive", "reform_s", "missing", "time_reformed", "time_recovered"}
    ),
    RecordKind.CHECKPOINT: frozenset({"step", "path", "seconds"}),
    RecordKind.CHECKPOINT_REJECTED: frozenset({"detail"}),
    RecordKind.RESUME: frozenset({"step", "path"}),
    RecordKind.FINAL: frozenset({"step", "checksums", "identical", "checkpoint"}),
    RecordKind.INJECTED: frozenset({"worker", "event", "kind"}),
    RecordKind.INJECTION_SKIPPED: frozenset({"worker", "event", "why"}),
    RecordKind.COORDINATOR_LOST: frozenset({"step", "path"}),
    RecordKind.RESTART: frozenset({"workers", "stop_and_relaunch_s"}),
    RecordKind.GATEWAY: frozenset({"admitted", "rejected", "timed_out", "dropped"}),
    RecordKind.NONFINITE_SKIP: frozenset({"step", "microbatches", "workers", "parameter", "streak"}),
    RecordKind.STOPPED: frozenset({"reason"}),
    RecordKind.STALL: frozenset({"epoch", "reported", "suspects", "decision"}),
    RecordKind.COORDINATOR: frozenset({"incarnation", "restored_epoch", "address", "status"}),
    RecordKind.ADMITTED: frozenset({"worker", "host", "fingerprint", "start_s", "start_cpu_s", "forked"}),
    RecordKind.REFUSED: frozenset({"worker", "reason"}),
    RecordKind.USER: frozenset(),
    RecordKind.ERROR: frozenset(
        {"worker", "exception", "message", "file", "line", "function", "phase", "step", "microbatch", "traceback"}
    ),
    RecordKind.IMPURE_DATA: frozenset({"step", "microbatch", "workers", "reason"}),
    RecordKind.SPARE: frozenset({"spare", "state", "worker", "pid"}),
    RecordKind.CONFIG_CHANGE: frozenset({"changes", "kept"}),
    RecordKind.START_STATE: frozenset(
        {"step", "epoch", "members", "differed", "source", "state_bytes", "warn", "reason"}
    ),
    RecordKind.SLOW: frozenset({"worker", "state", "step", "relative", "threshold", "windows", "decision"}),
    RecordKind.GOODPUT: frozenset(
        {"step", "wall_s", "tokens", "tokens_per_s", "ideal_tokens_per_s", "ratio", "buckets"}
    ),
}


class SpareState(StrEnum):
    """What a ``spare`` record says of a warm spare (``control.host.spares``)."""

    STARTED = "started"  # its process was started
    READY = "ready"  # initialised (model, optimizer, data) and waiting outside the group
    PROMOTED = "promoted"  # it took the place of dead worker ``worker``
    EXITED = "exited"  # it ended while it waited; ``why`` says how (``control.store.connect.exit_reason``'s text)


class ErrorPhase(StrEnum):
    """Where in the step protocol a worker's exception was raised."""

    SETUP = "setup"  # before the first step (building the model, registering the state)
    MICROBATCH = "microbatch"  # in the loop body of one microbatch (its data, forward, loss or backward)
    STEP = "step"  # in a step, outside any microbatch's body (between microbatches, before the commit)
    COMMIT = "commit"  # in step.commit (the optimizer, clipping, a checkpoint)
    EVAL = "eval"  # in ctx.evaluate's loss function
    BETWEEN_STEPS = "between_steps"  # after a step's commit, before the next step (or after the last)


@dataclass(frozen=True)
class WorkerError:
    """A worker that died of a Python exception, as it reported itself before ending: the exception, the place
    (the innermost frame of the user's code), where in the protocol (``phase``, ``step``: the index of the step
    it was in or had just committed, -1 before the first; ``microbatch``: the id whose loop body raised, else
    None) and the traceback's last frames with the message. The worker writes it to the coordinator's store
    (``control.store.keys.error``, ``encode``); the coordinator appends it to metrics.jsonl (``record``)."""

    worker: int
    exception: str  # the exception's type: its name, qualified by its module unless a builtin
    message: str  # the first line of str(exception), shortened
    file: str
    line: int
    function: str
    phase: ErrorPhase
    step: int
    microbatch: int | None
    traceback: str

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def decode(text: str) -> WorkerError:
        """The error ``encode`` wrote (ValueError if ``text`` is not one)."""
        try:
            return WorkerError.from_record(json.loads(text))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"not a worker error report: {e}") from None

    def record(self, time: float) -> dict[str, Any]:
        """Its metrics record (kind ``error``)."""
        return make(RecordKind.ERROR, time, **asdict(self))

    @staticmethod
    def from_record(record: dict[str, Any]) -> WorkerError:
        mb = record["microbatch"]
        return WorkerError(
            worker=int(record["worker"]),
            exception=str(record["exception"]),
            message=str(record["message"]),
            file=str(record["file"]),
            line=int(record["line"]),
            function=str(record["function"]),
            phase=ErrorPhase(record["phase"]),
            step=int(record["step"]),
            microbatch=None if mb is None else int(mb),
            traceback=str(record["traceback"]),
        )

    def place(self) -> str:
        """``file.py:LINE in function`` (the file's name: hosts may hold the script under different paths)."""
        return f"{Path(self.file).name}:{self.line} in {self.function}"

    def where(self) -> str:
        """Where in the protocol, in words: ``step 5, microbatch 3``, ``after step 5``, ..."""
        if self.phase is ErrorPhase.MICROBATCH:
            return f"step {self.step}, microbatch {self.microbatch}"
        if self.phase is ErrorPhase.STEP:
            return f"step {self.step}, between microbatches"
        if self.phase is ErrorPhase.COMMIT:
            return f"step {self.step}, in its commit"
        if self.phase is ErrorPhase.EVAL:
            return f"an evaluation after step {self.step}" if self.step >= 0 else "an evaluation before the first step"
        if self.phase is ErrorPhase.BETWEEN_STEPS:
            return f"after step {self.step}"
        return "before the first step"

    def headline(self) -> str:
        """One line: ``ZeroDivisionError at loss.py:12 in loss_fn, step 5, microbatch 3: division by zero``."""
        return f"{self.exception} at {self.place()}, {self.where()}: {self.message}"


# What a user's script may log itself (``ctx.log``): the fields each kind needs, and how to say it. Every other
# kind is the library's.
SCRIPT_FIELDS: dict[RecordKind, tuple[str, ...]] = {
    RecordKind.EVAL: ("step", "val_loss"),  # val_ppl: exp(val_loss) unless given
    RecordKind.USER: (),
}
_SCRIPT_KINDS = "'eval' (fields step, val_loss; val_ppl optional) or 'user' (any fields)"


def check_script_record(kind: str, fields: dict[str, Any]) -> RecordKind:
    """The kind of a record a script logs, checked: ValueError (one line) for a kind a script may not log, a
    missing field, a reserved name (``type``, ``time``) or a value JSON cannot hold (a tensor: log ``float(t)``)."""
    if kind not in [str(k) for k in SCRIPT_FIELDS]:
        raise ValueError(f"ctx.log({kind!r}, ...): a script logs {_SCRIPT_KINDS}; the other kinds are the library's")
    record_kind = RecordKind(kind)
    missing = [f for f in SCRIPT_FIELDS[record_kind] if f not in fields]
    if missing:
        raise ValueError(f"ctx.log({kind!r}, ...) lacks {', '.join(missing)}; a script logs {_SCRIPT_KINDS}")
    if record_kind is RecordKind.EVAL:
        for name, kinds in (("step", (int,)), ("val_loss", (int, float)), ("val_ppl", (int, float))):
            value = fields.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, kinds):
                what = "an int (the step's index)" if name == "step" else "a number (float(t) for a tensor)"
                raise ValueError(f"ctx.log('eval', {name}={value!r}): {name} must be {what}")
    reserved = sorted({"type", "time"} & fields.keys())
    if reserved:
        raise ValueError(f"ctx.log({kind!r}, ...): {', '.join(reserved)} is set by the library; use another name")
    for name, value in fields.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"ctx.log({kind!r}, {name}=...): a {type(value).__name__} is not a number, string, list or dict; "
                "log float(t) for a tensor"
            ) from None
    return record_kind


def make(kind: RecordKind, time: float, /, **fields: Any) -> dict[str, Any]:
    """A record of ``kind`` (its fields checked: a programmer's mistake is an AssertionError)."""
    record = {"type": str(kind), **fields, "time": time}
    missing = FIELDS[kind] - record.keys()
    assert not missing, f"{kind} record lacks {sorted(missing)}"
    return record


def encode(record: dict[str, Any]) -> str:
    """One line of metrics.jsonl (keys sorted, so equal records are equal lines)."""
    kind = RecordKind(record["type"])
    missing = FIELDS[kind] - record.keys()
    assert not missing, f"{kind} record lacks {sorted(missing)}"
    return json.dumps(record, sort_keys=True)


def decode(line: str) -> dict[str, Any] | None:
    """The record on ``line``, or None for a blank or torn line (a writer killed mid-line) or an unknown kind."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or record.get("type") not in RecordKind._value2member_map_:
        return None
    return record


# A step record names every member's microbatches (``quotas``): 11 bytes a member, most of the file at scale,
# and the same from one step to the next until the membership or the workload's speeds change them. The file
# holds them in full where they changed, else ``quotas_at``: the step whose record, written before it by the same
# writer, lists them. ``read_records`` and ``Quotas`` put them back; a reference whose record is not there (a
# file cut short at its start) is left without quotas, never given another step's.
QUOTAS_AT = "quotas_at"
REMEMBERED_QUOTAS = 64  # full quota lists a reader keeps, by step (a writer refers to its last one)


class Quotas:
    """A reader's side of ``quotas_at``: feed it the file's records in order; ``expand`` returns each with its
    ``quotas`` in full where its file form referred to an earlier record's."""

    def __init__(self) -> None:
        self._by_step: dict[int, Any] = {}

    def expand(self, record: dict[str, Any]) -> dict[str, Any]:
        if record.get("type") != RecordKind.STEP:
            return record
        if "quotas" in record:
            self._by_step.pop(record["step"], None)
            self._by_step[record["step"]] = record["quotas"]
            if len(self._by_step) > REMEMBERED_QUOTAS:
                del self._by_step[next(iter(self._by_step))]
            return record
        at = record.get(QUOTAS_AT)
        if at not in self._by_step:
            return record
        out = {k: v for k, v in record.items() if k != QUOTAS_AT}
        out["quotas"] = self._by_step[at]
        return out


def line_identity(line: str, record: dict[str, Any] | None = None) -> str:
    """What tells one record's line from another's whatever form its quotas take (a worker's full line, the
    file's short one): the line itself, or for a step record the line without them. ``record`` is the line
    decoded, where the caller has it."""
    if '"quotas' not in line:
        return line
    if record is None:
        record = decode(line)
    if record is None:
        return line
    return json.dumps({k: v for k, v in record.items() if k not in ("quotas", QUOTAS_AT)}, sort_keys=True)


class MetricsFile:
    """The writer: appends records to ``RUN_DIR/metrics.jsonl``, one line each, flushed per line; a step record's
    quotas in full only where they differ from the last written (``QUOTAS_AT``)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._quotas: tuple[int, Any] | None = None  # (step, quotas) of the last step record written in full

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(encode(self._file_form(record)) + "\n")

    def write_line(self, line: str, record: dict[str, Any] | None = None) -> None:
        """A line published by a worker (already ``encode``d there); ``record`` is the line decoded, where the
        caller has it."""
        if '"quotas": {' in line and (record is not None or (record := decode(line)) is not None):
            line = encode(self._file_form(record))
        self._f.write(line.rstrip("\n") + "\n")

    def _file_form(self, record: dict[str, Any]) -> dict[str, Any]:
        if record.get("type") != RecordKind.STEP or "quotas" not in record:
            return record
        if self._quotas is not None and self._quotas[1] == record["quotas"]:
            return {**{k: v for k, v in record.items() if k != "quotas"}, QUOTAS_AT: self._quotas[0]}
        self._quotas = (record["step"], record["quotas"])
        return record

    def close(self) -> None:
        self._f.close()


def append_records(run_dir: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` that are not already among the file's last lines (a worker writing what its dead
    coordinator never drained); a line torn by the coordinator's death is ended first."""
    path = Path(run_dir) / METRICS_FILE
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 2**18))
        tail = f.read().decode(errors="replace")
        written = {line_identity(line) for line in tail.splitlines()}
        out = "" if not tail or tail.endswith("\n") else "\n"
        for record in records:
            line = encode(record)
            if line_identity(line) not in written:
                out += line + "\n"
        f.write(out.encode())


def read_records(run_dir: Path, kind: RecordKind | str | None = None) -> list[dict[str, Any]]:
    """All records of ``RUN_DIR/metrics.jsonl`` (of one kind if given), in file order; torn lines skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    wanted = None if kind is None else str(RecordKind(kind))
    records = []
    quotas = Quotas()
    for line in path.read_text().splitlines():
        record = decode(line)
        if record is not None and (wanted is None or record["type"] == wanted):
            records.append(quotas.expand(record))
    return records


def committed_steps(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> the record of its commit, in step order. A step repeated after a restart or resume keeps its
    last record; a record re-published by a new leader (``republished``: no timing, the original was lost
    with the old leader or never written because the leader was cut off) only fills a step otherwise missing."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("type") != RecordKind.STEP or (r.get("republished") and r["step"] in by_step):
            continue
        by_step[r["step"]] = r
    return {s: by_step[s] for s in sorted(by_step)}


def sessions(records: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records split by session: each begins where a coordinator started from disk (a launch, a
    ``--resume``, a restart-policy relaunch: a ``coordinator`` record with ``restored_epoch`` 0), or at the
    ``config_change`` record a resume wrote just before that; a coordinator that replaced a dead one continues its
    session. Records before the first such record (an older file) belong to the first session."""
    out: list[list[dict[str, Any]]] = [[]]
    for r in records:
        if r.get("type") == RecordKind.COORDINATOR and not r.get("restored_epoch") and out[-1]:
            head = [out[-1].pop()] if out[-1][-1].get("type") == RecordKind.CONFIG_CHANGE else []
            if out[-1]:
                out.append(head)
            else:
                out[-1] = head
        out[-1].append(r)
    return out if out[0] else []


def is_join(recovery: Mapping[str, Any], members: Mapping[int, Collection[int]]) -> bool:
    """Whether a ``recovery`` record's re-formation only admitted workers (a join, nobody failed), given the
    members of each epoch (from the ``membership`` records): every epoch after its ``from_epoch`` up to its
    ``epoch`` added workers and removed none. Anything else (a failure, a stall, an epoch not known) is a
    recovery."""
    first, last = int(recovery.get("from_epoch", -1)), int(recovery.get("epoch", -1))
    if last <= first or first not in members:
        return False
    before = set(members[first])
    for epoch in range(first + 1, last + 1):
        if epoch not in members or not before < set(members[epoch]):
            return False
        before = set(members[epoch])
    return True


def formed_after_epoch(recovery: Mapping[str, Any], published: Mapping[int, float]) -> float | None:
    """From the publication of a ``recovery`` record's epoch to the group formed on it (its ``time_reformed``: a
    worker's clock against the coordinator's, so across hosts within their skew), given each epoch's publication
    time (the ``membership`` records' times, read in order up to the recovery: a restart numbers the epochs from 1
    again). None for a record without the group's time or an epoch not known."""
    if "time_reformed" not in recovery or recovery.get("epoch") not in published:
        return None
    return float(recovery["time_reformed"]) - published[recovery["epoch"]]


def step_losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss; when a resumed run repeated a step, the last record wins."""
    return {r["step"]: r["loss"] for r in read_records(run_dir, RecordKind.STEP)}
