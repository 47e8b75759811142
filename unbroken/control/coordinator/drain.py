"""The coordinator's metrics drain: the records the workers publish in the store (``keys.metrics(n)``, numbered by
``keys.METRICS_SEQ``) appended in sequence order to ``RUN_DIR/metrics.jsonl`` and handed to the live sinks.

Owns the sinks every record reaches (``open_sinks``: the file, the status page's ``RunView``, TensorBoard, the
goodput account, the alerts), the order of the file (a number taken whose record never came holds the queue for
``METRIC_HOLE_GRACE_S``, then is passed over and taken late if it comes), the drop of a line a worker sends again
to a new coordinator (the newest ``RECENT_LINES`` identities, seeded from the file's tail), and the newest
committed step the records show (``MetricsDrain.committed_step``).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path
from typing import Any

from unbroken.control.status.alerts import Alerter
from unbroken.control.status.model import GoodputRecorder, MetricsTee, RunView
from unbroken.control.status.tensorboard import open_tensorboard
from unbroken.control.store import keys
from unbroken.control.store.connect import get_int
from unbroken.core.config import RunConfig
from unbroken.core.records import METRICS_FILE, MetricsFile, RecordKind, decode, line_identity

log = logging.getLogger(__name__)

RECENT_LINES = 4096  # metrics lines remembered (their ``line_identity``), to drop one a worker sends again
METRIC_HOLE_GRACE_S = 1.0  # a metrics number not written after this long: its writer died (or is stopped)
METRIC_HOLE_FORGET_S = 600.0  # ... and after this long it is not looked for any more


def open_sinks(cfg: RunConfig, run_dir: Path, view: RunView, records: list[dict[str, Any]]) -> MetricsTee:
    """metrics.jsonl with every live sink attached: ``view``, TensorBoard (``metrics.tensorboard``), the goodput
    account (``records``: the run's so far) and the alerts when configured."""
    tensorboard = open_tensorboard(run_dir, cfg.metrics.tensorboard)
    tee = MetricsTee(MetricsFile(run_dir), view, tensorboard)
    tee.sinks.append(GoodputRecorder(tee, cfg.metrics.goodput_every, records))
    alerter = Alerter(cfg.metrics, str(run_dir))
    if alerter.enabled:
        tee.sinks.append(alerter)
    return tee


def tail_lines(path: Path, nbytes: int = 2**20) -> list[str]:
    """The complete lines among the last ``nbytes`` of ``path`` (none if it does not exist)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - nbytes))
        lines = f.read().decode(errors="replace").splitlines()
    return lines[1:] if size > nbytes else lines


class MetricsDrain:
    """Takes the workers' records out of ``store`` into ``tee`` (the file and the sinks), in sequence order."""

    def __init__(self, store: Any, tee: MetricsTee, run_dir: Path, committed_step: int = -1) -> None:
        self.store = store
        self.tee = tee
        self.committed_step = committed_step  # the newest step a (not skipped) step record says was committed
        self.next_metric = 1
        self.hole_since: dict[int, float] = {}  # metrics numbers taken but not written yet -> first seen so
        self.passed_holes: dict[int, float] = {}  # ... and those passed over -> when
        self.recent_lines: collections.deque[str] = collections.deque(maxlen=RECENT_LINES)
        self.recent_set: set[str] = set()
        for line in tail_lines(run_dir / METRICS_FILE):
            self._remember(line_identity(line))

    def drain(self, seq: int | None = None, final: bool = False) -> None:
        """Append the queued records in sequence order (``seq``: the sequence's value, read now if not given). A
        writer takes its number (``add``) and then writes the record (``set``): one killed in between leaves a
        number that never fills. Such a hole holds the queue for ``METRIC_HOLE_GRACE_S`` (a live writer fills it
        in microseconds, and waiting keeps the file in order), then is passed over and looked at again on every
        pass, so a writer that was only stopped still gets its record in, late; ``final`` (the run is over)
        passes every hole at once."""
        if seq is None:
            seq = get_int(self.store, keys.METRICS_SEQ)
        now = time.monotonic()
        for hole, since in list(self.passed_holes.items()):
            if self.store.check([keys.metrics(hole)]):
                self._append(keys.metrics(hole))
                del self.passed_holes[hole]
            elif now - since > METRIC_HOLE_FORGET_S:
                del self.passed_holes[hole]
        while self.next_metric <= seq:
            key = keys.metrics(self.next_metric)
            if not self.store.check([key]):
                since = self.hole_since.setdefault(self.next_metric, now)
                if not final and now - since < METRIC_HOLE_GRACE_S:
                    break
                log.warning("metrics record %d was never written (its writer died?); going on without it",
                            self.next_metric)  # fmt: skip
                self.passed_holes[self.next_metric] = now
            else:
                self._append(key)
            self.hole_since.pop(self.next_metric, None)
            self.next_metric += 1

    def _append(self, key: str) -> None:
        line = self.store.get(key).decode()
        record = decode(line)  # once: the dedup, the file, the live views and the committed step all take it
        identity = line_identity(line, record)
        if identity not in self.recent_set:  # a worker sends its recent records again to a new coordinator
            self.tee.write_line(line, record)
            self._remember(identity)
            if record is not None and record["type"] == RecordKind.STEP and not record.get("skipped"):
                self.committed_step = max(self.committed_step, int(record["step"]))
        self.store.delete_key(key)

    def _remember(self, line: str) -> None:
        if len(self.recent_lines) == self.recent_lines.maxlen:
            self.recent_set.discard(self.recent_lines[0])
        self.recent_lines.append(line)
        self.recent_set.add(line)
