"""Checkpoints: the schema of the training state, its encoding, and atomic, verified files on disk.

Owns the one format the training state has wherever it goes: a checkpoint file, and the bytes a live member
sends a rejoining worker (``encode`` / ``decode``). The schema (``FORMAT_VERSION`` 2), built by
``build_state`` and checked by ``validate_state``, nowhere else:

    format      2
    step        the next step to run (the state after committing step - 1)
    model       the registered model's ``state_dict()``
    optimizer   the registered optimizer's ``state_dict()`` (or None)
    extra       {name: state} of the other registered objects
    ft          the library's replicated state: the exact mode's scale, agreed speeds, the run of
                consecutive non-finite skips, the last step's outcome, MeCeFO's projection bases
    metadata    {name: str | int | float | bool} the user attached (the trainer: config, tokenizer hash, ...)

On disk a checkpoint is the pair ``checkpoints/step_<N>.pt`` (``encode``) and its manifest, written atomically
by ``core.ckptfiles`` (the file layout, pure Python). Loading uses ``weights_only=True``; a corrupt or partial
checkpoint is reported and the previous good one is used.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unbroken.core import ckptfiles as files

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
STATE_KEYS = ("format", "step", "model", "optimizer", "extra", "ft", "metadata")


def build_state(
    step: int,
    model: dict[str, Any],
    optimizer: dict[str, Any] | None,
    extra: dict[str, Any],
    ft: dict[str, Any],
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """The training state in the checkpoint schema (see the module docstring)."""
    state = {
        "format": FORMAT_VERSION,
        "step": step,
        "model": model,
        "optimizer": optimizer,
        "extra": extra,
        "ft": ft,
        "metadata": metadata,
    }
    validate_state(state)
    return state


def validate_state(state: Any) -> None:
    """ValueError (one line) unless ``state`` is in the checkpoint schema."""
    if not isinstance(state, dict):
        raise ValueError("does not hold a state dict")
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"has format {state.get('format')!r}; this version reads format {FORMAT_VERSION}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}")
    if not isinstance(state["step"], int) or state["step"] < 0:
        raise ValueError(f"has step {state['step']!r}, not an integer >= 0")
    for key in ("model", "extra", "ft", "metadata"):
        if not isinstance(state[key], dict):
            raise ValueError(f"has {key} of type {type(state[key]).__name__}, not a dict")


def encode(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> dict[str, Any]:
    """The state in ``data`` (``encode``'s output), loaded with ``weights_only``; ValueError if it is not one."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "not a usable state"
        raise ValueError(f"cannot be loaded ({type(e).__name__}: {e})") from None
    validate_state(state)
    return state


@dataclass(frozen=True)
class LoadedCheckpoint:
    step: int
    path: Path
    state: dict[str, Any]
    skipped: tuple[str, ...]  # one line per newer checkpoint that was rejected, and why


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], keep: int, midway: Callable[[], None] | None = None
) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the ``keep`` newest ones.

    ``midway`` (failure injection) is called with half of the data file written."""
    validate_state(state)
    return files.write_checkpoint_files(run_dir, step, encode(state), keep, midway)


def verify(run_dir: Path, step: int) -> dict[str, Any]:
    """The state of the checkpoint of ``step`` after verifying it (manifest, checksum, schema, step);
    ValueError (one line) if it does not verify."""
    data = files.read_verified(run_dir, step)
    name = files.checkpoint_path(run_dir, step).name
    try:
        state = decode(data)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None
    if state["step"] != step:
        raise ValueError(f"{name} holds step {state['step']}, its manifest says {step}")
    return state


def load_latest(run_dir: Path, log_rejections: bool = True) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies; newer ones that fail are skipped (and logged). None if none."""
    skipped: list[str] = []
    for step in files.list_checkpoints(run_dir):
        try:
            state = verify(run_dir, step)
        except ValueError as e:
            if log_rejections:
                log.warning("checkpoint of step %d rejected: %s; trying the previous one", step, e)
            skipped.append(f"step {step}: {e}")
            continue
        return LoadedCheckpoint(step, files.checkpoint_path(run_dir, step), state, tuple(skipped))
    for line in skipped if log_rejections else []:
        log.warning("no usable checkpoint: %s", line)
    return None


def verify_all(run_dir: Path) -> tuple[list[str], list[Path]]:
    """Every checkpoint that has a manifest must verify: (one line per one that does not, leftover files
    of interrupted saves: temporary files and data files without a manifest, which loading ignores)."""
    problems: list[str] = []
    for step in sorted(files.list_checkpoints(run_dir)):
        try:
            verify(run_dir, step)
        except ValueError as e:
            problems.append(f"step_{step:08d}: {e}")
    return problems, files.leftovers(run_dir)


# Re-exported: the file layout is core.ckptfiles's.
checkpoint_dir = files.checkpoint_dir
checkpoint_path = files.checkpoint_path
list_checkpoints = files.list_checkpoints
clean_partial = files.clean_partial
