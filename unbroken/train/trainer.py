"""One worker's training loop: the step protocol of system.md, from plan to commit.

Owns the step: read the membership epoch, plan (``plan.plan_step``), compute the assigned microbatches
(each loss scaled by 1/M, gradients accumulated locally), reduce (``comm.GradientReducer``: a SUM of the
gradients plus a per-microbatch count vector, overlapped with the last backward), and commit: the
optimizer steps only when the counts read exactly one for every id. Also validation, checkpoints
(saved by the epoch's leader) and the state broadcast that brings a worker up to date.

This is the only module that knows the model, the data, the collectives and the coordinator together.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from unbroken.control.client import CoordinatorClient
from unbroken.control.gateway import TunnelError
from unbroken.control.store import connect_store, ring
from unbroken.core.config import MECEFO_POLICIES, RunConfig, TrainConfig, config_from_toml_text, to_toml
from unbroken.core.failures import FailureKind, FailureSchedule, Phase, cut_connections
from unbroken.core.logs import init_logger
from unbroken.core.plan import Assignment, mecefo_plan, missing_ids, plan_ids
from unbroken.ft import checkpoint as ckpt
from unbroken.ft.comm import (
    GradientReducer,
    Group,
    Pending,
    allreduce_async,
    broadcast_async,
    default_backend,
    form_group,
    retire_group,
    wait_all,
)
from unbroken.ft.efficient import EfficientConfig, apply_efficient_backward
from unbroken.ft.hostmem import retain_freed_memory
from unbroken.train.data import EvalSampler, MicrobatchSampler, check_vocab, prepare_corpus
from unbroken.train.model import Transformer, model_args

log = logging.getLogger(__name__)


class StopRun(Exception):
    """This worker must stop. ``fatal``: the whole job must stop too (else only this worker leaves)."""

    def __init__(self, reason: str, fatal: bool = True) -> None:
        super().__init__(reason)
        self.fatal = fatal


EXIT_STOPPED = 3  # this worker stopped (excluded, cut off, or the job was stopped)
EXIT_COORDINATOR_LOST = 4  # the coordinator is gone; the state was checkpointed for --resume
RECENT_RECORDS = 64  # metrics records a worker keeps, to write them itself if the coordinator dies


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over the first ``warmup_fraction`` of the steps, then cosine to ``lr * min_lr_ratio``."""
    warmup = int(cfg.warmup_fraction * cfg.steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights are not decayed); state created eagerly."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
    )
    for p in model.parameters():
        # Eager state so every worker has the same tensors to broadcast, even before the first step.
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return optimizer


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state, in a fixed order (parameters, then AdamW moments and counts)."""
    tensors = [p.data for p in model.parameters()]
    for p in model.parameters():
        state = optimizer.state[p]
        tensors += [state["exp_avg"], state["exp_avg_sq"], state["step"]]
    return tensors


def param_checksum(model: torch.nn.Module) -> str:
    """sha256 over the bytes of every parameter, in order: equal iff the parameters are bitwise equal."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class StepOutcome:
    loss: float
    grad_norm: float
    lr: float
    recomputed: int = 0  # microbatches recomputed by survivors because their first owner died
    dropped: int = 0  # microbatches skipped (``drop`` policy)
    recoveries: int = 0  # group re-formations during the step
    efficient: int = 0  # microbatches computed in MeCeFO's efficient mode


class Interrupted(Exception):
    """A collective was abandoned because the membership changed; recovery starts (internal only)."""


SPEED_SLOTS = 256  # per-worker seconds-per-microbatch slots in the reduced extras (worker ids below this)
HEADER_SLOTS = 1 + len(fields(StepOutcome))  # a state transfer's header: the step, then the last StepOutcome


class Worker:
    """A training worker: builds the model and data from the run's config, joins the coordinator, trains."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        tc = cfg.train
        self.M = tc.microbatches
        self.backend = default_backend(cfg.comm.backend)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        corpus = prepare_corpus(cfg.data)
        check_vocab(corpus, cfg.model.vocab_size)
        self.tokenizer_sha256 = hashlib.sha256(Path(corpus.tokenizer_path).read_bytes()).hexdigest()
        self.args = model_args(
            cfg.model.flavour,
            vocab_size=cfg.model.vocab_size or corpus.vocab_size,
            n_kv_heads=cfg.model.n_kv_heads,
            max_seq_len=cfg.data.seq_len,
        )
        torch.manual_seed(tc.seed)
        self.model = Transformer(self.args).to(self.device)
        self.optimizer = build_optimizer(self.model, tc)
        self.params = list(self.model.parameters())
        self.sampler = MicrobatchSampler(corpus.train, cfg.data.seq_len, cfg.data.microbatch_size, self.M, tc.seed)
        self.eval_sampler = EvalSampler(corpus.val, cfg.data.seq_len, cfg.data.microbatch_size, tc.eval_microbatches)
        self.exact = cfg.recovery.reduction == "exact"
        # Reduced with the gradients, per microbatch id: loss, "computed" count, "computed in efficient mode"
        # count; then each worker's seconds per microbatch, then the exact mode's overflow flag.
        self.speeds_at = 3 * self.M
        self.reducer = GradientReducer(
            self.params,
            int(cfg.comm.bucket_mb * 2**20),
            self.speeds_at + SPEED_SLOTS + 2,
            exact=self.exact,
            first_bucket_bytes=int(cfg.comm.first_bucket_mb * 2**20),
        )
        self.tokens_per_step = self.M * cfg.data.microbatch_size * cfg.data.seq_len
        self.policy = cfg.recovery.policy
        self.efficient_backward = (
            apply_efficient_backward(self.model, EfficientConfig(cfg.mecefo.rank, cfg.mecefo.refresh_every))
            if self.policy in MECEFO_POLICIES
            else None
        )
        self.efficient_ids: frozenset[int] = frozenset()  # this step's ids to compute in efficient mode
        self.done_efficient: list[int] = []
        self.ring: tuple[int, ...] = ()  # the configured workers in ring order (MeCeFO's neighbours)
        self.schedule = FailureSchedule.parse(cfg.failures.schedule)
        self.client: CoordinatorClient | None = None
        self.group: Group | None = None
        self.step = 0
        self.speeds: dict[int, float] = {}  # agreed seconds per microbatch of each worker (throughput policy)
        self.my_speed: float = 0.0
        self.bound_boost = 1.0  # exact mode: grows when a microbatch gradient overflowed the fixed point
        self.last = StepOutcome(float("nan"), float("nan"), float("nan"))
        self.done: list[int] = []
        self.local_losses = torch.zeros(self.M, dtype=torch.float64)
        self.pending_todo: list[int] | None = None
        # The newest epoch the leader had seen at the last reduction: every member reads the same value, so
        # they all take in joiners at the same step boundary (a join interrupts no collective).
        self.switch_epoch = 0
        self.recovering = False  # inside recover(): see interrupted()
        self.quotas: dict[int, int] = {}  # microbatches per worker in the step's plan (for the metrics)
        self.resume_pending = False
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RECORDS)
        self.last_counts = torch.ones(self.M, dtype=torch.float64)

    @property
    def wid(self) -> int:
        assert self.client is not None
        return self.client.worker_id

    # -- membership -------------------------------------------------------------------------------
    def interrupted(self) -> bool:
        """True when a member of the current group was removed (a newer epoch without it) or the run is being
        stopped (cached, cheap). A join does not interrupt: the group's collectives complete, and the joiner
        is taken in at the next step boundary."""
        assert self.client is not None and self.group is not None
        group, client = self.group, self.client
        if client.stopped is not None or client.removed_since(group.epoch, group.members):
            return True
        # While recovering, any newer epoch interrupts: members may skip an epoch that is already superseded,
        # so a collective on it might never be matched.
        return self.recovering and client.latest_epoch > group.epoch

    def _wait(self, pending: list[Pending]) -> None:
        if not wait_all(pending, self.cfg.comm.op_timeout_s, self.interrupted):
            raise Interrupted

    def form_next_group(self) -> None:
        """Wait for an epoch newer than the current group's that includes this worker and build its group;
        if that epoch is superseded while its group forms (another member died), move on to the newest."""
        assert self.client is not None
        client = self.client
        after = self.group.epoch if self.group is not None else 0
        while True:
            epoch = client.wait_for_epoch(self.cfg.comm.join_timeout_s, after=after)
            if epoch is None:
                reason = client.stop_reason()
                if reason is None and client.current_epoch() > after:
                    raise StopRun("this worker was excluded from the membership (declared dead)", fatal=False)
                raise StopRun(reason or "no new membership epoch was published in time")
            group = form_group(
                client.new_connection(),  # its own: an abandoned rendezvous may block in a store wait
                epoch.epoch,
                epoch.members,
                self.wid,
                self.backend,
                self.cfg.comm.op_timeout_s,
                self.device,
                lambda e=epoch.epoch: client.latest_epoch > e or client.stopped is not None,
            )
            if group is not None:
                # The old group's destructor may block until its abandoned collectives time out: not here.
                retire_group(self.group, self.cfg.comm.op_timeout_s + 1.0)
                self.group = group
                return
            after = epoch.epoch

    @property
    def leader(self) -> bool:
        assert self.group is not None
        return self.group.rank == 0

    def publish(self, record: dict[str, Any]) -> None:
        if self.leader:
            assert self.client is not None
            record = {**record, "time": time.time()}
            self.recent.append(record)
            self.client.publish_metrics(record)

    # -- state ------------------------------------------------------------------------------------
    def load_checkpoint(self) -> int:
        """Load the newest good checkpoint into the model and optimizer; return its step."""
        loaded = ckpt.load_latest(self.run_dir)
        if loaded is None:
            raise StopRun(f"--resume: no usable checkpoint in {ckpt.checkpoint_dir(self.run_dir)}")
        for line in loaded.skipped:
            self.publish({"type": "checkpoint_rejected", "detail": line})
        state = loaded.state
        model_state = state["model"]
        own = self.model.state_dict()
        mismatched = [k for k in own if k not in model_state or model_state[k].shape != own[k].shape]
        if mismatched or len(model_state) != len(own):
            raise StopRun(
                f"checkpoint {loaded.path.name} is for a different model shape "
                f"(first mismatch: {(mismatched or sorted(set(model_state) - set(own)))[0]})"
            )
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.efficient_backward is not None and "mecefo_bases" in state:
            self.efficient_backward.load_bases(state["mecefo_bases"])
        self.publish({"type": "resume", "step": loaded.step, "path": str(loaded.path)})
        log.info("resumed from %s (step %d)", loaded.path, loaded.step)
        return int(state["step"])

    def broadcast_state(self, src_rank: int) -> None:
        """Make every member's training state equal to ``src_rank``'s: step, last outcome, agreed speeds,
        parameters and optimizer state. This is how a rejoining worker catches up, and how a resume
        spreads the leader's checkpoint."""
        assert self.group is not None
        header = torch.zeros(HEADER_SLOTS + SPEED_SLOTS, dtype=torch.float64)
        header[:HEADER_SLOTS] = torch.tensor([self.step, *astuple(self.last)], dtype=torch.float64)
        for w, seconds in self.speeds.items():
            header[HEADER_SLOTS + w] = seconds
        self._wait([broadcast_async(self.group, header, src_rank)])
        if self.group.rank != src_rank:
            self.inject(Phase.RECEIVE, step=int(header[0]))
        tensors = state_tensors(self.model, self.optimizer)
        if self.efficient_backward is not None:
            tensors += self.efficient_backward.bases()
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self._wait([broadcast_async(self.group, flat, src_rank)])
        if self.group.rank != src_rank:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
            self.step = int(header[0])
            self.last = StepOutcome(
                float(header[1]), float(header[2]), float(header[3]), *(int(x) for x in header[4:HEADER_SLOTS])
            )
        self.speeds = {w: float(header[HEADER_SLOTS + w]) for w in range(SPEED_SLOTS) if header[HEADER_SLOTS + w] > 0}

    def sync_state(self) -> bool:
        """On a new group: agree on the step; whoever is behind (a joiner, or a worker whose reduction was
        cut short while others committed) receives the state of the lowest-ranked worker that is ahead.
        True if this worker was behind."""
        assert self.group is not None
        steps = torch.zeros(self.group.size, dtype=torch.float64)
        steps[self.group.rank] = self.step
        self._wait([allreduce_async(self.group, steps)])
        ahead = float(steps.max())
        if float(steps.min()) == ahead:
            return False
        src = int((steps == ahead).nonzero()[0])
        was_behind = self.step < ahead
        self.broadcast_state(src)
        if was_behind:
            self.begin_step()
        return was_behind

    def republish_last_step(self) -> None:
        """The last committed step's record may have been lost with the old leader (killed between its
        commit and its publish): the new leader publishes it again, marked ``republished``."""
        if not self.leader or self.step < 1 or math.isnan(self.last.loss):
            return
        assert self.group is not None
        self.publish(
            {
                "type": "step",
                "step": self.step - 1,
                "loss": self.last.loss,
                "lr": self.last.lr,
                "grad_norm": self.last.grad_norm,
                "step_time_s": float("nan"),
                "tokens": self.tokens_per_step,
                "tokens_per_s": float("nan"),
                "alive": self.group.size,
                "epoch": self.group.epoch,
                "microbatches": self.M,
                "recomputed": self.last.recomputed,
                "dropped": self.last.dropped,
                "recoveries": self.last.recoveries,
                "efficient": self.last.efficient,
                "committed": True,
                "republished": True,
            }
        )

    def checkpoint_state(self, next_step: int) -> dict[str, Any]:
        return {
            "format": 1,
            "step": next_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": to_toml(self.cfg),
            "flavour": self.cfg.model.flavour,
            "vocab_size": self.args.vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            **({"mecefo_bases": self.efficient_backward.bases()} if self.efficient_backward is not None else {}),
        }

    # -- failure injection --------------------------------------------------------------------------
    def inject(self, phase: Phase, step: int | None = None) -> None:
        """If the schedule says so, tell the launcher we reached (step, phase) and wait to be signalled.

        A kill, hang or pause is a real signal from the launcher (SIGKILL, SIGSTOP, SIGSTOP + SIGCONT);
        without one (a worker started by hand), the worker acts on itself after a few seconds. A cut is
        done here once the launcher has recorded it: every TCP connection of this process is shut down.
        """
        step = self.step if step is None else step
        candidates = self.schedule.injections(self.wid, step, phase)
        if not candidates or self.client is None:
            return
        # Each event fires once per run, also when a restart replays its step.
        event = next((e for e in candidates if not self.client.store.check([f"fired/{e.describe()}"])), None)
        if event is None:
            return
        log.warning("injection point reached: %s", event.describe())
        store, key = self.client.store, f"inject/{self.wid}"
        store.set(key, json.dumps({"event": event.describe(), "time": time.time()}))
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and store.check([key]):
            time.sleep(0.005)  # the launcher takes the key, then signals
        if store.check([f"skip/{self.wid}"]):  # the launcher spares the group's last alive member
            store.delete_key(f"skip/{self.wid}")
            log.warning("injection skipped: no other member of the group is alive")
            return
        if event.kind is FailureKind.CUT:
            log.warning("cutting %d connections", cut_connections())
            return
        if event.kind is FailureKind.PAUSE:
            # SIGSTOP arrives within the launcher's poll period; after SIGCONT this sleep ends at once.
            time.sleep(0.5 if not store.check([key]) else event.seconds)
            return
        while time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL if event.kind is FailureKind.KILL else signal.SIGSTOP)

    def _phase_hooks(self, last: bool, first: bool) -> list[Any]:
        """One-shot hooks that fire inside the forward of the first / the backward of the last microbatch."""
        handles = []
        middle = self.model.layers[len(self.model.layers) // 2]
        if first and self.schedule.injection(self.wid, self.step, Phase.FORWARD) is not None:
            handles.append(middle.register_forward_hook(lambda *_: self.inject(Phase.FORWARD)))
        if last and self.schedule.injection(self.wid, self.step, Phase.BACKWARD) is not None:
            handles.append(middle.register_full_backward_hook(lambda *_: self.inject(Phase.BACKWARD)))
        return handles

    # -- the step -----------------------------------------------------------------------------------
    def microbatch_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs.to(self.device))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.to(self.device).reshape(-1))

    def exact_bounds(self) -> list[float]:
        """Per-tensor bounds on a microbatch gradient, from state every worker holds identically: the AdamW
        second moment bounds the last gradient (v >= (1 - beta2) g^2), with generous headroom."""
        bounds = []
        beta2 = self.cfg.train.beta2
        for p in self.params:
            v = self.optimizer.state[p]["exp_avg_sq"]
            last = math.sqrt(float(v.max()) / (1.0 - beta2)) if v.numel() else 0.0
            bounds.append(max(last, 2.0**-10) * 2.0**10 * self.bound_boost)
        return bounds

    def begin_step(self) -> None:
        """Fresh local state for ``self.step``: no microbatch done, empty accumulators."""
        self.done = []
        self.done_efficient = []
        self.local_losses = torch.zeros(self.M, dtype=torch.float64)
        self.reducer.reset_local()
        eb = self.efficient_backward
        if eb is not None and self.step >= 0 and self.step % eb.config.refresh_every == 0:
            # The projection bases follow the weights at steps 0, tau, 2 tau, ...: every member computes them
            # from identical weights; a joiner receives them with the state.
            eb.refresh(self.step)
        if self.exact:
            self.reducer.set_bounds(self.exact_bounds(), self.M)

    def compute(self, ids: list[int] | tuple[int, ...]) -> None:
        """Forward and backward of each id, gradients (scaled 1/M) into the local accumulator."""
        assert self.group is not None
        factor = self.schedule.slow_factor(self.wid, self.step)
        for k, j in enumerate(ids):
            last = k == len(ids) - 1
            handles = self._phase_hooks(last=last, first=k == 0)
            if last and not self.exact:
                self.reducer.arm(self.group)  # overlap the reduction with this last backward
            t0 = time.perf_counter()
            inputs, targets = self.sampler.microbatch(self.step, j)
            efficient = j in self.efficient_ids
            assert not efficient or self.efficient_backward is not None
            with self.efficient_backward.enabled() if efficient else nullcontext():
                loss = self.microbatch_loss(inputs, targets)
                (loss / self.M).backward()
            if self.exact:
                self.reducer.fold()
            for h in handles:
                h.remove()
            self.local_losses[j] = float(loss.item())
            self.done.append(j)
            if efficient:
                self.done_efficient.append(j)
            elapsed = time.perf_counter() - t0
            if factor > 1.0:
                time.sleep((factor - 1.0) * elapsed)  # an injected slow-down: this worker computes `factor`x slower
                elapsed *= factor
            self.my_speed = elapsed if self.my_speed == 0 else 0.5 * self.my_speed + 0.5 * elapsed

    def reduce(self) -> torch.Tensor:
        """Reduce the local contribution and the extras over the group; raises Interrupted."""
        assert self.group is not None
        extras = torch.zeros(self.speeds_at + SPEED_SLOTS + 2, dtype=torch.float64)
        extras[: self.M] = self.local_losses
        for j in self.done:
            extras[self.M + j] += 1
        for j in self.done_efficient:
            extras[2 * self.M + j] += 1
        if self.wid < SPEED_SLOTS:
            extras[self.speeds_at + self.wid] = self.my_speed
        if self.leader:
            extras[self.speeds_at + SPEED_SLOTS] = self.client.latest_epoch  # see switch_epoch
        extras[-1] = 1.0 if self.reducer.overflowed else 0.0
        self.reducer.launch_gradients(self.group)
        # Killed here, a worker has sent its gradients but not its counts, so the reduction cannot complete
        # without it: a kill "in the reduction" always interrupts one (sent after the extras, it could land
        # after the survivors had already finished and committed the step).
        self.inject(Phase.REDUCTION)
        self.reducer.launch_extras(extras)
        reduced = self.reducer.wait(self.cfg.comm.op_timeout_s, self.interrupted)
        if reduced is None:
            self.reducer.disarm()
            raise Interrupted
        return reduced

    def recover(self) -> list[int]:
        """Join the next membership epoch: form its group, agree on the step and state (whoever is behind
        receives it), find the current step's microbatches that no member holds, and return this worker's
        share of them (none under ``drop`` when a member died). Every member runs exactly this sequence of
        collectives after every membership change (start, failure, join), wherever it was, so the collectives
        always match.
        """
        old_members = self.group.members if self.group is not None else ()  # before any re-formation
        self.recovering = True
        try:
            return self._recover(old_members)
        finally:
            self.recovering = False

    def _recover(self, old_members: tuple[int, ...]) -> list[int]:
        while True:
            t0 = time.monotonic()
            old_epoch = self.group.epoch if self.group is not None else 0
            try:
                if self.policy == "restart" and self.group is not None:
                    reason = "membership changed; the restart policy restarts from the last checkpoint"
                    raise StopRun(reason, fatal=False)
                self.form_next_group()
                formed = time.monotonic()
                if self.resume_pending:
                    self.resume_pending = False
                    if self.leader:
                        self.step = self.load_checkpoint()
                        self.begin_step()
                was_behind = self.sync_state()
                held = torch.zeros(self.M, dtype=torch.float64)
                held[self.done] = 1.0
                self._wait([allreduce_async(self.group, held)])
            except Interrupted:
                continue  # another change while recovering: go again from the newest epoch (the handler ends here)
            if was_behind or (old_members and old_members[0] not in self.group.members):
                self.republish_last_step()
            missing = missing_ids(held.tolist())
            if old_epoch > 0:
                self.publish(
                    {
                        "type": "recovery",
                        "step": self.step,
                        "from_epoch": old_epoch,
                        "epoch": self.group.epoch,
                        "alive": self.group.size,
                        "reform_s": formed - t0,
                        "missing": missing,
                        "time_reformed": time.time(),
                    }
                )
            died = not set(old_members) <= set(self.group.members)
            if self.policy == "drop" and old_epoch > 0 and died and len(missing) < self.M:
                # Someone died mid-step: their microbatches are lost. (A join alone loses nothing, and a step
                # nobody had started yet is planned as usual.)
                return []
            plan = self.plan(missing)
            if len(missing) == self.M:
                self.quotas = {w: len(ids) for w, ids in plan.ids.items()}
            return list(plan.ids_for(self.wid))

    def plan(self, todo: list[int] | None = None) -> Assignment:
        """The assignment of ``todo`` (default: all M ids) of the current step over the group's members;
        every member computes the same one. Sets the ids this worker runs in efficient mode (MeCeFO)."""
        assert self.group is not None
        if self.efficient_backward is not None:
            ring = sorted(set(self.ring) | set(self.group.members))
            spread = self.policy == "mecefo-spread"
            plan = mecefo_plan(self.step, ring, self.group.members, self.M, todo, spread=spread)
        else:
            ids = range(self.M) if todo is None else todo
            plan = plan_ids(self.step, self.group.members, ids, self.M, self.cfg.recovery.workload, self.speeds)
        self.efficient_ids = plan.efficient
        return plan

    @torch.no_grad()
    def normalise_attention(self, contributed: int, counted: int) -> None:
        """MeCeFO: attention parameters got gradients only from the exact microbatches; average over those
        (``contributed``) instead of over every counted one. With none, their gradient is zero this step."""
        assert self.efficient_backward is not None
        for p in self.efficient_backward.attention_parameters():
            if p.grad is None:
                continue
            if contributed > 0:
                p.grad.mul_(counted / contributed)
            else:
                p.grad.zero_()

    def train_step(self) -> StepOutcome | None:
        """Run ``self.step`` to its commit, recovering in-step from any membership change. Returns None if
        the step was committed by others while this worker was cut off (it then received their state)."""
        assert self.group is not None and self.client is not None
        step = self.step
        recoveries = recomputed = 0
        if self.pending_todo is not None:
            todo, self.pending_todo = self.pending_todo, None
        elif self.client.removed_since(self.group.epoch, self.group.members) or self.switch_epoch > self.group.epoch:
            # A death between steps, or a join the group agreed on in the last reduction.
            todo = self.recover()
            recoveries += 1
        else:
            self.inject(Phase.START)
            plan = self.plan()
            self.quotas = {w: len(ids) for w, ids in plan.ids.items()}
            todo = list(plan.ids_for(self.wid))
        while True:
            if self.step != step:
                self.pending_todo = todo
                return None
            try:
                self.compute(todo)
                reduced = self.reduce()
            except Interrupted:
                reduced = None
            if reduced is None:
                # Recover outside the handler: the exception's traceback holds the abandoned collectives,
                # which keep the old group's connections open, so peers still waiting on them would hang.
                todo = self.recover()
                recoveries += 1
                recomputed += len(todo)
                continue
            if reduced[-1] > 0:  # exact mode: some microbatch overflowed the fixed point; redo with room
                self.bound_boost *= 2.0**16
                log.warning("step %d: fixed-point overflow; redoing the step with larger bounds", step)
                self.begin_step()
                todo = list(self.plan().ids_for(self.wid))
                continue
            break
        counts = reduced[self.M : 2 * self.M]
        counted = int(counts.sum())
        efficient = int(reduced[2 * self.M : 3 * self.M].sum())
        if self.policy == "drop":
            assert bool((counts <= 1).all()) and counted >= 1, counts.tolist()
        else:
            assert bool((counts == 1).all()), f"step {step}: counts {counts.tolist()} are not all one"
        self.speeds = {
            w: float(reduced[self.speeds_at + w])
            for w in self.group.members
            if w < SPEED_SLOTS and reduced[self.speeds_at + w] > 0
        }
        self.switch_epoch = int(reduced[self.speeds_at + SPEED_SLOTS])
        self.inject(Phase.OPTIMIZER)
        # Commit: the normaliser is M (each microbatch loss was scaled by 1/M); under `drop` the gradient is
        # renormalised by what was computed, as torchft does.
        self.reducer.apply(scale=self.M / counted if counted != self.M else 1.0)
        if efficient:
            self.normalise_attention(counted - efficient, counted)
        tc = self.cfg.train
        if tc.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip, foreach=True))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
        lr = lr_at(step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        loss = float(sum(float(reduced[j]) for j in range(self.M) if counts[j] > 0)) / counted
        self.last = StepOutcome(loss, grad_norm, lr, recomputed, self.M - counted, recoveries, efficient)
        self.last_counts = counts
        self.step = step + 1
        self.begin_step()
        return self.last

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over ``eval_microbatches`` fixed microbatches, split over the members."""
        assert self.group is not None
        if True:
            self.model.eval()
            total = torch.zeros(2, dtype=torch.float64)
            for k in range(self.group.rank, self.cfg.train.eval_microbatches, self.group.size):
                inputs, targets = self.eval_sampler.microbatch(k)
                total[0] += float(self.microbatch_loss(inputs, targets))
                total[1] += 1
            self.model.train()
            try:
                self._wait([allreduce_async(self.group, total)])
                return float(total[0] / total[1])
            except Interrupted:
                pass
            # A failure during evaluation: skip this evaluation and take part in the recovery now (outside the
            # handler, see train_step), keeping this worker's share of the next step for when it starts.
            self.pending_todo = self.recover()
            return None

    def should(self, every: int, step: int) -> bool:
        return step + 1 == self.cfg.train.steps or (every > 0 and (step + 1) % every == 0)

    def train(self, client: CoordinatorClient) -> None:
        """Join, agree on the starting state (resume or rejoin), then step until the end of the run."""
        self.client = client
        self.ring = tuple(range(int(client.store.get("expected"))))
        tc = self.cfg.train
        self.resume_pending = client.resume() and not client.late
        if client.late:
            self.step = -1  # a (re)joining worker: it receives the state from a live peer
        self.begin_step()
        self.pending_todo = self.recover()
        assert self.group is not None
        log.info(
            "member of epoch %d as rank %d of %d at step %d",
            self.group.epoch,
            self.group.rank,
            self.group.size,
            self.step,
        )
        while self.step < tc.steps:
            if (reason := client.stopped) is not None:
                raise StopRun(reason)
            t0 = time.perf_counter()
            outcome = self.train_step()
            if outcome is None:
                continue
            elapsed = time.perf_counter() - t0
            committed = self.step - 1
            self.publish(
                {
                    "type": "step",
                    "step": committed,
                    "loss": outcome.loss,
                    "lr": outcome.lr,
                    "grad_norm": outcome.grad_norm,
                    "step_time_s": elapsed,
                    "tokens": self.tokens_per_step,
                    "tokens_per_s": self.tokens_per_step / elapsed,
                    "alive": self.group.size,
                    "epoch": self.group.epoch,
                    "microbatches": self.M,
                    "committed": True,
                    # each id's count in the reduced vector: every one must be 1 (0 only under `drop`)
                    "counted": int(self.last_counts.sum()),
                    "counted_once": bool((self.last_counts == 1).all()),
                    "recomputed": outcome.recomputed,
                    "dropped": outcome.dropped,
                    "recoveries": outcome.recoveries,
                    "efficient": outcome.efficient,
                    "quotas": {str(w): n for w, n in self.quotas.items()},
                }
            )
            if self.should(tc.eval_every, committed):
                val_loss = self.evaluate()
                if val_loss is not None:
                    self.publish(
                        {
                            "type": "eval",
                            "step": committed,
                            "val_loss": val_loss,
                            "val_ppl": math.exp(min(val_loss, 50.0)),
                        }
                    )
            if self.leader and self.should(self.cfg.checkpoint.every, committed):
                t1 = time.perf_counter()
                path = ckpt.save_checkpoint(
                    self.run_dir,
                    self.step,
                    self.checkpoint_state(self.step),
                    self.cfg.checkpoint.keep,
                    midway=lambda s=self.step: self.inject(Phase.CHECKPOINT, step=s),
                )
                self.publish(
                    {"type": "checkpoint", "step": self.step, "path": str(path), "seconds": time.perf_counter() - t1}
                )
        self.finish()

    def stop_without_coordinator(self) -> str:
        """The coordinator is gone: no membership can change any more, so the job stops. The leader of this
        worker's group checkpoints the last committed state (every member holds it, bitwise) and writes the
        metrics records the coordinator did not drain. Returns the line to log."""
        hint = f"continue with: unbroken train --resume {self.run_dir}"
        if self.group is None or not self.leader or self.step <= 0:
            return f"the coordinator is gone; stopping (the leader checkpoints the last committed step); {hint}"
        saved = ckpt.list_checkpoints(self.run_dir)
        if saved and saved[0] >= self.step:
            path = ckpt.checkpoint_dir(self.run_dir) / f"step_{saved[0]:08d}.pt"
        else:
            path = ckpt.save_checkpoint(
                self.run_dir, self.step, self.checkpoint_state(self.step), self.cfg.checkpoint.keep
            )
        self._append_undrained({"type": "coordinator_lost", "step": self.step, "path": str(path), "time": time.time()})
        return f"the coordinator is gone; saved the state of step {self.step} ({path}); {hint}"

    def _append_undrained(self, closing: dict[str, Any]) -> None:
        """Append to metrics.jsonl the recent records the coordinator never wrote, then ``closing``."""
        path = self.run_dir / "metrics.jsonl"
        try:
            with open(path, "a+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 2**18))
                tail = f.read().decode(errors="replace")
                lines = set(tail.splitlines())
                out = "" if not tail or tail.endswith("\n") else "\n"  # after a line torn by the kill
                for record in [*self.recent, closing]:
                    line = json.dumps(record, sort_keys=True)
                    if line not in lines:
                        out += line + "\n"
                f.write(out.encode())
        except OSError as e:
            log.warning("could not append to %s: %s", path, e)

    def finish(self) -> None:
        """Publish this worker's parameter checksum; the leader records all of them and marks the run done."""
        assert self.group is not None and self.client is not None
        store = self.client.store
        while True:
            store.set(f"final/{self.wid}", param_checksum(self.model))
            try:
                self._wait([allreduce_async(self.group, torch.zeros(1))])
                break
            except Interrupted:
                pass
            self.recover()  # outside the handler (see train_step)
        if self.leader:
            checksums = {str(w): store.get(f"final/{w}").decode() for w in self.group.members}
            self.publish(
                {
                    "type": "final",
                    "step": self.step,
                    "checksums": checksums,
                    "identical": len(set(checksums.values())) == 1,
                }
            )
            self.client.flush_metrics()  # the coordinator drains the records once more on "done", then ends
            store.set("done", "ok")
            ring(store)


def run_worker(address: str, worker_id: int | None, run_dir: str | None = None) -> int:
    """Entry point of ``unbroken worker``: build the model and data, join the job at ``address``, train."""
    init_logger(f"worker {worker_id if worker_id is not None else '?'}")
    try:
        probe = connect_store(address)
        cfg = config_from_toml_text(probe.get("config").decode())
        directory = Path(run_dir) if run_dir else Path(probe.get("run_dir").decode())
    except (TunnelError, RuntimeError) as e:
        log.error("cannot join the job: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return EXIT_STOPPED
    del probe
    if cfg.train.retain_host_memory:
        retain_freed_memory()
    local_workers = int(os.environ.get("UNBROKEN_LOCAL_WORKERS", "1"))
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // max(1, local_workers)))
    worker = Worker(cfg, directory)  # ready to train before registering, so a joiner never stalls the others
    comm = cfg.comm
    client = CoordinatorClient(address, worker_id, comm.heartbeat_interval_s, comm.heartbeat_timeout_s)
    init_logger(f"worker {client.worker_id}")
    try:
        worker.train(client)
    except (StopRun, RuntimeError, TunnelError) as e:
        # A store call that fails (RuntimeError) means the connection to the coordinator broke; the
        # watcher says whether the coordinator is gone or only this worker was cut off.
        lost = client.lost if isinstance(e, StopRun) else client.wait_lost(2 * comm.heartbeat_timeout_s + 1.0)
        if lost == "coordinator":
            log.error("%s", worker.stop_without_coordinator())
            return EXIT_COORDINATOR_LOST
        if lost == "cut":
            log.error("stopping: %s; leaving the job (the others go on without this worker)", client.stopped)
            return EXIT_STOPPED
        if not isinstance(e, StopRun):
            raise
        log.error("stopping: %s", e)
        if e.fatal and client.stopped is None:
            client.store.set("stop", f"worker {client.worker_id}: {e}")
            ring(client.store)
        return EXIT_STOPPED
    finally:
        client.close()
    return 0
