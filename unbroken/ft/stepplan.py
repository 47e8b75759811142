"""A step's plan and this worker's accounting of it: which microbatch ids it computes, what it has computed.

Owns the current step's assignment as this worker sees it (``make``: the same on every member; the ids each
member was given, each member's quota, the ids this worker runs in MeCeFO's efficient mode, the data
check's probe), this worker's local record of the step (the ids it computed, their losses and tokens, its
seconds per microbatch) and the step's counters that its record reports (recoveries, recomputed ids,
overflow redos). It runs no collective and knows no group: the caller gives it the members as the planner
sees them (``Membership.units``) and the epoch; the run's facts are the step's ``StepContext``.
"""

from __future__ import annotations

import torch

from unbroken.core.config import RecoveryPolicy
from unbroken.core.plan import Assignment, mecefo_plan, plan_ids
from unbroken.ft import datacheck
from unbroken.ft.stepcontext import StepContext


class StepPlan:
    """The plan of the current step and this worker's part of it. A rank of a replica of several ranks (not
    ``ctx.whole``) counts its ids by rounds (``round_done``) and probes no data; ``ctx.ring`` is MeCeFO's."""

    def __init__(self, ctx: StepContext) -> None:
        self.cfg = cfg = ctx.cfg
        self.M = cfg.microbatches
        self.state = ctx.state
        self.ring = ctx.ring
        self.whole = ctx.whole
        self.efficient_ids: frozenset[int] = frozenset()
        self.quotas: dict[int, int] = {}
        self.my_speed = 0.0
        self.workload = cfg.workload  # the current epoch's (a coordinator may switch it: recovery.slow = rebalance)
        # The data check (``datacheck``): this step's probe, if any, and the fingerprints this worker computed
        # for it ([0] as the microbatch's computer, [1] as the prober); one probe per membership epoch.
        self.probe: datacheck.Probe | None = None
        self.probe_fps = [0.0, 0.0]
        self.probed_epoch = -1
        self.begin()
        self.recoveries = self.redos = 0
        self.recomputed = 0

    def begin(self) -> None:
        """Fresh local accounting for the current step: no microbatch done."""
        self.done: list[int] = []
        self.done_efficient: list[int] = []
        self.local_losses: dict[int, float | torch.Tensor] = {}
        self.local_tokens: dict[int, int] = {}
        self.step_owners: dict[int, int] = {}  # microbatch id -> the member the step's plan gave it to

    def reset_counts(self) -> None:
        """The step starts: no recovery, recomputed id or overflow redo yet."""
        self.recoveries = self.recomputed = self.redos = 0

    def make(self, members: tuple[int, ...], todo: list[int] | None = None) -> Assignment:
        """The assignment of ``todo`` (default: all M ids) of the current step over ``members`` (as the planner
        sees them: workers, or their replicas); every member computes the same one. Sets the ids this worker
        runs in efficient mode (MeCeFO)."""
        if self.cfg.policy.mecefo:
            ring = sorted(set(self.ring) | set(members))
            spread = self.cfg.policy is RecoveryPolicy.MECEFO_SPREAD
            plan = mecefo_plan(self.state.step, ring, members, self.M, todo, spread=spread)
        else:
            ids = range(self.M) if todo is None else todo
            plan = plan_ids(self.state.step, members, ids, self.M, self.workload, self.state.speeds)
        self.efficient_ids = plan.efficient
        eb = self.state.efficient
        if eb is not None:
            # Every member sees the same plan, so the same `needed`: the bases of a tau-window come from the
            # weights of its first step with an efficient microbatch anywhere (none while nobody is down),
            # computed by every member in the background; a joiner receives them, with their step, in the state.
            eb.refresh(self.state.step, needed=bool(plan.efficient))
        return plan

    def note_owners(self, plan: Assignment) -> None:
        """The member each id of the step was given to (under ``drop``, a survivor still owes its own)."""
        self.step_owners = {j: w for w, ids in plan.ids.items() for j in ids}

    def adopt(self, plan: Assignment, epoch: int) -> None:
        """A step planned afresh (all M ids) in membership epoch ``epoch``: its owners, each member's quota,
        and its data check's probe, at the first such step of each epoch."""
        self.note_owners(plan)
        self.quotas = {w: len(ids) for w, ids in plan.ids.items()}
        self.probe, self.probe_fps = None, [0.0, 0.0]
        if self.whole and self.probed_epoch != epoch:
            self.probed_epoch = epoch
            self.probe = datacheck.choose_probe(plan)

    def is_efficient(self, microbatch: int) -> bool:
        return microbatch in self.efficient_ids

    def after_backward(self, microbatch: int, loss: float | torch.Tensor, tokens: int, seconds: float | None) -> None:
        """Record microbatch ``microbatch`` as computed by this worker. ``loss`` may stay a tensor on the device
        (read back with the step's others, ``loss_values``); ``seconds`` is None where the microbatch's time
        is not known alone (a GPU: ``note_speed`` per round)."""
        self.local_losses[microbatch] = loss
        self.local_tokens[microbatch] = tokens
        if self.whole:
            self.done.append(microbatch)
        if microbatch in self.efficient_ids:
            self.done_efficient.append(microbatch)
        if seconds is not None:
            self.note_speed(seconds)

    def note_speed(self, seconds: float) -> None:
        """This worker computed a microbatch in ``seconds`` (a moving average: the planner's speeds)."""
        self.my_speed = seconds if self.my_speed == 0 else 0.5 * self.my_speed + 0.5 * seconds

    def loss_values(self) -> dict[int, float]:
        """The local microbatches' losses as numbers: those still on the device read back in one transfer."""
        on_device = {j: v for j, v in self.local_losses.items() if isinstance(v, torch.Tensor)}
        if on_device:
            values = torch.stack([v.float().reshape(()) for v in on_device.values()]).tolist()
            self.local_losses.update(zip(on_device, values, strict=True))
        return {j: float(v) for j, v in self.local_losses.items()}

    def round_done(self, microbatches: list[int], seconds: float = 0.0) -> None:
        """A replica of several ranks: ``microbatches`` are in every rank's accumulator now (an FSDP round's
        reduce-scatter ended, or a pipelined batch went through every stage); ``seconds`` per microbatch."""
        self.done.extend(microbatches)
        if seconds > 0:
            self.note_speed(seconds)

    def pipelined(self, losses: dict[int, float], tokens: dict[int, int]) -> None:
        """A pipeline's last stage: the losses (and tokens) of the microbatches it ran, and which of them ran in
        efficient mode (the last stage speaks for its replica's stages, as for the losses)."""
        self.local_losses.update(losses)
        self.local_tokens.update(tokens)
        self.done_efficient.extend(j for j in losses if j in self.efficient_ids)
