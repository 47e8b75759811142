"""Metrics records: their kinds and fields, the one writer of ``RUN_DIR/metrics.jsonl`` and its one reader.

A record is a JSON object on one line with a ``type`` (``RecordKind``) and that kind's fields (``FIELDS``;
more may be present). Workers publish records through the coordinator, which appends them with
``MetricsFile``; a worker that outlives its coordinator appends what was not drained with
``append_records``. The launcher, the report, the benchmarks, chaos and the tests read them with
``read_records``. Pure Python.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
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
    USER = "user"  # anything a user's script logs
    IMPURE_DATA = "impure_data"  # the data check found a microbatch whose inputs differ between two workers


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
    RecordKind.USER: frozenset(),
    RecordKind.IMPURE_DATA: frozenset({"step", "microbatch", "workers", "reason"}),
}


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


class MetricsFile:
    """The writer: appends records to ``RUN_DIR/metrics.jsonl``, one line each, flushed per line."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(encode(record) + "\n")

    def write_line(self, line: str) -> None:
        """A line published by a worker (already ``encode``d there)."""
        self._f.write(line.rstrip("\n") + "\n")

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
        lines = set(tail.splitlines())
        out = "" if not tail or tail.endswith("\n") else "\n"
        for record in records:
            line = encode(record)
            if line not in lines:
                out += line + "\n"
        f.write(out.encode())


def read_records(run_dir: Path, kind: RecordKind | str | None = None) -> list[dict[str, Any]]:
    """All records of ``RUN_DIR/metrics.jsonl`` (of one kind if given), in file order; torn lines skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    wanted = None if kind is None else str(RecordKind(kind))
    records = []
    for line in path.read_text().splitlines():
        record = decode(line)
        if record is not None and (wanted is None or record["type"] == wanted):
            records.append(record)
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


def step_losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss; when a resumed run repeated a step, the last record wins."""
    return {r["step"]: r["loss"] for r in read_records(run_dir, RecordKind.STEP)}
