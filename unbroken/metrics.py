"""Logging and metrics: a rank-stamped logger, the one-line step format, and reading/writing run metrics.

Owns the metrics file format: ``RUN_DIR/metrics.jsonl`` holds one JSON object per line with a ``type``
(``step``, ``eval``, ``membership``, ``failure``, ``checkpoint``, ``final``, ``resume``). The coordinator
writes it; the launcher, the report and the tests read it. TensorBoard is optional and imported lazily.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def init_logger(prefix: str, level: int = logging.INFO) -> None:
    """Configure the root logger once per process: ``[prefix] time LEVEL message`` on stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{prefix}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """All records of ``RUN_DIR/metrics.jsonl`` (of one ``type`` if given); a torn last line is ignored."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or record.get("type") == kind:
            records.append(record)
    return records


def committed_steps(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> the record of its commit, in step order. A step repeated after a restart or resume keeps its
    last record; a record re-published by a new leader (``republished``: no timing, the original was lost
    with the old leader or never written because the leader was cut off) only fills a step otherwise missing."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("type") != "step" or (r.get("republished") and r["step"] in by_step):
            continue
        by_step[r["step"]] = r
    return {s: by_step[s] for s in sorted(by_step)}


def step_losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss; when a resumed run repeated a step, the last record wins."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "step")}


def format_step(record: dict[str, Any], total_steps: int) -> str:
    """The one-line step summary: ``step 120/200 | loss 4.1234 | lr 3.0e-04 | 812 ms | 40,210 tok/s | alive 4``."""
    return (
        f"step {record['step'] + 1}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.1e} | "
        f"{record['step_time_s'] * 1000:.0f} ms | {record['tokens_per_s']:,.0f} tok/s | "
        f"alive {record['alive']}"
    )


def write_tensorboard(run_dir: Path, records: Iterable[dict[str, Any]]) -> None:
    """Mirror step and eval records into TensorBoard event files under ``RUN_DIR/tensorboard``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard is an optional extra
        raise ValueError(f"metrics.tensorboard = true needs the tensorboard package: {e}") from None
    writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
    try:
        for r in records:
            if r.get("type") == "step":
                writer.add_scalar("train/loss", r["loss"], r["step"])
                writer.add_scalar("train/lr", r["lr"], r["step"])
                writer.add_scalar("train/tokens_per_s", r["tokens_per_s"], r["step"])
                writer.add_scalar("train/alive", r["alive"], r["step"])
            elif r.get("type") == "eval":
                writer.add_scalar("val/loss", r["val_loss"], r["step"])
                writer.add_scalar("val/perplexity", r["val_ppl"], r["step"])
    finally:
        writer.close()
