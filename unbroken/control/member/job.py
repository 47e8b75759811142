"""The job's keys as one worker reads and writes them: the epochs' records, the stop, a refusal, the end of the run,
a stop's saver, and this worker's dying words.

Owns ``Epoch`` (an epoch's record as a worker reads it) and the first-epoch wait. Reads that must survive a
coordinator being replaced go through the client's held store (``control.member.reconnect.HeldStore``: they wait
for the new one); calls made on the way out (a stop, an error, the saver's answer) go on the current connection
and give up if it fails, since nobody is left to tell.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.store import keys
from unbroken.control.store.connect import report_error, request_stop, ring
from unbroken.core.records import WorkerError

REFUSAL_CHECK_S = 0.1  # how often a worker waiting for its first epoch looks whether it was refused
EPOCH_POLL_S = 0.005  # how often the first-epoch wait reads the epoch's number


@dataclass
class Epoch:
    epoch: int
    members: tuple[int, ...]
    reason: str
    reform: bool = False  # every member of the previous epoch must abandon its group (a collective stalled)
    workload: str = ""  # the workload policy from this epoch on, when not the config's (recovery.slow = rebalance)


class JobKeys:
    """Worker ``worker_id``'s reads and writes of the job's keys. ``held``: the store that waits for a coordinator
    that replaces a dead one; ``current``: the connection now (a call on it fails when the coordinator does)."""

    def __init__(self, held: Any, current: Callable[[], TCPStore], worker_id: int) -> None:
        self._held = held
        self._current = current
        self.worker_id = worker_id

    def config_toml(self) -> str:
        return self._held.get(keys.CONFIG).decode()

    def run_dir(self) -> Path:
        return Path(self._held.get(keys.RUN_DIR).decode())

    def current_epoch(self) -> int:
        return int(self._held.get(keys.EPOCH))

    def epoch_record(self, epoch: int) -> Epoch:
        record = json.loads(self._held.get(keys.epoch(epoch)).decode())
        reform, workload = bool(record.get("reform")), str(record.get("workload", ""))
        return Epoch(record["epoch"], tuple(record["members"]), record["reason"], reform, workload)

    def stop_reason(self) -> str | None:
        if self._held.check([keys.STOP]):
            return self._held.get(keys.STOP).decode()
        return None

    def refusal(self) -> str | None:
        """Why the coordinator keeps this worker out of the membership (``Refused``), or None."""
        key = keys.refused(self.worker_id)
        return self._held.get(key).decode() if self._held.check([key]) else None

    def wait_for_epoch(self, timeout_s: float, after: int, seen: Callable[[int], None]) -> Epoch | None:
        """Block (polling) until an epoch newer than ``after`` that includes this worker is published; ``seen`` is
        told of each newer epoch read (the watcher may not have seen it yet).

        None if the run stops, time runs out, or (for a worker that was a member) the newest epoch
        excludes it: it was declared dead and must not rejoin under its old state.
        """
        deadline = time.monotonic() + timeout_s
        refusal_checked = 0.0
        while time.monotonic() < deadline:
            if self.stop_reason() is not None:
                return None
            if time.monotonic() - refusal_checked > REFUSAL_CHECK_S:
                refusal_checked = time.monotonic()
                if self.refusal() is not None:
                    return None
            epoch = self.current_epoch()
            if epoch > after:
                seen(epoch)
                record = self.epoch_record(epoch)
                if self.worker_id in record.members:
                    return record
                if after > 0:
                    return None
            time.sleep(EPOCH_POLL_S)
        return None

    def done(self) -> bool:
        """Whether the run has finished (its leader said so)."""
        try:
            return bool(self._current().check([keys.DONE]))
        except RuntimeError:
            return False

    def mark_done(self) -> None:
        """The leader, after the final record: the run finished (the coordinator then ends)."""
        self._held.set(keys.DONE, "ok")
        ring(self._held)

    def stop_job(self, reason: str) -> bool:
        """Ask every process of the job to stop (a check that guards the training state failed); True if this
        call set the reason (the first of several members that saw the same thing)."""
        try:
            return request_stop(self._current(), reason)
        except RuntimeError:
            return False  # the coordinator is gone: nobody left to tell

    def report_error(self, error: WorkerError) -> bool:
        """This worker is dying of an exception: tell the coordinator, on this worker's own connection and without
        waiting for a coordinator that replaces a dead one (the process ends next). False if nobody was told."""
        try:
            report_error(self._current(), error)
            return True
        except RuntimeError:
            return False

    def named_to_save(self) -> bool:
        """The job stopped with a good state (a bug in the user's code) and the coordinator named this worker
        to save the state it holds (``keys.STOP_SAVER``)."""
        try:
            store = self._current()
            return store.check([keys.STOP_SAVER]) and int(store.get(keys.STOP_SAVER)) == self.worker_id
        except (RuntimeError, ValueError):
            return False

    def tell_saved(self, words: str) -> None:
        """The state is saved (or a newer checkpoint was already there): ``words`` name the last good one."""
        try:
            store = self._current()
            store.set(keys.STOP_SAVED, words)
            ring(store)
        except RuntimeError:
            pass  # the coordinator gave up waiting: it names the newest checkpoint on disk itself
