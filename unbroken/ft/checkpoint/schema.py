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
                consecutive non-finite skips, the last step's outcome, MeCeFO's projection bases (a list,
                block by block; in a sharded checkpoint {weight name: basis}, each rank's own, through DCP)
    metadata    {name: str | int | float | bool} the user attached (the trainer: config, tokenizer hash, ...)

On disk a checkpoint is the pair ``checkpoints/step_<N>.pt`` (``encode``) and its manifest, written atomically
by ``core.ckptfiles`` (the file layout, pure Python). Loading uses ``weights_only=True``; a corrupt or partial
checkpoint is reported and the previous good one is used.

A replica of several ranks writes a *sharded* checkpoint with ``torch.distributed.checkpoint`` (DCP) instead
(``save_sharded``). Every replica holds the same state, so the group's leading replica writes it: each of its
ranks saves its shard (FSDP) or its stage's tensors (pipelining), keyed by the whole model's parameter names,
into ``checkpoints/step_<N>.dcp.<tag>.tmp/``; its first rank adds ``ft.pt``, the rest of the state in this
schema (with an empty model and no optimizer: DCP holds them) and seals the directory
(``core.ckptfiles.seal_directory``: fsynced, renamed into place, then a manifest of every file's size and
sha256), so it too is complete and verifiable or ignored. DCP reshards on load: ``load_sharded`` reads it into
the live objects of any number of replicas, another shard count or pipeline cut, or a whole model in one
process; ``verify`` returns its whole state with plain tensors (the model by parameter name, the optimizer
flattened by name: torch's ``get_state_dict`` / ``set_state_dict`` forms).
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unbroken.core import ckptfiles as files

if TYPE_CHECKING:
    from unbroken.ft.parallel.replica import Replica
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
    path: Path  # the file, or the directory of a sharded checkpoint
    state: dict[str, Any]  # the whole state (empty if a sharded checkpoint was only verified, not read)
    skipped: tuple[str, ...]  # one line per newer checkpoint that was rejected, and why
    sharded: bool = False


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], keep: int, midway: Callable[[], None] | None = None
) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the ``keep`` newest ones. The state streams
    to the file (torch's writer copies one tensor at a time to host memory), so a save needs no second copy of
    the state in memory: a GPU worker's host holds a model and its optimizer once, not twice.

    ``midway`` (failure injection) is called with about half of the data file written (half the tensors' bytes)."""
    validate_state(state)
    half = _tensor_bytes(state) // 2 if midway is not None else 0
    return files.write_checkpoint_stream(run_dir, step, lambda f: torch.save(state, f), keep, midway, half)


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def verify(run_dir: Path, step: int) -> dict[str, Any]:
    """The state of the checkpoint of ``step`` after verifying it (manifest, checksum, schema, step);
    ValueError (one line) if it does not verify."""
    if files.is_sharded(run_dir, step):
        directory = files.verify_directory(run_dir, step)
        name = directory.name
        state = read_sharded(directory)
    else:
        data = files.read_verified(run_dir, step)
        name = files.checkpoint_path(run_dir, step).name
        try:
            state = decode(data)
        except ValueError as e:
            raise ValueError(f"{name} {e}") from None
    if state["step"] != step:
        raise ValueError(f"{name} holds step {state['step']}, its manifest says {step}")
    return state


def check(run_dir: Path, step: int) -> None:
    """ValueError (one line) unless the checkpoint of ``step`` verifies: a file's checksum and schema, or a sharded
    checkpoint's every file's checksum and the schema of its replicated part (its tensors are not read)."""
    if files.is_sharded(run_dir, step):
        read_rest(files.verify_directory(run_dir, step))
    else:
        verify(run_dir, step)


def load_latest(run_dir: Path, log_rejections: bool = True, read_sharded: bool = True) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies; newer ones that fail are skipped (and logged). None if none.
    ``read_sharded`` False: a sharded checkpoint is only checked (``check``), its state left empty, for the
    caller to load into live objects (``load_sharded``)."""
    skipped: list[str] = []
    for step in files.list_checkpoints(run_dir):
        try:
            sharded = files.is_sharded(run_dir, step)
            if sharded and not read_sharded:
                check(run_dir, step)
                state: dict[str, Any] = {}
            else:
                state = verify(run_dir, step)
        except ValueError as e:
            if log_rejections:
                log.warning("checkpoint of step %d rejected: %s; trying the previous one", step, e)
            skipped.append(f"step {step}: {e}")
            continue
        path = files.sharded_path(run_dir, step) if sharded else files.checkpoint_path(run_dir, step)
        return LoadedCheckpoint(step, path, state, tuple(skipped), sharded)
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


REST_FILE = "ft.pt"  # the replicated rest of the state, in the checkpoint schema
# torch.distributed.checkpoint is imported where a sharded checkpoint is touched: it costs a worker about a second.


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)  # entries by parameter name: stages' are disjoint


BASES_KEY = "mecefo_bases"  # MeCeFO's bases in a sharded checkpoint, by weight name: a stage holds its blocks' only


def _tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, bases: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """The model's and the optimizer's state as DCP saves and loads it (live tensors, sharded as they are), and
    MeCeFO's bases when given."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_options())
    tensors: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd} if optimizers else {"model": model_sd}
    if bases:
        tensors[BASES_KEY] = bases
    return tensors


def save_sharded(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rest: dict[str, Any],
    replica: Replica,
    keep: int,
    midway: Callable[[], None] | None = None,
    bases: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Every rank of ``replica`` calls this: write the sharded checkpoint of ``step`` (``model`` and ``optimizer``
    through DCP, ``rest`` the state in the schema, its model and optimizer left out); returns its directory.
    ``bases``: this rank's MeCeFO bases by weight name (through DCP too: each stage's are its own).
    ``midway`` (failure injection) is called once every rank's files are written, before the seal."""
    import torch.distributed.checkpoint as dcp

    rest = {**rest, "model": {}, "optimizer": None, "ft": {**rest["ft"], "mecefo_bases": None}}
    validate_state(rest)
    temp = files.sharded_temp(run_dir, step, f"{replica.index}-{replica.incarnation}")
    if replica.rank == 0:
        files.clean_partial(run_dir)  # what a dead writer left (only this rank writes checkpoints' names)
        temp.mkdir(parents=True)
    replica.agree(True)  # the directory exists before anyone writes into it
    tensors = _tensors(model, optimizer, bases)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temp), process_group=replica.pg)
    if midway is not None:
        midway()
    if replica.rank == 0:
        files.write_atomic(temp / REST_FILE, encode(rest))
        files.seal_directory(run_dir, step, temp, keep)
    replica.agree(True)  # sealed: every rank returns with the checkpoint on disk
    return files.sharded_path(run_dir, step)


def load_sharded(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    replica: Replica | None,
    bases: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Load the sharded checkpoint in ``directory`` into ``model`` and ``optimizer``: the ranks of ``replica``
    together (each reads its part), or one process holding the whole model (``replica`` None). Returns the rest
    of the state (``ft.pt``, the schema with an empty model), which the caller restores. ``bases``: MeCeFO's,
    by weight name, to read the checkpoint's into (``EfficientBackward.empty_named_bases``); they are in the
    rest's ``ft`` then (None where the checkpoint has none: saved before any was computed, or without MeCeFO)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rest = read_rest(directory)
    if bases is not None and rest["ft"].get("mecefo_bases_step") is not None:
        # Read only bases that are there with these shapes (another mecefo.rank: none; the next needed refresh
        # computes them).
        saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        sizes = {name: tuple(getattr(saved.get(f"{BASES_KEY}.{name}"), "size", ())) for name in bases}
        if any(sizes[name] != tuple(t.shape) for name, t in bases.items()):
            bases = None
    else:
        bases = None
    tensors = _tensors(model, optimizer, bases)
    if replica is None:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    else:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(directory), process_group=replica.pg)
    optimizers = [optimizer] if optimizer is not None else []
    set_state_dict(
        model,
        optimizers,
        model_state_dict=tensors["model"],
        optim_state_dict=tensors.get("optimizer", {}),
        options=_options(),
    )
    rest["ft"]["mecefo_bases"] = tensors.get(BASES_KEY)
    return rest


def read_rest(directory: Path) -> dict[str, Any]:
    """The replicated rest of the state (``ft.pt``), validated against the checkpoint schema."""
    try:
        return decode((directory / REST_FILE).read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory.name}/{REST_FILE} {e}") from None


def read_sharded(directory: Path) -> dict[str, Any]:
    """The whole state of the checkpoint in ``directory``, in the checkpoint schema, with plain tensors: the
    model by parameter name, the optimizer flattened by name (no process group needed)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    rest = read_rest(directory)
    # torch's loader of every key, as its own dcp_to_torch_save does (private: the public converter writes a file);
    # in one process, on purpose (it warns that no process group exists)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        tensors = _load_state_dict_from_keys(checkpoint_id=str(directory))
    rest["model"] = tensors.get("model", {})
    rest["optimizer"] = tensors.get("optimizer")
    rest["ft"]["mecefo_bases"] = tensors.get(BASES_KEY)
    return rest


# Re-exported: the file layout is core.ckptfiles's.
checkpoint_dir = files.checkpoint_dir
checkpoint_path = files.checkpoint_path
list_checkpoints = files.list_checkpoints
clean_partial = files.clean_partial
sharded_path = files.sharded_path
