"""The JSON model of a run (``RunView``): its metrics records folded, one at a time, into what an operator sees.

Owns the live view's content: which workers are alive, the step, the loss and step-time curves, every failure
with its recovery (detection, re-formation, recomputed microbatches, rejoin) as one incident, a timeline of
every event, each worker's share of the step and (when the workers publish it) its speed, and the
checkpoints. Steps are named as in the records (from 0); recoveries (re-formations after a failure) and joins
(re-formations that admitted workers) are counted apart (``records.is_join``). It reads nothing but records
and writes nothing: the coordinator hands it each record as it appends it to ``RUN_DIR/metrics.jsonl``
(through ``MetricsTee``), and ``RunView.from_run_dir`` folds a run's file. ``snapshot()`` is a plain
JSON-ready dict (layout ``SNAPSHOT_VERSION``, documented in docs/status.md) served by ``control.status`` and
drawn by the page and by ``control.status_view``.

Memory stays bounded on a run of any length: the curves are thinned to ``max_points`` (every ``stride``-th
step kept, the newest always shown), and the timeline, the incidents and the checkpoints keep their newest.
Pure Python; thread-safe (one writer, any number of readers).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import statistics
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from unbroken.control.coordinator.failslow import (
    Exclusion,
    SlowDecision,
    SlowDetector,
    SlowRule,
    SlowState,
    Verdict,
    exclusion,
)
from unbroken.control.coordinator.failslow import describe as describe_slow
from unbroken.core.config import SlowPolicy, Workload
from unbroken.core.goodput import Bucket, Tracker
from unbroken.core.records import RecordKind, WorkerError, decode, is_join, make, read_records

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
MAX_POINTS = 2000  # per curve; past it every other kept step is dropped and the stride doubles
MAX_EVENTS = 500  # timeline entries kept (the newest)
MAX_INCIDENTS = 200  # failures kept with their recovery (the newest)
MAX_CHECKPOINTS = 50
RECENT_STEPS = 20  # the step time and throughput shown are medians over this many of the newest steps
STRAGGLER_RATIO = 1.5  # a worker is a straggler when its seconds per microbatch exceed this x the others' median
TERMINAL_STATES = frozenset({"finished", "stopped", "failed", "coordinator_lost"})
INCIDENT_FIELDS = (  # one failure, from the fault to the worker's return (docs/status.md)
    *("worker", "epoch", "step", "event", "why", "injected_at", "detected_at", "detection_s"),
    *("reformed_at", "reform_s", "recovery_step", "missing", "recomputed", "dropped", "recovery_step_time_s"),
    *("rejoined_at", "rejoin_epoch", "rejoin_step", "down_s"),
)


def _num(x: Any) -> float | None:
    """``x`` as a finite float, else None (JSON has no NaN; a republished step has no timing)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


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


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f} ms"


def _after(steps_done: Any) -> str:
    """A checkpoint's (or the end's) place, from the steps done it is named by: ``after step 7``."""
    return f"after step {steps_done - 1}" if isinstance(steps_done, int) and steps_done > 0 else "before step 0"


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
        self._state = "starting"
        self._state_detail = ""
        self._first_time: float | None = None
        self._last_time: float | None = None
        self._epoch = 0
        self._members: tuple[int, ...] | None = None
        self._epochs: dict[int, list[int]] = {}  # epoch -> its members
        self._workers: dict[int, dict[str, Any]] = {}
        self._steps = _Series(("step", "loss", "step_time_s", "tokens_per_s", "alive", "lr", "grad_norm"), max_points)
        self._evals = _Series(("step", "val_loss"), max_points)
        self._max_step = -1
        self._tokens = 0
        self._last_step: dict[str, Any] | None = None
        self._last_val: float | None = None
        # (step time, tokens/s, tokens/s per GPU, MFU) of the newest steps (core.throughput's fields)
        self._recent: collections.deque[tuple[float | None, ...]] = collections.deque(maxlen=RECENT_STEPS)
        self._quotas: dict[int, int] = {}
        self._speeds: dict[int, float] = {}
        self._fail_slow: set[int] = set()  # fail-slow by the ``slow`` records (core.failslow), not yet recovered
        self._compute: dict[int, float] = {}
        self._recomputed = 0
        self._dropped = 0
        self._pending_injection: dict[int, dict[str, Any]] = {}
        self._incidents: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_INCIDENTS)
        self._num_incidents = 0
        self._num_recoveries = 0  # re-formations after a failure (or a stall)
        self._num_joins = 0  # re-formations that admitted workers
        self._sessions = 0  # coordinators started from disk (a launch, --resume, a restart-policy relaunch)
        self._awaiting_step: list[dict[str, Any]] = []  # incidents re-formed, waiting for their step's record
        self._timeline: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self._num_events = 0
        self._checkpoints: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_CHECKPOINTS)
        self._num_checkpoints = 0
        self._final: dict[str, Any] | None = None
        self._spares: dict[int, dict[str, Any]] = {}  # warm spare -> its state (``SpareState``) and worker
        # the goodput records (core.goodput): the account at each, badput seconds by bucket
        self._goodput = _Series(("step", "tokens_per_s", "ideal_tokens_per_s", "ratio", *map(str, Bucket)), max_points)

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
        t = _num(r.get("time"))
        if t is not None:
            self._first_time = t if self._first_time is None else min(self._first_time, t)
            self._last_time = t if self._last_time is None else max(self._last_time, t)
        handler = getattr(self, f"_on_{r.get('type')}", None)
        if handler is None:
            fields = {k: v for k, v in r.items() if k not in ("type", "time")}
            self._event(t, str(r.get("type", "?")), json.dumps(fields, sort_keys=True, default=str)[:300])
        else:
            handler(r, t)

    def _event(self, t: float | None, kind: str, text: str, **fields: Any) -> None:
        self._num_events += 1
        self._timeline.append({"time": t, "kind": kind, "text": text, **fields})

    def _worker(self, wid: int) -> dict[str, Any]:
        if wid not in self._workers:
            self._workers[wid] = {"id": wid, "state": "unknown", "since": None, "failures": 0, "last_failure": None}
        return self._workers[wid]

    def _current_step(self) -> int:
        return self._max_step + 1  # the step in progress

    def _on_membership(self, r: Mapping[str, Any], t: float | None) -> None:
        members = tuple(sorted(int(w) for w in r.get("members", [])))
        epoch = int(r.get("epoch", self._epoch + 1))
        self._epochs[epoch] = list(members)
        before = set(self._members or ())
        joined, left = set(members) - before, before - set(members)
        first = self._members is None
        self._members, self._epoch = members, epoch
        if self.expected_workers is None and first:
            self.expected_workers = len(members)
        for wid in sorted(joined):
            w = self._worker(wid)
            w.update(state="alive", since=t)
            if not first:
                for inc in self._incidents:
                    if inc["worker"] == wid and inc["rejoined_at"] is None:
                        inc.update(rejoined_at=t, rejoin_epoch=epoch, rejoin_step=self._current_step())
                        start = inc["injected_at"] or inc["detected_at"]
                        inc["down_s"] = None if t is None or start is None else t - start
        for wid in sorted(left):
            self._worker(wid).update(state="left", since=t)
            self._incident(wid, epoch, t)
        reason = str(r.get("reason", ""))
        if first:
            text = f"epoch {epoch}: started with workers {list(members)}"
        elif not joined and not left:
            text = f"epoch {epoch}: the same workers {list(members)} re-formed ({reason})"
        else:
            text = f"epoch {epoch}: members {list(members)} ({reason})"
        self._event(t, "membership", text, epoch=epoch, members=list(members))
        if not members:
            self._set_state("failed", reason or "no worker left")
        elif self._state == "starting":
            self._set_state("training")

    def _incident(self, wid: int, epoch: int, t: float | None) -> dict[str, Any]:
        """The incident of worker ``wid`` leaving in ``epoch`` (opened by the membership or the failure
        record, whichever comes first)."""
        for inc in reversed(self._incidents):
            if inc["worker"] == wid and inc["epoch"] == epoch:
                return inc
        injected = self._pending_injection.pop(wid, None) or {}
        inc: dict[str, Any] = dict.fromkeys(INCIDENT_FIELDS)
        inc.update(worker=wid, epoch=epoch, step=self._current_step(), detected_at=t)
        inc.update(event=injected.get("event"), injected_at=injected.get("time"))
        self._incidents.append(inc)
        self._num_incidents += 1
        self._worker(wid)["failures"] += 1
        return inc

    def _on_injected(self, r: Mapping[str, Any], t: float | None) -> None:
        wid = int(r.get("worker", -1))
        # The launcher's record may come after the failure it caused (it publishes through the store too).
        late = [i for i in self._incidents if i["worker"] == wid and i["event"] == r.get("event") and t is not None]
        if late:
            inc = late[-1]
            inc["injected_at"] = t
            if inc["rejoined_at"] is not None:
                inc["down_s"] = inc["rejoined_at"] - t
        else:
            self._pending_injection[wid] = {"event": r.get("event"), "time": t}
        self._event(t, "injected", f"{r.get('kind', 'fault')} delivered to worker {wid}: {r.get('event')}", worker=wid)

    def _on_failure(self, r: Mapping[str, Any], t: float | None) -> None:
        wid = int(r.get("worker", -1))
        inc = self._incident(wid, int(r.get("epoch", self._epoch)), t)
        detection = _num(r.get("detection_s"))
        inc.update(why=r.get("why"), detected_at=t, detection_s=detection)
        if r.get("event") is not None:
            inc["event"] = r["event"]
        if inc["injected_at"] is None and detection is not None and t is not None:
            inc["injected_at"] = t - detection
        w = self._worker(wid)
        w.update(state="dead", last_failure=r.get("why"))
        w["since"] = w["since"] if w["since"] is not None else t
        detected = "" if detection is None else f" (detected {_ms(detection)} after the fault)"
        self._event(t, "failure", f"worker {wid} failed: {r.get('why')}{detected}", worker=wid)

    def _on_recovery(self, r: Mapping[str, Any], t: float | None) -> None:
        epoch, from_epoch = int(r.get("epoch", self._epoch)), int(r.get("from_epoch", -1))
        step = r.get("step")
        reform = _num(r.get("reform_s"))
        missing = list(r.get("missing") or [])
        for inc in self._incidents:
            if inc["rejoin_epoch"] == epoch:
                inc["rejoin_step"] = step  # the joiner trains from this step on
        if is_join(r, self._epochs):
            self._num_joins += 1
            joined = sorted(set(self._epochs[epoch]) - set(self._epochs[from_epoch]))
            self._event(
                t,
                "join",
                f"worker {', '.join(map(str, joined))} rejoined at step {step}: epoch {from_epoch} -> {epoch}, "
                f"{r.get('alive')} alive",
                step=step,
            )
            return
        self._num_recoveries += 1
        for inc in self._incidents:
            if inc["reformed_at"] is None and from_epoch < inc["epoch"] <= epoch:
                inc.update(
                    reformed_at=_num(r.get("time_reformed")) or t, reform_s=reform, recovery_step=step, missing=missing
                )
                if step is not None:
                    inc["step"] = step  # the step the failure interrupted (the guess at its record is replaced)
                self._awaiting_step.append(inc)
        # A group formed at a step boundary misses every microbatch of the step: nothing to redo.
        whole_step = self._last_step is not None and len(missing) == self._last_step.get("microbatches")
        todo = "" if not missing or whole_step else f"; microbatches {missing} to redo"
        self._event(
            t,
            "recovery",
            f"group re-formed at step {step}: epoch {from_epoch} -> {epoch}, {r.get('alive')} alive, "
            f"in {_ms(reform)}{todo}",
            step=step,
        )

    def _on_step(self, r: Mapping[str, Any], t: float | None) -> None:
        step = int(r["step"])
        if r.get("republished") and step <= self._max_step:
            return  # a new leader re-published a step whose record arrived: nothing new
        step_time, tps = _num(r.get("step_time_s")), _num(r.get("tokens_per_s"))
        self._steps.add(
            (step, _num(r.get("loss")), step_time, tps, r.get("alive"), _num(r.get("lr")), _num(r.get("grad_norm")))
        )
        if step > self._max_step:
            self._tokens += int(r.get("tokens", 0) or 0)
            self._recomputed += int(r.get("recomputed", 0) or 0)
            self._dropped += int(r.get("dropped", 0) or 0)
        self._max_step = max(self._max_step, step)
        self._last_step = dict(r)
        self._recent.append((step_time, tps, _num(r.get("tokens_per_s_per_gpu")), _num(r.get("mfu"))))
        if "quotas" in r:
            self._quotas = {w: int(n) for w, n in _workers(r["quotas"]).items()}
        if "speeds" in r:
            self._speeds = {w: s for w, v in _workers(r["speeds"]).items() if (s := _num(v)) is not None}
        if "compute_s" in r:
            self._compute = {w: s for w, v in _workers(r["compute_s"]).items() if (s := _num(v)) is not None}
        still = []
        for inc in self._awaiting_step:
            if inc["recovery_step"] is None or step >= inc["recovery_step"]:
                inc.update(recomputed=r.get("recomputed"), dropped=r.get("dropped"), recovery_step_time_s=step_time)
            else:
                still.append(inc)
        self._awaiting_step = still
        if r.get("committed") is False:
            self._event(t, "step", f"step {step} not committed", step=step)
        if self._state == "starting":
            self._set_state("training")

    def _on_eval(self, r: Mapping[str, Any], t: float | None) -> None:
        self._last_val = _num(r.get("val_loss"))
        self._evals.add((int(r["step"]), self._last_val))

    def _on_checkpoint(self, r: Mapping[str, Any], t: float | None) -> None:
        self._num_checkpoints += 1
        self._checkpoints.append(
            {"step": r.get("step"), "path": r.get("path"), "seconds": _num(r.get("seconds")), "time": t}
        )
        seconds = _ms(_num(r.get("seconds")))
        self._event(t, "checkpoint", f"checkpoint {_after(r.get('step'))} written in {seconds}")

    def _on_slow(self, r: Mapping[str, Any], t: float | None) -> None:
        worker = int(r.get("worker", -1))
        if r.get("state") == SlowState.SLOW:
            self._fail_slow.add(worker)
        else:
            self._fail_slow.discard(worker)
        self._event(t, "slow", describe_slow(r), worker=worker)

    def _on_goodput(self, r: Mapping[str, Any], t: float | None) -> None:
        buckets = r.get("buckets") or {}
        head = (int(r.get("step", self._max_step)), _num(r.get("tokens_per_s")), _num(r.get("ideal_tokens_per_s")))
        self._goodput.add((*head, _num(r.get("ratio")), *(_num(buckets.get(str(b))) for b in Bucket)))

    def _on_final(self, r: Mapping[str, Any], t: float | None) -> None:
        checksums = {str(k): v for k, v in _workers(r.get("checksums")).items()}
        self._final = {"step": r.get("step"), "identical": r.get("identical"), "checksums": checksums}
        same = "identical" if r.get("identical") else "NOT identical"
        self._event(t, "final", f"run finished {_after(r.get('step'))}; the workers' parameters are {same}")
        self._set_state("finished")

    def _on_coordinator(self, r: Mapping[str, Any], t: float | None) -> None:
        restored = r.get("restored_epoch") or 0
        if restored:
            text = f"a new coordinator took over at {r.get('address')} (restored epoch {restored})"
        else:
            self._sessions += 1
            text = f"coordinator started at {r.get('address')}" + (
                f" (session {self._sessions} of the run)" if self._sessions > 1 else ""
            )
            if self._sessions > 1 and self._state in TERMINAL_STATES:
                self._set_state("starting")  # resumed or relaunched: the earlier session's end is not the run's
        self._event(t, "coordinator", text)

    def _on_error(self, r: Mapping[str, Any], t: float | None) -> None:
        error = WorkerError.from_record(dict(r))
        self._event(t, "error", f"worker {error.worker} raised {error.headline()}", worker=error.worker)

    def _on_stopped(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(t, "stopped", f"run stopped at step {r.get('step')}: {r.get('reason')}")
        self._set_state("stopped", str(r.get("reason", "")))

    def _on_coordinator_lost(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(
            t, "coordinator_lost", f"the coordinator was lost; state of step {r.get('step')} saved to {r.get('path')}"
        )
        self._set_state("coordinator_lost", str(r.get("path", "")))

    def _on_resume(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(t, "resume", f"resumed at step {r.get('step')} from {r.get('path')}", step=r.get("step"))
        self._set_state("training")

    def _on_restart(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(t, "restart", f"job relaunched with {r.get('workers')} workers in {r.get('stop_and_relaunch_s')} s")

    def _on_checkpoint_rejected(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(t, "checkpoint_rejected", f"damaged checkpoint skipped: {r.get('detail')}")

    def _on_injection_skipped(self, r: Mapping[str, Any], t: float | None) -> None:
        self._pending_injection.pop(int(r.get("worker", -1)), None)
        self._event(t, "injection_skipped", f"not injected into worker {r.get('worker')}: {r.get('why')}")

    def _on_nonfinite_skip(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(t, "nonfinite_skip", f"step {r.get('step')} skipped: non-finite gradient in {r.get('parameter')}")

    def _on_stall(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(
            t,
            "stall",
            f"a collective of epoch {r.get('epoch')} stalled (suspects {r.get('suspects')}): {r.get('decision')}",
        )

    def _on_spare(self, r: Mapping[str, Any], t: float | None) -> None:
        k = int(r.get("spare", -1))
        self._spares[k] = {"spare": k, "state": r.get("state"), "worker": r.get("worker"), "since": t}
        if r.get("state") == "promoted":
            self._event(t, "spare", f"spare {k} takes the place of worker {r.get('worker')}", worker=r.get("worker"))
        elif r.get("state") == "exited":
            self._event(t, "spare", f"spare {k} ended while it waited ({r.get('why')})")

    def _on_gateway(self, r: Mapping[str, Any], t: float | None) -> None:
        self._event(t, "gateway", f"gateway: {r.get('admitted')} admitted, {r.get('rejected')} rejected")

    def _set_state(self, state: str, detail: str = "") -> None:
        self._state, self._state_detail = state, detail

    # -- output -----------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The run as JSON-ready data (no NaN; see docs/status.md for every field)."""
        with self._cond:
            recent = [[x for x in column if x is not None] for column in zip(*self._recent, strict=True)] or [[]] * 4
            recent_times, recent_tps, recent_per_gpu, recent_mfu = recent
            last = self._last_step or {}
            checkpoint = self._checkpoints[-1] if self._checkpoints else None
            run = {
                "state": self._state,
                "state_detail": self._state_detail,
                "run_dir": self.run_dir,
                "total_steps": self.total_steps,
                "steps_done": self._max_step + 1,
                "last_step": self._max_step if self._max_step >= 0 else None,
                "epoch": self._epoch,
                "members": list(self._members or ()),
                "alive": len(self._members or ()),
                "expected_workers": self.expected_workers,
                "loss": _num(last.get("loss")),
                "val_loss": self._last_val,
                "lr": _num(last.get("lr")),
                "tokens": self._tokens,
                "step_time_s": statistics.median(recent_times) if recent_times else None,
                "tokens_per_s": statistics.median(recent_tps) if recent_tps else None,
                "tokens_per_s_per_gpu": statistics.median(recent_per_gpu) if recent_per_gpu else None,
                "mfu": statistics.median(recent_mfu) if recent_mfu else None,
                "started_at": self._first_time,
                "updated_at": self._last_time,
                "failures": self._num_incidents,
                "recoveries": self._num_recoveries,
                "joins": self._num_joins,
                "sessions": self._sessions,
                "recomputed_microbatches": self._recomputed,
                "dropped_microbatches": self._dropped,
                "checkpoints": self._num_checkpoints,
                "last_checkpoint": checkpoint,
                "final": self._final,
                "spares": {
                    state: sum(1 for x in self._spares.values() if x["state"] == state)
                    for state in ("started", "ready", "promoted")
                },
            }
            return {
                "version": SNAPSHOT_VERSION,
                "seq": self._seq,
                "server_time": time.time(),
                "run": run,
                "workers": self._worker_rows(),
                "series": self._steps.columns(),
                "eval": self._evals.columns(),
                "incidents": [dict(i) for i in self._incidents],
                # in time order: a record can arrive after a later one (the launcher's, through the store)
                "timeline": sorted((dict(e) for e in self._timeline), key=lambda e: e["time"] or 0.0),
                "timeline_dropped": self._num_events - len(self._timeline),
                "checkpoints": [dict(c) for c in self._checkpoints],
                "spares": [dict(x) for _, x in sorted(self._spares.items())],
                "goodput": self._goodput.columns(),
            }

    def _worker_rows(self) -> list[dict[str, Any]]:
        members = set(self._members or ())
        rows = []
        for wid in sorted(set(self._workers) | members):
            row = dict(self._worker(wid))
            alive = wid in members
            speed = self._speeds.get(wid) if alive else None
            quota = self._quotas.get(wid) if alive else None
            others = [s for w, s in self._speeds.items() if w != wid and w in members]
            compute = self._compute.get(wid) if alive else None
            if compute is None and speed is not None and quota is not None:
                compute = speed * quota
            row.update(
                quota=quota,
                s_per_microbatch=speed,
                compute_s=compute,
                straggler=None if speed is None or not others else speed > STRAGGLER_RATIO * statistics.median(others),
                fail_slow=alive and wid in self._fail_slow,
            )
            rows.append(row)
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


class SlowRecorder:
    """A sink that watches the step records for fail-slow workers (``core.failslow``) and writes a ``slow``
    record into ``tee`` for each verdict. Under ``recovery.slow = "report"`` that, and a warning, is all it
    does; under ``"rebalance"`` it calls ``rebalance(True)`` at a worker's verdict and ``rebalance(False)`` when
    no worker is fail-slow any more (the coordinator switches the throughput workload on and off); under
    ``"exclude"`` a fail-slow worker whose exclusion pays off (``core.failslow.exclusion``, with the steps left
    of ``total_steps``) is handed to ``exclude`` (the coordinator removes it like a failed one), unless it leads
    the group (the lowest member, of replicas of ``replica_size`` ranks the lowest replica: it publishes the
    records and writes the checkpoints): that one is rebalanced around instead, as under ``"rebalance"``, until
    it recovers or leaves (kept, where ``workload`` is already throughput). ``records``: the run's so far,
    replayed without records (a restarted coordinator goes on where it was)."""

    def __init__(
        self,
        tee: MetricsTee,
        rule: SlowRule,
        records: Iterable[Mapping[str, Any]] = (),
        policy: SlowPolicy = SlowPolicy.REPORT,
        total_steps: int = 0,
        exclude: Callable[[int, str], None] | None = None,
        rebalance: Callable[[bool], None] | None = None,
        workload: Workload = Workload.EVEN,
        replica_size: int = 1,
    ) -> None:
        self.tee = tee
        self.detector = SlowDetector(rule)
        self.policy = policy
        self.total_steps = total_steps
        self.exclude = exclude
        self.rebalance = rebalance
        self.workload = workload
        self.replica_size = replica_size
        self.members: tuple[int, ...] = ()  # the newest membership record's
        self.leader_rebalanced: set[int] = set()  # leaders rebalanced around under "exclude", not yet recovered
        for r in records:
            if r.get("type") == RecordKind.STEP:
                self.detector.observe(r)
            elif r.get("type") == RecordKind.MEMBERSHIP:
                self.members = tuple(r.get("members") or ())

    def leader(self, step: Mapping[str, Any]) -> int | None:
        """The unit (worker, or replica) that leads the group now: the newest membership's lowest, else the
        lowest of the step's own members."""
        if self.members:
            return min(self.members) // self.replica_size
        units = [int(w) for w in (step.get("quotas") or step.get("speeds") or {})]
        return min(units) if units else None

    def write(self, record: Mapping[str, Any]) -> None:
        if record.get("type") == RecordKind.MEMBERSHIP:
            self.members = tuple(record.get("members") or ())
            units = {w // self.replica_size for w in self.members}
            gone = [w for w in self.detector.slow if w not in units]
            for worker in gone:  # it died or was excluded: should it come back, it is judged afresh
                self.detector.forget(worker)
            if gone and not self.detector.slow and self.policy is SlowPolicy.REBALANCE and self.rebalance:
                self.rebalance(False)
            self._leader_well({w for w in self.leader_rebalanced if w not in units})
            return
        if record.get("type") != RecordKind.STEP:
            return
        for v in self.detector.observe(record):
            estimate = None
            if self.policy is SlowPolicy.EXCLUDE and v.state is SlowState.SLOW:
                estimate = exclusion(record, v.worker, self.total_steps - 1 - v.step)
            decision, leader = self._decide(v, record, estimate)
            fields = {**v.fields(), "decision": str(decision), "floor_s": self.detector.rule.floor_s}
            fields |= estimate.fields() if estimate is not None else {}
            fields |= {"leader": True} if leader else {}
            slow = make(RecordKind.SLOW, time.time(), **fields)
            log.log(logging.WARNING if v.state is SlowState.SLOW else logging.INFO, "%s", describe_slow(slow))
            self.tee.write(slow)
            self._act(v, decision)

    def _decide(self, v: Verdict, record: Mapping[str, Any], estimate: Exclusion | None) -> tuple[SlowDecision, bool]:
        """What the policy does about verdict ``v`` (the step record ``record`` decided it; ``estimate``: what
        excluding the worker would save, under "exclude"), and whether it is the leader that exclude spared."""
        if self.policy is SlowPolicy.REBALANCE:
            return SlowDecision.REBALANCE, False
        if self.policy is not SlowPolicy.EXCLUDE:
            return SlowDecision.REPORT, False
        if v.state is SlowState.RECOVERED:
            return (SlowDecision.REBALANCE if v.worker in self.leader_rebalanced else SlowDecision.REPORT), False
        if estimate is None or not estimate.pays_off:
            return SlowDecision.KEEP, False
        if v.worker != self.leader(record):
            return SlowDecision.EXCLUDE, False
        # The leader publishes the records and writes the checkpoints; the leadership moves only when it leaves.
        # Rather than make a failure of the group's leader out of a slowness, the work is routed around it.
        usable = self.rebalance is not None and self.workload is not Workload.THROUGHPUT
        return (SlowDecision.REBALANCE if usable else SlowDecision.KEEP), True

    def _act(self, v: Verdict, decision: SlowDecision) -> None:
        if self.policy is SlowPolicy.REBALANCE and self.rebalance is not None:
            if v.state is SlowState.SLOW or not self.detector.slow:
                self.rebalance(v.state is SlowState.SLOW)
        elif self.policy is SlowPolicy.EXCLUDE and decision is SlowDecision.REBALANCE and self.rebalance is not None:
            if v.state is SlowState.SLOW:
                if not self.leader_rebalanced:
                    self.rebalance(True)
                self.leader_rebalanced.add(v.worker)
            else:
                self._leader_well({v.worker})
        if decision is SlowDecision.EXCLUDE and self.exclude is not None:
            self.exclude(v.worker, f"fail-slow: {v.relative:.2f}x the others' time per microbatch")

    def _leader_well(self, workers: set[int]) -> None:
        """Leaders rebalanced around that recovered or left: the config's workload again once none is left."""
        if workers & self.leader_rebalanced:
            self.leader_rebalanced -= workers
            if not self.leader_rebalanced and self.rebalance is not None:
                self.rebalance(False)
