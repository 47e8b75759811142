"""The training state every replica holds identically: what the user registered and the library's own part.

Owns ``TrainingState``: the registered model, optimizer and extra objects, the metadata, and the library's
replicated state (the next step, the exact mode's scale, the agreed per-worker speeds, the run of
consecutive non-finite skips, the last step's outcome, MeCeFO's bases). ``snapshot()`` is the state in
the checkpoint schema (``checkpoint.build_state``), used both for checkpoints and for the bytes a live
member sends a rejoining one; ``restore()`` is its inverse; ``checksum()`` fingerprints the parameters,
``start_digest()`` everything a run starts from (parameters, buffers, optimizer state).

A rank of a replica of several ranks holds its part of the model and optimizer (FSDP shards as ``DTensor``s,
or a pipeline stage): its snapshot holds the local tensors, and restoring one writes them back into the local
shards, so a rejoining rank receives its shard of the state from the rank of the same index in a live
replica, never the whole model.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.comm import is_dtensor, local_tensor
from unbroken.ft.exact import FixedPointScale
from unbroken.ft.mecefo import EfficientBackward


@dataclass
class StepOutcome:
    """What one committed (or skipped) step did, as every member saw it."""

    loss: float = math.nan
    grad_norm: float = math.nan
    lr: float = math.nan
    recomputed: int = 0  # microbatches recomputed by survivors because their first owner died
    dropped: int = 0  # microbatches skipped (``drop`` policy)
    recoveries: int = 0  # group re-formations during the step
    efficient: int = 0  # microbatches computed in MeCeFO's efficient mode
    overflow_redos: int = 0  # exact mode: the step was redone this many times with a larger fixed-point scale
    skipped: bool = False  # a non-finite gradient: no optimizer step


def param_checksum(model: nn.Module) -> str:
    """sha256 over the bytes of every parameter, in order: equal iff the parameters are bitwise equal (under
    FSDP: this rank's shards, the same however its replica last ran a forward)."""
    reshard(model)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(_tensor_bytes(p))
    return digest.hexdigest()


def reshard(model: nn.Module) -> None:
    """Give every FSDP unit of ``model`` its sharded parameters back. FSDP2 leaves the root unit's parameters
    unsharded after a forward without backward (an evaluation), so ``model.parameters()`` would then list whole
    tensors on one replica and shards on another."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: no FSDP unit can exist
    if fsdp is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def local_state(state: Any) -> Any:
    """``state`` (a state dict, nested) with every ``DTensor`` replaced by its local shard."""
    if is_dtensor(state):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_state(v) for v in state)
    return state


@torch.no_grad()
def _restore_local_model(model: nn.Module, theirs: dict[str, Any]) -> None:
    for name, tensor in model.state_dict().items():
        local_tensor(tensor).copy_(theirs[name])


def _restore_local_optimizer(optimizer: torch.optim.Optimizer, theirs: dict[str, Any]) -> None:
    """Load an optimizer state whose tensors are local shards, then give sharded parameters' state back its
    ``DTensor`` form (as the optimizer created it)."""
    optimizer.load_state_dict(theirs)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not is_dtensor(p) or p not in optimizer.state:
                continue
            from torch.distributed.tensor import DTensor

            shard = p.to_local()
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.shape == shard.shape:
                    optimizer.state[p][key] = DTensor.from_local(
                        value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def _load_into(name: str, obj: Any, state: Any) -> None:
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif isinstance(obj, dict) and isinstance(state, dict):
        obj.clear()
        obj.update(state)
    else:
        raise TypeError(f"registered state {name!r} has neither load_state_dict() nor is a dict")


class TrainingState:
    """Everything a rejoining worker receives and a checkpoint holds."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.extra: dict[str, Any] = {}
        self.metadata: dict[str, Any] = {}
        self.step = 0
        self.speeds: dict[int, float] = {}  # agreed seconds per microbatch of each worker (throughput workload)
        self.nonfinite_streak = 0  # consecutive steps skipped for a non-finite gradient
        self.last = StepOutcome()
        self.scale: FixedPointScale | None = None  # exact mode only
        self.efficient: EfficientBackward | None = None  # MeCeFO policies only

    def snapshot(self, local: bool = False) -> dict[str, Any]:
        """The state in the checkpoint schema (tensors are the live ones: encode it before changing them);
        ``local``: sharded tensors as this rank's shards (what a rank of the same index in another replica
        restores with ``restore(..., local=True)``)."""
        assert self.model is not None, "register_state(model=...) first"
        ft = {
            "scale": self.scale.state_dict() if self.scale is not None else None,
            "speeds": {str(w): s for w, s in self.speeds.items()},
            "nonfinite_streak": self.nonfinite_streak,
            "last": asdict(self.last),
            "mecefo_bases": self.efficient.bases() if self.efficient is not None else None,
            "mecefo_bases_step": self.efficient.bases_step if self.efficient is not None else None,
        }
        state = ckpt.build_state(
            self.step,
            self.model.state_dict(),
            self.optimizer.state_dict() if self.optimizer is not None else None,
            {name: _state_of(obj) for name, obj in self.extra.items()},
            ft,
            dict(self.metadata),
        )
        return local_state(state) if local else state

    def restore(self, state: dict[str, Any], local: bool = False, tensors: bool = True) -> None:
        """Load ``state`` (the checkpoint schema, validated) into the registered objects and the library's part.

        Raises:
            ValueError: it does not fit what is registered (another model shape, other objects, another M).
        """
        assert self.model is not None
        ckpt.validate_state(state)
        if not tensors:  # the model and optimizer were loaded already (a sharded checkpoint's, through DCP)
            self._load_bases(state["ft"])
            self._restore_rest(state)
            return
        own = local_state(self.model.state_dict()) if local else self.model.state_dict()
        theirs = state["model"]
        mismatch = sorted(k for k in own.keys() | theirs.keys() if k not in own or k not in theirs)
        mismatch += sorted(k for k in own.keys() & theirs.keys() if tuple(own[k].shape) != tuple(theirs[k].shape))
        if mismatch:
            raise ValueError(f"the state is for a different model (first mismatch: {mismatch[0]})")
        if set(state["extra"]) != set(self.extra):
            raise ValueError(f"the state holds {sorted(state['extra'])}, this worker registered {sorted(self.extra)}")
        ft = state["ft"]
        self._load_bases(ft)  # first: drops a basis computation that would read the weights loaded below
        if local:
            _restore_local_model(self.model, theirs)
        else:
            self.model.load_state_dict(theirs)
        if self.optimizer is not None and state["optimizer"] is not None:
            if local:
                _restore_local_optimizer(self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        self._restore_rest(state)

    def _load_bases(self, ft: dict[str, Any]) -> None:
        """MeCeFO's bases: a list in a one-file state, by weight name in a sharded checkpoint (``checkpoint``)."""
        if self.efficient is None:
            return
        bases, step = ft.get("mecefo_bases"), ft.get("mecefo_bases_step")
        if isinstance(bases, dict):
            self.efficient.load_named_bases(bases, step)
        else:
            self.efficient.load_bases(bases or [], step)

    def _restore_rest(self, state: dict[str, Any]) -> None:
        """Everything but the model and the optimizer: extra objects and the library's replicated state."""
        if set(state["extra"]) != set(self.extra):
            raise ValueError(f"the state holds {sorted(state['extra'])}, this worker registered {sorted(self.extra)}")
        ft = state["ft"]
        for name, obj in self.extra.items():
            _load_into(name, obj, state["extra"][name])
        if self.scale is not None:
            if ft["scale"] is None:
                raise ValueError("the state was saved without exact reduction; it has no fixed-point scale")
            self.scale.load_state_dict(ft["scale"])
        self.speeds = {int(w): float(s) for w, s in ft["speeds"].items()}
        self.nonfinite_streak = int(ft["nonfinite_streak"])
        self.last = StepOutcome(**ft["last"])
        self.step = state["step"]

    def checksum(self) -> str:
        assert self.model is not None
        return param_checksum(self.model)

    def start_digest(self) -> bytes:
        """sha256 over what a run starts from: the model's parameters and buffers, the optimizer's state tensors
        and its groups' settings, in order (a rank of a replica: its shards). Equal on two members iff they would
        train the same run from here."""
        assert self.model is not None
        reshard(self.model)
        digest = hashlib.sha256()
        for name, tensor in self.model.state_dict().items():
            digest.update(name.encode())
            digest.update(_tensor_bytes(tensor))
        if self.optimizer is not None:
            opt = self.optimizer.state_dict()
            for group in opt["param_groups"]:
                digest.update(repr(sorted((k, v) for k, v in group.items() if k != "params")).encode())
            for index in sorted(opt["state"]):
                for key, value in sorted(opt["state"][index].items()):
                    digest.update(f"{index}.{key}".encode())
                    digest.update(_tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
        return digest.digest()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return local_tensor(tensor.detach()).cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
