"""One worker's training loop: the step protocol of system.md, from plan to commit.

Owns the step: read the membership epoch, plan (``plan.plan_step``), compute the assigned microbatches
(each loss scaled by 1/M, gradients accumulated locally), reduce (``comm.GradientReducer``: a SUM of the
gradients plus a per-microbatch count vector, overlapped with the last backward), and commit: the
optimizer steps only when the counts read exactly one for every id. Also validation, checkpoints
(saved by the epoch's leader) and the state broadcast that brings a worker up to date.

This is the only module that knows the model, the data, the collectives and the coordinator together.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from unbroken import checkpoint as ckpt
from unbroken.comm import (
    GradientReducer,
    Group,
    allreduce_async,
    broadcast_async,
    default_backend,
    form_group,
    wait_all,
)
from unbroken.config import RunConfig, TrainConfig, config_from_toml_text, to_toml
from unbroken.coordinator import CoordinatorClient
from unbroken.data import EvalSampler, MicrobatchSampler, check_vocab, prepare_corpus
from unbroken.metrics import init_logger
from unbroken.model import Transformer, model_args
from unbroken.plan import plan_step

log = logging.getLogger(__name__)


class StopRun(Exception):
    """The run must end here (the coordinator said stop, or membership changed with no recovery)."""


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


class Worker:
    """A training worker: builds everything from the config the coordinator hands out, then trains."""

    def __init__(self, client: CoordinatorClient, cfg: RunConfig, run_dir: Path) -> None:
        self.client = client
        self.cfg = cfg
        self.run_dir = run_dir
        self.wid = client.worker_id
        tc = cfg.train
        self.M = tc.microbatches
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if (default_backend(cfg.comm.backend) == "nccl")
            else torch.device("cpu")
        )
        self.backend = default_backend(cfg.comm.backend)
        corpus = prepare_corpus(cfg.data)
        check_vocab(corpus, cfg.model.vocab_size)
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
        self.reducer = GradientReducer(self.params, bucket_bytes=int(cfg.comm.bucket_mb * 2**20), num_extras=1 + self.M)
        self.tokens_per_step = self.M * cfg.data.microbatch_size * cfg.data.seq_len
        self.group: Group | None = None
        self.step = 0

    # -- membership -------------------------------------------------------------------------------
    def interrupted(self) -> bool:
        """True when the current group is stale (a newer epoch) or the run is being stopped."""
        assert self.group is not None
        return self.client.current_epoch() != self.group.epoch or self.client.stop_reason() is not None

    def join(self) -> None:
        epoch = self.client.wait_for_epoch(self.cfg.comm.join_timeout_s)
        if epoch is None:
            raise StopRun(self.client.stop_reason() or "no membership epoch was published in time")
        t0 = time.monotonic()
        self.group = form_group(
            self.client.store,
            epoch.epoch,
            epoch.members,
            self.wid,
            self.backend,
            self.cfg.comm.op_timeout_s,
            self.device,
        )
        log.info(
            "joined epoch %d as rank %d of %d in %.3f s",
            epoch.epoch,
            self.group.rank,
            self.group.size,
            time.monotonic() - t0,
        )

    @property
    def leader(self) -> bool:
        assert self.group is not None
        return self.group.rank == 0

    def publish(self, record: dict[str, Any]) -> None:
        if self.leader:
            self.client.publish_metrics({**record, "time": time.time()})

    # -- state ------------------------------------------------------------------------------------
    def load_checkpoint(self) -> int:
        """Leader only: load the newest good checkpoint into the model and optimizer; return its step."""
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
        self.publish({"type": "resume", "step": loaded.step, "path": str(loaded.path)})
        log.info("resumed from %s (step %d)", loaded.path, loaded.step)
        return int(state["step"])

    def broadcast_state(self, src_rank: int, step: int) -> int:
        """Make every member's training state (parameters, optimizer, step) equal to ``src_rank``'s."""
        assert self.group is not None
        header = torch.tensor([float(step)], dtype=torch.float64)
        if not wait_all([broadcast_async(self.group, header, src_rank)], self.cfg.comm.op_timeout_s, self.interrupted):
            raise StopRun("state broadcast interrupted")
        tensors = state_tensors(self.model, self.optimizer)
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        if not wait_all([broadcast_async(self.group, flat, src_rank)], self.cfg.comm.op_timeout_s, self.interrupted):
            raise StopRun("state broadcast interrupted")
        if self.group.rank != src_rank:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
        return int(header.item())

    def checkpoint_state(self, next_step: int) -> dict[str, Any]:
        return {
            "format": 1,
            "step": next_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": to_toml(self.cfg),
            "flavour": self.cfg.model.flavour,
            "vocab_size": self.args.vocab_size,
        }

    # -- the step -----------------------------------------------------------------------------------
    def microbatch_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs.to(self.device))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.to(self.device).reshape(-1))

    def train_step(self, step: int) -> StepOutcome:
        assert self.group is not None
        plan = plan_step(step, self.group.members, self.M)
        my_ids = plan.ids_for(self.wid)
        for p in self.params:
            p.grad = None
        loss_sum = 0.0
        counts = torch.zeros(self.M)
        for k, j in enumerate(my_ids):
            if k == len(my_ids) - 1:
                self.reducer.arm(self.group)  # overlap the reduction with this last backward
            inputs, targets = self.sampler.microbatch(step, j)
            loss = self.microbatch_loss(inputs, targets)
            (loss / self.M).backward()
            loss_sum += float(loss.item())
            counts[j] += 1
        extras = torch.cat([torch.tensor([loss_sum]), counts])
        reduced = self.reducer.finish(self.group, extras, self.cfg.comm.op_timeout_s, self.interrupted)
        if reduced is None:
            self.reducer.disarm()
            raise StopRun(self._interruption_reason(step))
        total_counts = reduced[1:]
        if not bool((total_counts == 1).all()):
            raise StopRun(f"step {step}: microbatch counts {total_counts.tolist()} are not all one; not committing")
        self.reducer.apply()
        tc = self.cfg.train
        if tc.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip, foreach=True))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params]))
        lr = lr_at(step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return StepOutcome(loss=float(reduced[0]) / self.M, grad_norm=grad_norm, lr=lr)

    def _interruption_reason(self, step: int) -> str:
        stop = self.client.stop_reason()
        if stop is not None:
            return stop
        return f"membership changed during step {step} (epoch {self.client.current_epoch()})"

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_microbatches`` fixed microbatches, split over the members."""
        assert self.group is not None
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for k in range(self.group.rank, self.cfg.train.eval_microbatches, self.group.size):
            inputs, targets = self.eval_sampler.microbatch(k)
            total[0] += float(self.microbatch_loss(inputs, targets))
            total[1] += 1
        self.model.train()
        if not wait_all([allreduce_async(self.group, total)], self.cfg.comm.op_timeout_s, self.interrupted):
            raise StopRun(self._interruption_reason(self.step))
        return float(total[0] / total[1])

    def should(self, every: int, step: int) -> bool:
        return step + 1 == self.cfg.train.steps or (every > 0 and (step + 1) % every == 0)

    def train(self) -> None:
        tc = self.cfg.train
        self.join()
        assert self.group is not None
        start = 0
        if self.client.resume() and self.leader:
            start = self.load_checkpoint()
        if self.client.resume():
            start = self.broadcast_state(0, start)
        self.step = start
        while self.step < tc.steps:
            if (reason := self.client.stop_reason()) is not None:
                raise StopRun(reason)
            t0 = time.perf_counter()
            outcome = self.train_step(self.step)
            elapsed = time.perf_counter() - t0
            self.publish(
                {
                    "type": "step",
                    "step": self.step,
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
                }
            )
            if self.should(tc.eval_every, self.step):
                val_loss = self.evaluate()
                self.publish(
                    {
                        "type": "eval",
                        "step": self.step,
                        "val_loss": val_loss,
                        "val_ppl": math.exp(min(val_loss, 50.0)),
                    }
                )
            if self.leader and self.should(self.cfg.checkpoint.every, self.step):
                t1 = time.perf_counter()
                path = ckpt.save_checkpoint(
                    self.run_dir,
                    self.step + 1,
                    self.checkpoint_state(self.step + 1),
                    self.cfg.checkpoint.keep,
                )
                self.publish(
                    {
                        "type": "checkpoint",
                        "step": self.step + 1,
                        "path": str(path),
                        "seconds": time.perf_counter() - t1,
                    }
                )
            self.step += 1
        self.finish()

    def finish(self) -> None:
        """Publish this worker's parameter checksum; the leader records all of them and marks the run done."""
        assert self.group is not None
        store = self.client.store
        store.set(f"final/{self.wid}", param_checksum(self.model))
        barrier = torch.zeros(1)
        if not wait_all([allreduce_async(self.group, barrier)], self.cfg.comm.op_timeout_s, self.interrupted):
            raise StopRun(self._interruption_reason(self.step))
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
            store.set("done", "ok")


def run_worker(address: str, worker_id: int | None, run_dir: str | None = None) -> int:
    """Entry point of ``unbroken worker``: join the job at ``address`` and train until it ends."""
    init_logger(f"worker {worker_id if worker_id is not None else '?'}")
    from unbroken.coordinator import connect_store

    probe = connect_store(address)
    cfg = config_from_toml_text(probe.get("config").decode())
    del probe
    client = CoordinatorClient(address, worker_id, cfg.comm.heartbeat_interval_s)
    init_logger(f"worker {client.worker_id}")
    local_workers = int(os.environ.get("UNBROKEN_LOCAL_WORKERS", "1"))
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))
    torch.set_num_threads(threads)
    worker = Worker(client, cfg, Path(run_dir) if run_dir else client.run_dir())
    try:
        worker.train()
    except StopRun as e:
        log.error("stopping: %s", e)
        if not str(e).startswith("coordinator") and client.stop_reason() is None:
            client.store.set("stop", f"worker {client.worker_id}: {e}")
        return 3
    finally:
        client.close()
    return 0
