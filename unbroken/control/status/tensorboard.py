"""TensorBoard event files written while a run goes, one metrics record at a time (``LiveTensorBoard``).

Owns the mapping from metrics records to TensorBoard scalars and text, for a writer that stays open for the
whole run: the coordinator calls ``write`` for each record as it appends it to ``RUN_DIR/metrics.jsonl``,
so ``tensorboard --logdir RUN_DIR/tensorboard`` shows the run live. Events reach the files at least every
``flush_s`` (the writer's own background flush) and at once after a rare record (a failure, a membership
change, a recovery, a checkpoint, the end), so a failure is on disk when it happens. Each event carries its
record's time as wall time. ``NoTensorBoard`` is the null object for ``[metrics] tensorboard = false``.

Needs the ``tensorboard`` package (the ``tensorboard`` extra); torch's ``SummaryWriter`` writes the files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unbroken.core.records import RecordKind
from unbroken.core.runfacts import kind_of

TENSORBOARD_DIR = "tensorboard"
FLUSH_AT_ONCE = frozenset(
    {RecordKind.FAILURE, RecordKind.MEMBERSHIP, RecordKind.RECOVERY, RecordKind.CHECKPOINT, RecordKind.FINAL}
    | {RecordKind.STOPPED, RecordKind.STALL, RecordKind.COORDINATOR_LOST, RecordKind.RESUME}
)
EVENTS = frozenset(  # kinds written as a text event of their fields
    {RecordKind.FINAL, RecordKind.STOPPED, RecordKind.STALL, RecordKind.COORDINATOR_LOST, RecordKind.RESUME}
    | {RecordKind.RESTART, RecordKind.NONFINITE_SKIP}
)
STEP_SCALARS = {  # step record field -> tag
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "step_time_s": "train/step_time_s",
    "tokens_per_s": "train/tokens_per_s",
    "tokens_per_s_per_worker": "train/tokens_per_s_per_worker",
    "tokens_per_s_per_gpu": "train/tokens_per_s_per_gpu",  # GPU runs (NaN, so not written, on the CPU)
    "mfu": "train/mfu",
    "alive": "train/alive",
    "recomputed": "recovery/recomputed_microbatches",
    "dropped": "recovery/dropped_microbatches",
}
WORKER_SCALARS = {  # per-worker step record field -> tag prefix (one series per worker)
    "quotas": "workers/microbatches",
    "speeds": "workers/s_per_microbatch",
    "compute_s": "workers/compute_s",
}


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class LiveTensorBoard:
    """Appends TensorBoard events under ``RUN_DIR/tensorboard`` as records arrive; ``close()`` at the end.

    Args:
        run_dir: the run directory.
        flush_s: the longest an event waits in memory; 0 flushes after every record.

    Raises:
        ValueError: the tensorboard package is not installed.
    """

    enabled = True

    def __init__(self, run_dir: Path | str, flush_s: float = 2.0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional extra
            raise ValueError(f"metrics.tensorboard = true needs the tensorboard package: {e}") from None
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.flush_s = flush_s
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=max(1, math.ceil(flush_s)))
        self._step = 0  # the step in progress: where records without a step (a failure) are placed

    def write(self, record: Mapping[str, Any]) -> None:
        """Mirror one metrics record (kinds without a TensorBoard meaning are skipped)."""
        kind = kind_of(record)
        t = record.get("time") if _finite(record.get("time")) else time.time()
        w = self._writer
        if kind is RecordKind.STEP:
            step = int(record["step"])
            self._step = step + 1
            for field, tag in STEP_SCALARS.items():
                if _finite(record.get(field)):
                    w.add_scalar(tag, record[field], step, walltime=t)
            for field, prefix in WORKER_SCALARS.items():
                values = record.get(field)
                if isinstance(values, dict):
                    for wid, v in values.items():
                        if _finite(v):
                            w.add_scalar(f"{prefix}/{wid}", v, step, walltime=t)
        elif kind is RecordKind.EVAL:
            step = int(record["step"])
            for field, tag in (("val_loss", "val/loss"), ("val_ppl", "val/perplexity")):
                if _finite(record.get(field)):
                    w.add_scalar(tag, record[field], step, walltime=t)
        elif kind is RecordKind.CHECKPOINT:
            if _finite(record.get("seconds")):
                w.add_scalar("checkpoint/seconds", record["seconds"], int(record["step"]), walltime=t)
        elif kind is RecordKind.RECOVERY:
            step = int(record.get("step", self._step))
            if _finite(record.get("reform_s")):
                w.add_scalar("recovery/reform_s", record["reform_s"], step, walltime=t)
            w.add_text("events", f"group re-formed at step {step} (epoch {record.get('epoch')})", step, walltime=t)
        elif kind is RecordKind.FAILURE:
            if _finite(record.get("detection_s")):
                w.add_scalar("recovery/detection_s", record["detection_s"], self._step, walltime=t)
            w.add_text("events", f"worker {record.get('worker')} failed: {record.get('why')}", self._step, walltime=t)
        elif kind is RecordKind.MEMBERSHIP:
            members = record.get("members", [])
            w.add_scalar("membership/members", len(members), self._step, walltime=t)
            text = f"epoch {record.get('epoch')}: members {members} ({record.get('reason')})"
            w.add_text("events", text, self._step, walltime=t)
        elif kind is RecordKind.GOODPUT:
            step = int(record.get("step", self._step))
            for field, tag in (("tokens_per_s", "goodput/tokens_per_s"), ("ratio", "goodput/ratio")):
                if _finite(record.get(field)):
                    w.add_scalar(tag, record[field], step, walltime=t)
            for bucket, seconds in (record.get("buckets") or {}).items():
                if _finite(seconds):
                    w.add_scalar(f"badput_s/{bucket}", seconds, step, walltime=t)
        elif kind in EVENTS:
            fields = ", ".join(f"{k}={v}" for k, v in sorted(record.items()) if k not in ("type", "time", "checksums"))
            w.add_text("events", f"{kind}: {fields}", self._step, walltime=t)
        if self.flush_s <= 0 or kind in FLUSH_AT_ONCE:
            w.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> LiveTensorBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoTensorBoard:
    """TensorBoard off: every call does nothing."""

    enabled = False

    def write(self, record: Mapping[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_tensorboard(run_dir: Path | str, enabled: bool, flush_s: float = 2.0) -> LiveTensorBoard | NoTensorBoard:
    """``LiveTensorBoard`` when ``enabled`` (``[metrics] tensorboard``), else the null object."""
    return LiveTensorBoard(run_dir, flush_s) if enabled else NoTensorBoard()
