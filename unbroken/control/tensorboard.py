"""TensorBoard event files mirroring a run's metrics records (optional: needs the tensorboard package)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
