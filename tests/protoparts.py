"""One worker's protocol parts without a coordinator or peers: each collaborator of ``protocol.StepProtocol``
driven alone, in one thread, built from one ``StepContext`` (``step_context``) as the protocol builds them.

Every collective of a group of one is the identity (``comm``), so a real ``Membership`` on a group of one,
formed through its own ``form_next_group``, runs the same code as a member of a larger group. The coordinator
client is the one stand-in (``Client``): it hands out the epochs it is given and keeps what it is told.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unbroken.control.member.client import Epoch
from unbroken.core.config import RunConfig
from unbroken.ft.membership import Membership
from unbroken.ft.reduction import StepReduction
from unbroken.ft.sidevec import Reduced
from unbroken.ft.state import TrainingState
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.stepplan import StepPlan
from unbroken.ft.stops import ProtocolConfig

M = 4  # the microbatches of a step in these tests


class Client:
    """The coordinator client as the protocol's parts see it: the epochs it publishes (``epochs``), the run's
    stop (``stopped``), the workers removed, and the records and timeouts it is told of."""

    def __init__(self, worker_id: int = 0, epochs: tuple[Epoch, ...] = (Epoch(1, (0,), "start"),)) -> None:
        self.worker_id = worker_id
        self.epochs = epochs
        self.latest_epoch = max((e.epoch for e in epochs), default=0)
        self.stopped: str | None = None
        self.removed: set[int] = set()
        self.left = False  # a member left the group for a newer epoch
        self.refused: str | None = None
        self.reason: str | None = None
        self.current = 0
        self.published: list[dict[str, Any]] = []
        self.timeouts: list[int] = []
        self.forming: list[int] = []

    def new_connection(self) -> None:
        return None  # a group of one never touches the store

    def wait_for_epoch(self, timeout_s: float, after: int) -> Epoch | None:
        return next((e for e in self.epochs if e.epoch > after and self.worker_id in e.members), None)

    def announce_forming(self, epoch: int) -> None:
        self.forming.append(epoch)

    def removed_since(self, epoch: int, members: tuple[int, ...]) -> bool:
        return bool(self.removed & set(members))

    def left_for_newer(self, epoch: int, members: tuple[int, ...]) -> bool:
        return self.left

    def report_timeout(self, epoch: int) -> None:
        self.timeouts.append(epoch)

    def publish_metrics(self, record: dict[str, Any]) -> None:
        self.published.append(record)

    def refusal(self) -> str | None:
        return self.refused

    def stop_reason(self) -> str | None:
        return self.reason

    def current_epoch(self) -> int:
        return self.current

    def records(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.published if r["type"] == kind]


def protocol_config(**fields: Any) -> ProtocolConfig:
    """The default run's protocol settings with ``fields`` replaced (``M`` microbatches unless given)."""
    return replace(ProtocolConfig.of(RunConfig()), **{"microbatches": M, **fields})


def mlp_state(seed: int = 0) -> TrainingState:
    """A registered training state: a small MLP and its SGD optimizer, seeded."""
    torch.manual_seed(seed)
    state = TrainingState()
    state.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=0.1)
    return state


def step_context(
    cfg: ProtocolConfig, state: TrainingState, run_dir: Path, client: Client | None = None, **fields: Any
) -> StepContext:
    """The parts' shared facts: ``client`` (default: a ``Client`` of worker 0), no fault scheduled (the null
    hook), the CPU and gloo, a replica of one rank; ``fields``: any other ``StepContext`` field."""
    return StepContext(cfg, client if client is not None else Client(), state, run_dir, **fields)  # type: ignore[arg-type]


def joined(ctx: StepContext, formed: bool = True) -> Membership:
    """A real ``Membership`` of worker ``ctx.client.worker_id``; ``formed``: in the group of its first epoch."""
    members = Membership(ctx)
    if formed:
        members.form_next_group()
    return members


def member(
    cfg: ProtocolConfig, state: TrainingState, run_dir: Path, client: Client | None = None, formed: bool = True
) -> Membership:
    """``joined`` on the parts' default ``step_context``."""
    return joined(step_context(cfg, state, run_dir, client), formed)


def loss_of(model: nn.Module, microbatch: int) -> torch.Tensor:
    """Microbatch ``microbatch``'s loss, its data a pure function of the id."""
    gen = torch.Generator().manual_seed(microbatch)
    return nn.functional.mse_loss(model(torch.randn(16, 8, generator=gen)), torch.randn(16, 4, generator=gen))


class OneWorker:
    """The parts a step's reduction uses, for one worker alone: its membership, plan and reduction."""

    def __init__(self, run_dir: Path, cfg: ProtocolConfig, client: Client | None = None, seed: int = 0) -> None:
        self.state: TrainingState = mlp_state(seed)
        self.ctx = step_context(cfg, self.state, run_dir, client)
        self.membership = joined(self.ctx)
        self.plan = StepPlan(self.ctx)
        self.reduction = StepReduction(self.ctx, self.membership, self.plan)

    def compute(self, order: list[int], factors: dict[int, float] | None = None) -> None:
        """Begin the step and back-propagate the microbatches in ``order`` (their losses times ``factors``), as
        ``StepProtocol`` calls the parts."""
        model = self.state.model
        assert model is not None
        self.plan.begin()
        self.reduction.begin()
        for k, j in enumerate(order):
            if k == len(order) - 1:
                self.reduction.arm(j)
            self.reduction.before_backward(j)
            loss = loss_of(model, j) * (factors or {}).get(j, 1.0)
            (loss / M).backward()
            self.reduction.after_backward(j)
            self.plan.after_backward(j, loss.detach(), 16, None)

    def reduce(self) -> Reduced:
        reduced = self.reduction.reduce()
        self.reduction.check_invariants(reduced)
        return reduced

    def grads(self) -> list[torch.Tensor]:
        assert self.state.model is not None
        return [p.grad.clone() for p in self.state.model.parameters() if p.grad is not None]
