"""A worker's membership in the group of the current epoch: who it is in the group, how it waits on the
group's collectives, how it moves to the next epoch's group, and how whoever is behind receives the state.

Owns the current ``Group`` (and the ``GroupFormer`` that forms the next one ahead of need), this worker's
identity in it (its unit: itself, or its replica; the leader; the publisher of the group's records), the
waits on the group's collectives (``Interrupted`` when the membership changes under one), the agreement of
the ranks of a replica of several ranks on every such outcome, the state transfer on a new group
(``sync_state``), and the metrics records the group publishes (with the recent ones, for a coordinator that
dies undrained). It does not plan, reduce gradients or commit: ``protocol.StepProtocol`` decides when to
form the next group (a recovery) and what to do after. It is built from the step's ``StepContext`` and calls
its fault hook when a state is received (``receive`` phase).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch

from unbroken.control.member.client import Epoch
from unbroken.core.config import Reduction
from unbroken.core.failures import Phase
from unbroken.core.records import RecordKind, append_records, make
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.comm import (
    Group,
    GroupFormer,
    Pending,
    WaitStatus,
    abort_group,
    allreduce_async,
    broadcast_async,
    form_group,
    retire_group,
    wait_all,
)
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.stops import Interrupted, InvariantViolation, StopRun

log = logging.getLogger(__name__)

RECENT_RECORDS = 64  # metrics records a leader keeps, to write them itself if the coordinator dies


class Membership:
    """This worker in the current group. ``group`` is None until the first one forms (``form_next_group``);
    ``recovering`` is set by the protocol while it recovers (any newer epoch interrupts then)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.client = client = ctx.client
        self.state = ctx.state
        self.layout = ctx.layout
        self.replica = ctx.replica
        self.group: Group | None = None
        self.state_bytes = 0  # the state sent to members behind in the last recovery (one rank index's share)
        self.workload = ""  # the current epoch's workload when the coordinator switched it (else the config's)
        self.recovering = False
        self.start_checked = False  # the members' starting states were compared (``_one_start``)
        self.former = GroupFormer(
            client.new_connection,
            client.worker_id,
            ctx.backend,
            ctx.cfg.op_timeout_s,
            ctx.device,
            lambda epoch: client.latest_epoch > epoch or client.stopped is not None,
            self.coordinate,
        )
        # The records this worker published lately: written by itself if the coordinator dies undrained.
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RECORDS)

    # -- identity -----------------------------------------------------------------------------------
    @property
    def wid(self) -> int:
        return self.client.worker_id

    @property
    def unit(self) -> int:
        """What the planner plans for and the side vector counts: this worker, or its replica."""
        return self.layout.replica_of(self.wid)

    @property
    def coordinate(self) -> int | None:
        """This rank's index in its replica (its group's), or None for a replica of one rank."""
        return self.replica.rank if self.replica is not None else None

    def units(self) -> tuple[int, ...]:
        """The members of the current group as the planner sees them (workers, or their replicas)."""
        assert self.group is not None
        return tuple(self.layout.replica_of(w) for w in self.group.members)

    @property
    def leader(self) -> bool:
        """This worker is (a rank of) the group's first member: it writes checkpoints."""
        assert self.group is not None
        return self.group.rank == 0

    @property
    def publisher(self) -> bool:
        """This worker publishes the group's records (the leader; of a replica, its first rank)."""
        return self.group is not None and self.leader and (self.replica is None or self.replica.rank == 0)

    # -- inside the replica -------------------------------------------------------------------------
    def combine_max(self, tensor: torch.Tensor) -> None:
        """MAX-reduce ``tensor`` over the ranks of this worker's replica (nothing for a replica of one rank)."""
        if self.replica is not None:
            self.replica.all_reduce(tensor, torch.distributed.ReduceOp.MAX)

    def combine_sum(self, tensor: torch.Tensor) -> None:
        """SUM-reduce ``tensor`` over the ranks of this worker's replica (nothing for a replica of one rank)."""
        if self.replica is not None:
            self.replica.all_reduce(tensor)

    def agreed(self, ok: bool) -> bool:
        """``ok`` agreed over the ranks of this worker's replica (itself for a replica of one rank)."""
        return ok if self.replica is None else self.replica.agree(ok)

    # -- waiting on the group -----------------------------------------------------------------------
    def interrupted(self) -> bool:
        """True when a member of the current group was removed or its group must be re-formed (a newer epoch
        says so), or the run is being stopped (cached, cheap). A join does not interrupt: the group's
        collectives complete, and the joiner is taken in at the next step boundary."""
        assert self.group is not None
        group, client = self.group, self.client
        if client.stopped is not None or client.removed_since(group.epoch, group.members):
            return True
        if client.latest_epoch <= group.epoch:
            return False
        # While recovering, any newer epoch interrupts: members may skip an epoch that is already superseded,
        # so a collective on it might never be matched. A member that finished recovering just before the
        # others were interrupted is in the new group's collectives alone: it learns that a member has left
        # the group for a newer epoch (each says so before forming one) and follows.
        return self.recovering or client.left_for_newer(group.epoch, group.members)

    def wait(self, pending: list[Pending]) -> None:
        """Wait for ``pending``; Interrupted unless it completed (on every rank of the replica)."""
        status = wait_all(pending, self.cfg.op_timeout_s, self.interrupted)
        if status is WaitStatus.TIMED_OUT:
            self.report_timeout()
        if not self.agreed(bool(status)):
            raise Interrupted

    def report_timeout(self) -> None:
        """A collective of the current group timed out while nobody was removed: tell the coordinator, which
        sees every heartbeat and decides (retry with a fresh group, then exclude who stalls again)."""
        assert self.group is not None
        self.client.report_timeout(self.group.epoch)

    # -- the next epoch's group ---------------------------------------------------------------------
    def epoch_published(self, epoch: int, members: tuple[int, ...]) -> None:
        """The watcher read a newer epoch: form its group ahead if this worker will need it. A rank of a
        replica that the epoch removes leaves at once (its replica-mate died: FSDP's or the pipeline's
        collectives may be blocked on it, and only ending the process bounds them)."""
        if self.replica is not None and self.group is not None and self.wid not in members:
            self.replica.down(f"epoch {epoch} does not include it")
        if self.group is None or epoch > self.group.epoch:
            self.former.offer(epoch, self.layout.coordinate(members, self.layout.rank_of(self.wid)))

    def form_next_group(self) -> None:
        """Wait for an epoch newer than the current group's that includes this worker and build its group
        (with replicas: the group of this rank's index, and every rank of the replica in the same epoch); if
        that epoch is superseded while its group forms (another member died), move on to the newest."""
        client = self.client
        after = self.group.epoch if self.group is not None else 0
        # No collective of the current group runs again: a NCCL one may be spinning on a dead peer's GPU.
        abort_group(self.group)
        while True:
            epoch = self._next_epoch(after)
            client.announce_forming(epoch.epoch)
            members = self.layout.coordinate(epoch.members, self.layout.rank_of(self.wid))
            group, status = self.former.take(epoch.epoch) or form_group(
                client.new_connection(),  # its own: an abandoned rendezvous may block in a store wait
                epoch.epoch,
                members,
                self.wid,
                self.ctx.backend,
                self.cfg.op_timeout_s,
                self.ctx.device,
                lambda e=epoch.epoch: client.latest_epoch > e or client.stopped is not None,
                self.coordinate,
            )
            if group is not None:
                # The old group's destructor may block until its abandoned collectives time out: not here.
                retire_group(self.group, self.cfg.op_timeout_s + 1.0)
                self.group = group
                self.workload = epoch.workload
            if status is WaitStatus.TIMED_OUT:
                client.report_timeout(epoch.epoch)  # the rendezvous timed out: a live member never came
            if self.agreed(group is not None):
                return
            after = epoch.epoch

    def _next_epoch(self, after: int) -> Epoch:
        """The newest epoch after ``after`` that includes this worker; the ranks of a replica take the newest
        any of them has seen. StopRun if there is none (the run stops, or this worker was excluded)."""
        client = self.client
        # The first epoch: the coordinator decides when the start has waited long enough (its join deadline began
        # before this worker registered) and its stop says who joined; this worker's own bound is later by the time
        # a coordinator's decision takes to reach it, so that its vaguer line never races the coordinator's.
        slack = self.cfg.heartbeat_timeout_s if after == 0 else 0.0
        epoch = client.wait_for_epoch(self.cfg.join_timeout_s + slack, after=after)
        if self.replica is not None:
            number = torch.tensor([float(epoch.epoch) if epoch is not None else 0.0], dtype=torch.float64)
            self.replica.all_reduce(number, torch.distributed.ReduceOp.MAX)
            agreed = int(number.item())
            if agreed > 0 and (epoch is None or epoch.epoch != agreed):
                record = client.epoch_record(agreed)
                epoch = record if self.wid in record.members else None
        if epoch is None:
            refused = client.refusal()
            if refused is not None:
                raise StopRun(refused, fatal=False)
            reason = client.stop_reason()
            if reason is None and client.current_epoch() > after:
                raise StopRun("this worker was excluded from the membership (declared dead)", fatal=False)
            raise StopRun(reason or "no new membership epoch was published in time")
        return epoch

    # -- the state on a new group -------------------------------------------------------------------
    def sync_state(self) -> bool:
        """On a new group: agree on the step; whoever is behind (a joiner, or a worker whose reduction was cut
        short while others committed) receives the state of the lowest-ranked member that is ahead, as the
        checkpoint schema's bytes (a rank of a replica: its shard of the state, from the rank of the same
        index). Before the run's first step, every member starts from the leader's state (``_one_start``).
        True if this worker was behind: its local step state is stale then (the caller begins the step
        afresh)."""
        assert self.group is not None
        steps = torch.zeros(self.group.size, dtype=torch.float64)
        steps[self.group.rank] = self.state.step
        self.state_bytes = 0
        self.wait([allreduce_async(self.group, steps)])
        ahead = float(steps.max())
        if ahead < 0:  # only joiners are left: whoever held the state died before passing it on
            raise StopRun(
                f"no member of epoch {self.group.epoch} ({', '.join(map(str, self.group.members))}) holds the training "
                "state: every worker that held it died before passing it on; stopping (resume from the last "
                "checkpoint with --resume)",
                shared=True,
            )
        if float(steps.min()) == ahead:
            if ahead == 0:
                self._one_start()
            return False
        src = int((steps == ahead).nonzero()[0])
        behind = self.state.step < ahead
        self._send_state(src, behind)
        return behind

    def _one_start(self) -> None:
        """No step committed yet: the members compare what they start from (``TrainingState.start_digest``) and,
        if any differs from the leader's, the leader's state is broadcast and loaded by those (as DDP does at
        construction). A ``start_state`` record says which; in exact mode a difference is also a warning (each
        worker initialising its own model is then the likely mistake: an unseeded model)."""
        group = self.group
        assert group is not None
        digests = torch.zeros(group.size, 32, dtype=torch.float64)
        digests[group.rank] = torch.tensor(list(self.state.start_digest()), dtype=torch.float64)
        self.wait([allreduce_async(group, digests)])
        differ = [group.members[r] for r in range(1, group.size) if not torch.equal(digests[r], digests[0])]
        if not differ and self.start_checked:
            return  # a re-formation before the first commit: checked and recorded already
        self.start_checked = True
        warn = bool(differ) and self.cfg.reduction is Reduction.EXACT
        reason = ""
        if differ:
            self._send_state(0, not torch.equal(digests[group.rank], digests[0]))
            reason = (
                f"step 0: the starting state of worker(s) {', '.join(map(str, differ))} differs from the leader's "
                f"(worker {group.members[0]}); every worker now starts from the leader's. Likely cause: the model is "
                "built without a fixed seed (call torch.manual_seed(ctx.config.train.seed) before building it)"
            )
            log.log(logging.WARNING if warn else logging.INFO, "%s", reason)
        self.publish(
            RecordKind.START_STATE,
            step=0,
            epoch=group.epoch,
            members=list(group.members),
            differed=differ,
            source=group.members[0],
            state_bytes=self.state_bytes,
            warn=warn,
            reason=reason,
        )

    def _send_state(self, src: int, receive: bool) -> None:
        """Broadcast member ``src``'s state to the group; load it here if ``receive``, and check that the
        parameters' checksum is then the sender's."""
        assert self.group is not None
        local = self.replica is not None
        payload = ckpt.encode(self.state.snapshot(local=local)) if self.group.rank == src else b""
        checksum = self.state.checksum() if self.group.rank == src else ""
        header = torch.zeros(2 + 64, dtype=torch.float64)
        if self.group.rank == src:
            header[0], header[1] = len(payload), self.state.step
            header[2:] = torch.tensor(list(bytes.fromhex(checksum)) + [0] * 32, dtype=torch.float64)
        self.wait([broadcast_async(self.group, header, src)])
        self.state_bytes = int(header[0])  # what one member sent to those behind (a rank: its shard)
        if self.group.rank != src:
            self.ctx.hook.at(Phase.RECEIVE, step=int(header[1]))
        data = torch.zeros(int(header[0]), dtype=torch.uint8)
        if self.group.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.wait([broadcast_async(self.group, data, src)])
        if not receive:
            return
        state = ckpt.decode(data.numpy().tobytes())
        self.state.restore(state, local=local)
        expected = bytes(int(x) for x in header[2:34].tolist()).hex()
        if self.state.checksum() != expected:
            raise InvariantViolation(
                f"step {self.state.step}: after receiving the state from member {self.group.members[src]} "
                f"the parameters' checksum is {self.state.checksum()[:12]}, the sender's {expected[:12]}",
                shared=False,
            )

    # -- the group's records ------------------------------------------------------------------------
    def publish(self, kind: RecordKind, **fields: Any) -> None:
        """Publish a metrics record (the group's leader only, so each is written once)."""
        if self.publisher:
            record = make(kind, time.time(), **fields)
            self.recent.append(record)
            self.client.publish_metrics(record)

    def append_undrained(self, closing: dict[str, Any]) -> None:
        """The coordinator died: append the recent records it never wrote, then ``closing``, to metrics.jsonl."""
        try:
            append_records(self.ctx.run_dir, [*self.recent, closing])
        except OSError as e:
            log.warning("could not append to the metrics of %s: %s", self.ctx.run_dir, e)
