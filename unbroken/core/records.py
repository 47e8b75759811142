"""Metrics records: the format of ``RUN_DIR/metrics.jsonl`` and its one reader.

``RUN_DIR/metrics.jsonl`` holds one JSON object per line with a ``type`` (``step``, ``eval``, ``membership``,
``failure``, ``checkpoint``, ``final``, ``resume``, ...). The coordinator writes it; the launcher, the report,
the benchmarks, chaos and the tests read it through this module. Pure Python.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
