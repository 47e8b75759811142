"""The coordinator's error judge: the workers' exceptions (``keys.error(n)``), each recorded as it is read, and what
they mean (``bugs``): a member that raised is dead (removed at the next look, like a kill); an error that repeats
an earlier one is a bug, and the job stops.

Owns the errors of the run so far (those of earlier sessions count: a bug not fixed stops the run the first time it
raises again), the members that raised and are not removed yet, the stop for a bug (the member named to save the
last good state, ``keys.STOP_SAVER``) and the wait for that save's words (``keys.STOP_SAVED``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from unbroken.control.coordinator import bugs
from unbroken.control.coordinator.drain import METRIC_HOLE_GRACE_S
from unbroken.control.status.progress import describe_error
from unbroken.control.store import keys
from unbroken.control.store.connect import get_int, raised_failure, wait_key
from unbroken.core import ckptfiles
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import ErrorPhase, RecordKind, WorkerError

log = logging.getLogger(__name__)

# At a stop for a bug, the wait for the named worker's save while its heartbeats go on: it reaches its leaving
# at its next call into the protocol (a step's compute, a collective's bound), then saves; a training thread
# hung in the user's code never does.
MAX_SAVE_WAIT_S = 600.0


class ErrorJudge:
    """The workers' exceptions in the order reported. ``write``: where each is recorded; ``stop``: stops the job
    with a line (True if that line is the reason kept)."""

    def __init__(
        self,
        store: Any,
        write: Callable[[dict[str, Any]], None],
        stop: Callable[[str], bool],
        layout: ReplicaLayout,
        run_dir: Path,
        records: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        self.store = store
        self.write = write
        self.stop = stop
        self.layout = layout
        self.run_dir = run_dir
        # Those of the run so far count: a restarted coordinator, the restart policy's relaunch and a --resume go
        # on with them (a bug not fixed stops the run the first time it raises again; a fix moves or removes it).
        self.errors = [WorkerError.from_record(r) for r in records if r.get("type") == RecordKind.ERROR]
        self.next_error = 1
        self.hole_since: dict[int, float] = {}
        self.raised: dict[int, WorkerError] = {}  # members that reported an exception: dead, to be removed
        self.bug: str | None = None  # the stop line when an error repeated
        self.saver: int | None = None  # the member named to save the state it holds at that stop

    def judge(self, members: tuple[int, ...]) -> bool:
        """Take the new error reports: a member of ``members`` that raised is dead (``removals``); an error that
        repeats an earlier one (``bugs``) stops the job (True)."""
        for error in self._take():
            if error.worker in members:
                self.raised[error.worker] = error
            same = bugs.repeated(self.errors, error)
            self.errors.append(error)
            if same:
                self._stop_for_bug(same, members)
                return True
        return False

    def removals(self, members: tuple[int, ...]) -> dict[int, str]:
        """The members of ``members`` that raised, each with its failure's words, forgotten here once handed out
        (its process is ending: its exit, reported next, is not news)."""
        return {w: raised_failure(self.raised.pop(w).headline()) for w in members if w in self.raised}

    def _take(self) -> list[WorkerError]:
        """The exceptions reported since the last look, each recorded as it is read. A number taken but never
        written (its writer was killed in between) is passed over after a grace period."""
        new: list[WorkerError] = []
        seq = get_int(self.store, keys.ERROR_SEQ)
        while self.next_error <= seq:
            n, key = self.next_error, keys.error(self.next_error)
            if self.store.check([key]):
                try:
                    new.append(WorkerError.decode(self.store.get(key).decode()))
                except ValueError as e:
                    log.warning("error report %d is unreadable (%s); ignored", n, e)
                self.store.delete_key(key)
            elif time.monotonic() - self.hole_since.setdefault(n, time.monotonic()) < METRIC_HOLE_GRACE_S:
                break  # taken a moment ago: its writer is about to write it
            self.hole_since.pop(n, None)
            self.next_error += 1
        for error in new:
            record = error.record(time.time())
            self.write(record)
            log.error("%s", describe_error(record, self.run_dir / "logs"))  # a multi-host job's console
        return new

    def _stop_for_bug(self, errors: list[WorkerError], members: tuple[int, ...]) -> None:
        """Stop the job: the error repeated (a bug, not a failure). The lowest member that did not raise holds a
        good state (the last committed step) and is named to save it before it leaves; with none left, the
        worker that just raised does, unless it raised inside a commit (its optimizer may have stepped half-way):
        before or after a commit its state is the last committed step's too. The stop line then says which
        checkpoint is the last good one (``saved_words``). Replicas of several ranks keep the last checkpoint
        on disk (their ranks would have to save together)."""
        line = bugs.stop_line(errors)
        raisers = {e.worker for e in self.errors}
        healthy = [w for w in members if w not in raisers]
        new = errors[-1]
        if self.layout.size == 1:
            if healthy:
                self.saver = min(healthy)
            elif new.worker in members and new.phase not in (ErrorPhase.COMMIT, ErrorPhase.SETUP):
                self.saver = new.worker  # it waits for this answer before it ends
        if self.saver is not None:
            self.store.set(keys.STOP_SAVER, str(self.saver))  # before the stop: whoever sees the stop can read it
        log.error("stopping: %s", line)
        if self.stop(line):
            self.bug = line

    def saved_words(
        self, heartbeat_timeout_s: float, tick_s: float, drain: Callable[[], None], launcher_alive: Callable[[], bool]
    ) -> str:
        """After a stop for a bug: the words naming the last good checkpoint, from the member named to save the
        state once it has (waiting while its heartbeats arrive, so a save of any length is waited for and a
        saver that dies is not; the records drained meanwhile), else as the run directory shows them."""
        if self.saver is not None:
            key, counted = keys.heartbeat(self.saver), (-1, time.monotonic())
            deadline = time.monotonic() + MAX_SAVE_WAIT_S
            while not self.store.check([keys.STOP_SAVED]):
                count, now = get_int(self.store, key), time.monotonic()
                if count != counted[0]:
                    counted = (count, now)
                if now - counted[1] > heartbeat_timeout_s or now > deadline:
                    log.warning("worker %d did not say what it saved; naming the newest checkpoint", self.saver)
                    break
                if not launcher_alive():
                    break
                drain()
                wait_key(self.store, keys.STOP_SAVED, tick_s)
            else:
                return self.store.get(keys.STOP_SAVED).decode()
        return ckptfiles.last_checkpoint_words(self.run_dir)
