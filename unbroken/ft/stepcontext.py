"""What every part of one worker's step protocol shares, given once: ``StepContext``.

Owns ``StepContext``, the run's facts that the protocol (``protocol.StepProtocol``) and each of its parts
(``membership``, ``stepplan``, ``reduction``, ``update``, ``checkpoint.policy``) read and none of them changes:
the protocol's settings, the coordinator client, the training state, the run directory, the fault hook
(``inject.PhaseHook``: the null one when no fault is scheduled), the device and backend of the worker's
collectives, its replica (layout, and the ``Replica`` of a replica of several ranks), MeCeFO's ring, the run's
steps and the figures its step records' MFU is computed from. ``api.Context`` builds it when the worker joins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from unbroken.core.layout import ReplicaLayout
from unbroken.ft.inject import PhaseHook
from unbroken.ft.state import TrainingState
from unbroken.ft.stops import ProtocolConfig

if TYPE_CHECKING:
    from unbroken.control.member.client import CoordinatorClient
    from unbroken.ft.parallel.replica import Replica

CPU = torch.device("cpu")


@dataclass(frozen=True)
class StepContext:
    """One worker's step protocol's shared facts. ``layout``: its replica's (a replica of one rank: the default);
    ``replica``: the ``Replica`` of a replica of several ranks, else None. ``ring``: the configured workers in
    ring order (MeCeFO's neighbours). ``total``: the run's steps (the state after the last is the final
    checkpoint). ``flops_per_token`` / ``peak_tflops``: the model's training FLOPs per token and one device's
    peak TFLOP/s, for the step records' MFU (0: unknown)."""

    cfg: ProtocolConfig
    client: CoordinatorClient
    state: TrainingState
    run_dir: Path
    hook: PhaseHook = PhaseHook()
    device: torch.device = CPU
    backend: str = "gloo"
    layout: ReplicaLayout = ReplicaLayout()
    replica: Replica | None = None
    ring: tuple[int, ...] = (0,)
    total: int = 0
    flops_per_token: float = 0.0
    peak_tflops: float = 0.0

    @property
    def whole(self) -> bool:
        """This worker is a replica of one rank (a rank of a larger one plans, counts and commits with its
        replica-mates)."""
        return self.layout.size == 1
