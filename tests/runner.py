"""Helpers shared by the tests that launch real training jobs (``unbroken train`` as a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from unbroken.ft import checkpoint as ckpt

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.toml")


def train_cmd(cache: Path, *args: str, workers: int = 4) -> list[str]:
    """``unbroken train ARGS --workers N --quiet`` with the session's data cache (give TINY or --resume)."""
    return [
        sys.executable,
        "-m",
        "unbroken",
        "train",
        *args,
        "--workers",
        str(workers),
        "--quiet",
        f"--data.cache_dir={cache}",
    ]


def train(out: Path, cache: Path, *overrides: str, workers: int = 4) -> subprocess.CompletedProcess[str]:
    """``unbroken train configs/tiny.toml`` with ``workers`` worker processes into ``out``."""
    cmd = train_cmd(cache, TINY, "--out", str(out), *overrides, workers=workers)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model parameters of the run's newest good checkpoint."""
    loaded = ckpt.load_latest(run_dir)
    assert loaded is not None
    return loaded.state["model"]
