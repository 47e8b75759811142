"""Process logging: one stamped format for every process of a job (coordinator, launcher, workers)."""

from __future__ import annotations

import logging
import sys


def init_logger(prefix: str, level: int = logging.INFO) -> None:
    """Configure the root logger once per process: ``[prefix] time LEVEL message`` on stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{prefix}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
