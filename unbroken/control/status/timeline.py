"""The status view's timeline: each metrics record said as one sentence a person reads (``entry``).

Owns the wording of the timeline that the status page and ``unbroken status`` show (``RunView`` keeps its newest
entries): an entry is the record's ``time``, its ``kind`` (the page colours by it) and ``text``, with the fields
the views point at (``worker``, ``step``, ``epoch``, ``members``). A sentence about a re-formation or a join reads
the run's facts (``core.runfacts``, folded up to and with the record): a join that admitted a warm spare says so.
A user's own record (``ctx.log("user", ...)``) and a kind this version does not know are shown as their fields;
``eval`` and ``goodput`` records are curves, not events. Pure Python.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from unbroken.control.coordinator.failslow import describe as describe_slow
from unbroken.core.records import RecordKind, SpareState, WorkerError
from unbroken.core.runfacts import RunFacts, kind_of, number

Record = Mapping[str, Any]
Entry = dict[str, Any]
RAW_CHARS = 300  # the most of a record's fields a raw entry shows


def ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f} ms"


def after(steps_done: Any) -> str:
    """A checkpoint's (or the end's) place, from the steps done it is named by: ``after step 7``."""
    return f"after step {steps_done - 1}" if isinstance(steps_done, int) and steps_done > 0 else "before step 0"


def entry(record: Record, facts: RunFacts) -> Entry | None:
    """The timeline's entry for ``record`` (None: not an event), ``facts`` folded with it."""
    kind = kind_of(record)
    t = number(record.get("time"))
    if kind is None or kind is RecordKind.USER:
        fields = {k: v for k, v in record.items() if k not in ("type", "time")}
        text = json.dumps(fields, sort_keys=True, default=str)[:RAW_CHARS]
        return {"time": t, "kind": str(record.get("type", "?")), "text": text}
    say = _SENTENCES.get(kind)
    if say is None:
        return None
    said = say(record, facts)
    if said is None:
        return None
    text, fields = said if isinstance(said, tuple) else (said, {})
    return {"time": t, "kind": str(kind), "text": text, **fields}


def _membership(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]]:
    epoch, members = facts.epochs[-1].epoch, facts.epochs[-1].members
    before = set(facts.epochs[-2].members) if len(facts.epochs) > 1 else None
    reason = str(r.get("reason", ""))
    if before is None:
        text = f"epoch {epoch}: started with workers {members}"
    elif before == set(members):
        text = f"epoch {epoch}: the same workers {members} re-formed ({reason})"
    else:
        text = f"epoch {epoch}: members {members} ({reason})"
    return text, {"epoch": epoch, "members": members}


def _recovery(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]]:
    rec = facts.reformations[-1]
    step, shift = rec.step, f"epoch {rec.from_epoch} -> {rec.epoch}, {r.get('alive')} alive"
    if rec.join:
        epochs = facts.sessions[-1].epochs
        joined = sorted(set(epochs[rec.epoch]) - set(epochs[rec.from_epoch]))
        spares = {
            w: k
            for j in facts.joins
            if j.session == rec.session and rec.from_epoch < j.epoch <= rec.epoch
            for w, k in j.spares.items()
        }
        who = [f"spare {spares[w]} (in worker {w}'s place)" if w in spares else f"worker {w}" for w in joined]
        came = "joined" if spares else "rejoined"
        return f"{', '.join(who)} {came} at step {step}: {shift}", {"kind": "join", "step": step}
    # A group formed at a step boundary misses every microbatch of the step: nothing to redo.
    latest = facts.latest
    whole_step = latest is not None and len(rec.missing) == latest.microbatches
    todo = "" if not rec.missing or whole_step else f"; microbatches {rec.missing} to redo"
    return f"group re-formed at step {step}: {shift}, in {ms(rec.reform_s)}{todo}", {"step": step}


def _failure(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]]:
    worker, detection = int(r.get("worker", -1)), number(r.get("detection_s"))
    detected = "" if detection is None else f" (detected {ms(detection)} after the fault)"
    return f"worker {worker} failed: {r.get('why')}{detected}", {"worker": worker}


def _spare(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]] | None:
    spare, state = r.get("spare"), r.get("state")
    if state == SpareState.PROMOTED:
        return f"spare {spare} takes the place of worker {r.get('worker')}", {"worker": r.get("worker")}
    if state == SpareState.EXITED:
        return f"spare {spare} ended while it waited ({r.get('why')})", {}
    return None


def _admitted(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]]:
    worker, host, start = r.get("worker"), r.get("host") or "?", number(r.get("start_s"))
    started = "" if start is None else f", started in {start:.2f} s" + (" (forked)" if r.get("forked") else "")
    return f"worker {worker} registered from {host}{started}", {"worker": worker}


def _start_state(r: Record, facts: RunFacts) -> str:
    if r.get("differed"):
        return f"before step {r.get('step')}: {r.get('reason')}"
    return f"before step {r.get('step')}: the members {r.get('members')} start from the same state"


def _config_change(r: Record, facts: RunFacts) -> str:
    return f"config changed: {facts.changes[-1].line()}" if facts.changes else "config changed"


def _step(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]] | None:
    if r.get("committed") is False:
        return f"step {r.get('step')} not committed", {"step": r.get("step")}
    return None


def _coordinator(r: Record, facts: RunFacts) -> str:
    restored = r.get("restored_epoch") or 0
    if restored:
        return f"a new coordinator took over at {r.get('address')} (restored epoch {restored})"
    n = len(facts.sessions)
    return f"coordinator started at {r.get('address')}" + (f" (session {n} of the run)" if n > 1 else "")


def _error(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]]:
    error = WorkerError.from_record(dict(r))
    return f"worker {error.worker} raised {error.headline()}", {"worker": error.worker}


def _injected(r: Record, facts: RunFacts) -> tuple[str, dict[str, Any]]:
    worker = int(r.get("worker", -1))
    return f"{r.get('kind', 'fault')} delivered to worker {worker}: {r.get('event')}", {"worker": worker}


_SENTENCES: dict[RecordKind, Callable[[Record, RunFacts], str | tuple[str, dict[str, Any]] | None]] = {
    RecordKind.MEMBERSHIP: _membership,
    RecordKind.RECOVERY: _recovery,
    RecordKind.FAILURE: _failure,
    RecordKind.INJECTED: _injected,
    RecordKind.SPARE: _spare,
    RecordKind.ADMITTED: _admitted,
    RecordKind.START_STATE: _start_state,
    RecordKind.CONFIG_CHANGE: _config_change,
    RecordKind.STEP: _step,
    RecordKind.COORDINATOR: _coordinator,
    RecordKind.ERROR: _error,
    RecordKind.CHECKPOINT: lambda r, f: f"checkpoint {after(r.get('step'))} written in {ms(number(r.get('seconds')))}",
    RecordKind.SLOW: lambda r, f: (describe_slow(r), {"worker": int(r.get("worker", -1))}),
    RecordKind.FINAL: lambda r, f: (
        f"run finished {after(r.get('step'))}; the workers' parameters are "
        + ("identical" if r.get("identical") else "NOT identical")
    ),
    RecordKind.STOPPED: lambda r, f: f"run stopped at step {r.get('step')}: {r.get('reason')}",
    RecordKind.COORDINATOR_LOST: lambda r, f: (
        f"the coordinator was lost; state of step {r.get('step')} saved to {r.get('path')}"
    ),
    RecordKind.RESUME: lambda r, f: (f"resumed at step {r.get('step')} from {r.get('path')}", {"step": r.get("step")}),
    RecordKind.RESTART: lambda r, f: (
        f"job relaunched with {r.get('workers')} workers in {r.get('stop_and_relaunch_s')} s"
    ),
    RecordKind.CHECKPOINT_REJECTED: lambda r, f: f"damaged checkpoint skipped: {r.get('detail')}",
    RecordKind.INJECTION_SKIPPED: lambda r, f: f"not injected into worker {r.get('worker')}: {r.get('why')}",
    RecordKind.NONFINITE_SKIP: lambda r, f: (
        f"step {r.get('step')} skipped: non-finite gradient in {r.get('parameter')}"
    ),
    RecordKind.STALL: lambda r, f: (
        f"a collective of epoch {r.get('epoch')} stalled (suspects {r.get('suspects')}): {r.get('decision')}"
    ),
    RecordKind.GATEWAY: lambda r, f: f"gateway: {r.get('admitted')} admitted, {r.get('rejected')} rejected",
    RecordKind.REFUSED: lambda r, f: (str(r.get("reason")), {"worker": r.get("worker")}),  # names the worker
    RecordKind.IMPURE_DATA: lambda r, f: f"data check failed at step {r.get('step')}: {r.get('reason')}",
}
