"""The public API: fault tolerance inside the user's own training loop.

    import unbroken.ft as ft

    ctx = ft.init()                                   # joins the job named by the launcher's environment
    model = MyModel().to(ctx.device)                  # the worker's device: the CPU, or its own GPU
    opt = torch.optim.AdamW(model.parameters(), ...)
    ctx.register_state(model=model, optimizer=opt)    # what a rejoining worker receives, what checkpoints hold
    for step in ctx.steps():                          # resumes from the last checkpoint transparently
        for mb in step.microbatches():                # this worker's microbatch ids; more after a failure
            with ctx.autocast():                      # bf16 autocast under train.precision = "bf16"
                loss = loss_fn(model(*batch_for(step.index, mb)))   # the data: a pure function of (step, id)
            step.backward(loss)
        step.commit(opt)                              # the step's explicit end

Owns ``Context`` (the worker's handle on the job) and ``Step`` (one optimizer step), thin shells over the
step protocol (``protocol.StepProtocol``): ``microbatches()`` yields the ids the plan gives this worker and,
after the last one, reduces; if a member died meanwhile it recovers and yields the ids that were lost, so the
loop body runs for them too; ``commit`` applies the agreed gradient (or skips a non-finite one on every
member) and steps the optimizer. Nothing here raises into model code; when this worker must leave (the job
stops, it was excluded) the process ends with the status the launcher expects. An exception of the user's
code that nothing catches ends the worker once it has told the coordinator what and where (``crash``: the
step, and the microbatch whose loop body raised, are known here).

The run's ``[train]`` settings that act on the model are applied here too, so every loop gets them:
``register_state`` applies activation checkpointing, MeCeFO's efficient backward and ``torch.compile`` (in
that order, ``transforms.py``), ``Context.device`` is where the model and its data go, and
``Context.autocast`` is the precision of the forward.

A loop's data must be a pure function of (seed, step, id): ``Context.generator`` seeds it so, and the inputs
``Step.backward`` is given feed the data check (``datacheck``): once per membership epoch ``microbatches``
also yields, to the prober, another member's id, whose forward alone runs. Under a launcher, what this worker
prints while it leads the group also reaches the launcher's console (``control.console``). A mistake in the
use of any call here is one ``ValueError``.

Replicas of several ranks (``[parallel] shard`` / ``pipeline`` / ``tensor``, docs/parallel.md): ``Context.mesh``
is the replica's device mesh, its dimensions named ``pp``, ``shard`` and ``tensor`` (those above 1): split the
model on it (``tensor.apply_tensor_parallel`` on ``mesh["tensor"]``, then ``fsdp.apply_fsdp`` on
``mesh["shard"]``); ``Context.stage`` / ``stages`` say which pipeline stage this rank builds;
``Step.microbatches`` then yields this rank's ids round by round (a rank with nothing left in a round gets a
padding microbatch that counts for nothing; the tensor ranks of a shard compute the same ids together), and a
pipelined replica runs its microbatches with ``Step.pipeline`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from unbroken.control.console import install_tee
from unbroken.control.member.client import CoordinatorClient, Refused
from unbroken.control.store.gateway import TunnelError
from unbroken.core.config import ActivationCheckpointing, Precision, Reduction, RunConfig, load_config
from unbroken.core.failures import FailureSchedule
from unbroken.core.layout import DEFAULT_INCARNATION, INCARNATION_ENV, ReplicaLayout
from unbroken.core.records import ErrorPhase, RecordKind, check_script_record
from unbroken.core.throughput import table_peak_tflops
from unbroken.ft import comm, crash, datacheck, determinism, foldkernel, process
from unbroken.ft.inject import FaultInjector, remove
from unbroken.ft.mecefo import EfficientConfig, apply_efficient_backward
from unbroken.ft.protocol import (
    EXIT_COORDINATOR_LOST,
    EXIT_STOPPED,
    ProtocolConfig,
    StepProtocol,
    StopRun,
)

if TYPE_CHECKING:  # imported where a replica of several ranks needs them: they cost a worker about a second
    from torch.distributed.device_mesh import DeviceMesh

    from unbroken.ft.parallel.pipeline import BatchOf, Pipeline
    from unbroken.ft.parallel.replica import Replica
from unbroken.ft.state import StepOutcome, TrainingState
from unbroken.ft.transforms import apply_activation_checkpointing, apply_compile, check_compiler

log = logging.getLogger(__name__)

__all__ = ["Context", "Step", "StepOutcome", "init"]


class Context:
    """A worker's handle on the job: its config and run directory, registration of the training state, the
    steps, and a fault-tolerant evaluation. Made by ``init()``."""

    def __init__(self, job: process.Job) -> None:
        self._job = job
        self.config: RunConfig = job.config
        self.run_dir: Path = job.run_dir
        self.state = TrainingState()
        self._proto: StepProtocol | None = None
        self._client: CoordinatorClient | None = None
        self._closed = False
        self._autocasts = 0  # how many times autocast() was entered under bf16 (a forward outside it is warned)
        self._flops_per_token = 0.0
        self._warned_precision = False
        self._inputs_seen = False  # step.backward was given a microbatch's inputs (the data check can run)
        self.layout = ReplicaLayout.of(self.config.parallel)
        self._replica = self._join_replica() if self.layout.size > 1 else None
        self._pipeline: Pipeline | None = None
        self._current: Step | None = None  # the step the user's loop is in (or has just committed)
        self._evaluating = False  # inside evaluate()'s loss function
        install_tee(self._speaks_for_job, self._console_place)  # under a launcher: the leader's prints on its console
        atexit.register(self._at_exit)
        if job.exit_process and threading.current_thread() is threading.main_thread():
            crash.install(self._report_crash)

    def _speaks_for_job(self, before_joining: bool) -> bool:
        """Whether a line this worker prints goes to the launcher's console: while it publishes the group's
        records (the leader), or before it has joined, when the launcher said so (worker 0's first start)."""
        proto = self._proto
        return before_joining if proto is None else proto.publisher

    def _console_place(self) -> tuple[int | None, int]:
        """What a line this worker prints is tagged with on the launcher's console: its id, and the step it is in
        or has just committed (-1 before the first): the console shows it after that step's records."""
        return self._job.worker_id, self._current.index if self._current is not None else -1

    # -- a replica of several ranks -------------------------------------------------------------------
    def _join_replica(self) -> Replica:
        """Form this rank's replica (its own process group and mesh) with its replica-mates."""
        from unbroken.ft.parallel.replica import Replica

        job = self._job
        spare = job.worker_id is None and job.spare is not None  # a rank of a whole spare replica (control.agent)
        if (job.worker_id is None and not spare) or job.local is not None:
            raise ValueError(
                f"parallel.shard = {self.layout.shard}, parallel.pipeline = {self.layout.pipeline}, parallel.tensor "
                f"= {self.layout.tensor}: a replica of several ranks needs a job of several workers with known ids "
                "(unbroken launch / agent set UNBROKEN_WORKER_ID; torchrun sets RANK)"
            )
        try:
            return Replica(
                self.layout,
                job.spare if spare else job.worker_id,
                job.connect(),
                os.environ.get(INCARNATION_ENV, DEFAULT_INCARNATION),
                4 * self.config.comm.op_timeout_s,
                job.device,
                job.backend,
                self._replica_down,
                spare=spare,
            )
        except (RuntimeError, TunnelError) as e:
            self._replica_down(f"its ranks did not meet ({str(e).splitlines()[0] if str(e) else type(e).__name__})")

    def _replica_down(self, reason: str) -> NoReturn:
        """This rank's replica is down: end the process now (any thread; the replica restarts whole)."""
        log.error("leaving: %s", reason)
        self._job.leave(EXIT_STOPPED)
        raise AssertionError("leave() returned")  # pragma: no cover

    @property
    def mesh(self) -> DeviceMesh | None:
        """The replica's device mesh for a replica of several ranks: dimensions ``"pp"``, ``"shard"`` (apply FSDP2
        on it) and ``"tensor"`` (apply tensor parallelism on it), those above 1, outermost first; None for a
        replica of one rank."""
        return self._replica.mesh if self._replica is not None else None

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipelining): build that part of the model."""
        return self._replica.stage if self._replica is not None else 0

    @property
    def stages(self) -> int:
        """The pipeline stages of a replica (``parallel.pipeline``)."""
        return self.layout.pipeline

    # -- where and how precisely the model computes ------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This worker's device (``train.device``): the CPU, or under ``cuda`` the GPU of its index on its host
        (``LOCAL_RANK``, ``SLURM_LOCALID``, else its worker id modulo ``UNBROKEN_LOCAL_WORKERS``), already the
        current CUDA device. Put the model and each microbatch there."""
        return self._job.device

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision of the forward (``train.precision``), to enter around each microbatch's forward and
        loss (and an evaluation's): ``torch.autocast`` to bfloat16 on the model's device type under
        ``"bf16"``, nothing under ``"fp32"``. The weights, their gradients (what the reduction sums, in exact
        mode too) and the optimizer stay float32. Call ``step.backward`` after leaving it."""
        if self.config.train.precision is Precision.FP32:
            return contextlib.nullcontext()
        self._autocasts += 1
        return torch.autocast(self._device_type(), dtype=torch.bfloat16)

    def _device_type(self) -> str:
        model = self.state.model
        param = next(model.parameters(), None) if model is not None else None
        return param.device.type if param is not None else self.device.type

    def _check_autocast(self, seen: int) -> None:
        """Under bf16, a microbatch whose forward never entered ``autocast()``: warn once (it ran in float32)."""
        if self.config.train.precision is Precision.FP32 or self._warned_precision or self._autocasts != seen:
            return
        if torch.is_autocast_enabled(self._device_type()):
            return  # the user's own autocast, around the backward too
        self._warned_precision = True
        log.warning('train.precision = "bf16" but the forward ran outside ctx.autocast(): it computed in float32')

    # -- what the user registers ------------------------------------------------------------------
    def register_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        metadata: dict[str, str | int | float | bool] | None = None,
        flops_per_token: float = 0.0,
        **extra: Any,
    ) -> None:
        """Register the training state: ``model`` (its parameters are what the reduction sums), the
        ``optimizer``, and any ``extra`` objects with ``state_dict()`` / ``load_state_dict()`` (or plain dicts
        of tensors and numbers). A rejoining worker receives all of it from a live peer; checkpoints hold it
        with ``metadata``. ``flops_per_token``: the model's training FLOPs per token (forward and backward, e.g.
        ``6 * parameters + 12 * layers * width * sequence``; ``unbroken.core.flavours.flops_per_token`` for a
        LLaMA), for the MFU in the step records; 0 leaves MFU unknown. The model gets the transforms the config
        asks for here: activation checkpointing
        (``train.activation_checkpointing``), the efficient backward (MeCeFO policies), ``torch.compile``
        (``train.compile``), in that order (``unbroken/ft/transforms.py``).

        Raises:
            ValueError: called twice, after ``steps()``, an ``extra`` object without ``state_dict()`` and
                ``load_state_dict()`` (nor a dict), a MeCeFO policy with a model that has no LLaMA-family
                blocks, checkpointing or compile with a model that has no transformer blocks (an
                ``nn.ModuleList`` named ``layers``), or compile on the CPU without a C++ compiler.
        """
        if self.state.model is not None:
            raise ValueError("register_state() was already called; register everything at once")
        if flops_per_token < 0:
            raise ValueError(f"register_state(flops_per_token={flops_per_token}): must be >= 0 (0: unknown)")
        for name, obj in extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")) and not isinstance(obj, dict):
                raise ValueError(
                    f"register_state({name}=...): a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                    "register an object with both (an LR scheduler, an EMA) or a dict of tensors and numbers"
                )
        self.state.model = model
        self.state.optimizer = optimizer
        self.state.extra = dict(extra)
        self._flops_per_token = float(flops_per_token)
        self.state.metadata = dict(metadata or {})
        tc = self.config.train
        if tc.activation_checkpointing is ActivationCheckpointing.BLOCK:
            apply_activation_checkpointing(model)
        if self.config.recovery.policy.mecefo:
            m = self.config.mecefo
            self.state.efficient = apply_efficient_backward(
                model, EfficientConfig(m.rank, m.refresh_every, m.oversample, m.power_iters)
            )
        if tc.compile:
            if self._device_type() == "cpu":
                check_compiler()
            apply_compile(model)

    # -- the steps --------------------------------------------------------------------------------
    @property
    def worker_id(self) -> int:
        """This worker's id in the job (ValueError before ``steps()`` has started: it may not be known yet)."""
        if self._client is None:
            raise ValueError("ctx.worker_id is known once steps() has started")
        return self._client.worker_id

    @property
    def rank(self) -> int:
        """This worker's rank in the current group (0 is the leader, who writes checkpoints)."""
        return self._group("ctx.rank").rank

    @property
    def size(self) -> int:
        """How many workers are in the current group."""
        return self._group("ctx.size").size

    def _group(self, what: str) -> Any:
        """The current group, or ValueError naming ``what`` was asked before there is one."""
        if self._proto is None or self._proto.group is None:
            raise ValueError(f"{what} is known once steps() has started (the group forms there)")
        return self._proto.group

    def generator(self, step: int, microbatch: int, device: torch.device | str | None = None) -> torch.Generator:
        """A ``torch.Generator`` (CPU unless ``device``) seeded from (``train.seed``, ``step``, ``microbatch``), the
        same in every process: draw microbatch ``microbatch``'s data of step ``step`` from it, and whichever worker
        computes it gets the same data (``unbroken.ft.datacheck``)."""
        return datacheck.generator(self.config.train.seed, step, microbatch, device)

    def steps(self, total: int | None = None) -> Iterator[Step]:
        """The steps of the run, from the one the job is at (``--resume``: the last checkpoint's; a rejoining
        worker: the live members') to ``total`` (default ``config.train.steps``). Joins the job on first use.
        After the last step the final checkpoint is on disk and every member's parameters are recorded."""
        total = self.config.train.steps if total is None else total
        if total < 1:
            raise ValueError(f"steps(total={total}): must be >= 1")
        with self._guard():
            proto = self._join(total)
        while proto.state.step < total:
            if (reason := self._client.stopped) is not None:  # type: ignore[union-attr]
                self._leave(StopRun(reason))
            step = Step(self, proto, proto.state.step)
            self._current = step
            yield step
            if step._status in (_Status.OPEN, _Status.REDUCED) and proto.state.step == step.index:
                # Without it the next step would start on this one's reduced gradient (still in param.grad).
                raise ValueError(f"step {step.index}: call step.commit() before the next step")
        with self._guard():
            proto.finish()

    def _join(self, total: int) -> StepProtocol:
        if self._proto is not None:
            return self._proto
        if self.state.model is None:
            raise ValueError("call register_state(model=...) before steps()")
        job = self._job
        model = self.state.model
        device = next(model.parameters()).device
        if self.config.recovery.reduction is Reduction.EXACT and foldkernel.kernels_serve(device):
            foldkernel.warm()  # before the heartbeats start, not in the first backward (see warm)
        try:
            self._client = job.register()
        except Refused as e:  # exact mode: another fingerprint than the group's (core.numerics)
            raise StopRun(str(e), fatal=False) from None
        process.name_logs(f"worker {self._client.worker_id}")
        if self._replica is not None and self._replica.worker_id != self._client.worker_id:
            try:  # a rank of a spare replica, promoted
                self._replica.take_place(self._client.worker_id)
            except RuntimeError as e:
                self._replica_down(str(e))
        injector = FaultInjector(FailureSchedule.parse(self.config.failures.schedule))
        injector.attach(self._client.store, self._client.worker_id)
        self._proto = StepProtocol(
            ProtocolConfig.of(self.config),
            self._client,
            self.state,
            self.run_dir,
            injector,
            job.backend,
            device,
            self.layout.replicas(range(job.expected_workers())),  # MeCeFO's ring: the configured replicas
            total,
            self._replica,
        )
        self._proto.flops_per_token = self._flops_per_token
        self._proto.peak_tflops = _peak_tflops(device, self.config)
        if self._replica is not None:
            client = self._client
            # No news of a replica-mate's death within a heartbeat or two: the error was a bug, raised on every rank
            # (waiting the replica's collective timeout instead, 4 minutes by default, only delayed the bug's stop).
            self._replica.removed = lambda: client.wait_removed(self._news_s)
        self._proto.join(resume=job.resume(), late=self._client.late)
        return self._proto

    def evaluate(self, num_items: int, loss_of: Callable[[int], float], *, record: bool = True) -> float | None:
        """The mean of ``loss_of(k)`` over ``k in range(num_items)``, the items split over the members (each
        computes its share), recorded as the validation loss of the last committed step (an ``eval`` record;
        ``record=False``: only returned). None if a failure interrupted it, or the step it follows (the members
        may have recovered at different points: every one skips it): skip this evaluation (the protocol has
        already recovered, and the next step goes on as usual)."""
        proto = self._proto
        if proto is None or proto.group is None:
            raise ValueError("ctx.evaluate() runs between steps, once steps() has started")
        if self.layout.pipeline > 1:
            raise ValueError("under parallel.pipeline > 1, evaluate with evaluate_pipeline()")
        if proto.skips_evaluation:
            return None
        total = torch.zeros(2, dtype=torch.float64)
        # The items are split over every rank computing a forward of its own: the members, and under FSDP each
        # member's shards. A replica's ranks run as many forwards each (FSDP gathers the weights together):
        # one with fewer items runs item 0 again and ignores it.
        lanes = proto.group.size * self.layout.shard
        lane = proto.group.rank * self.layout.shard + (self._replica.shard if self._replica is not None else 0)
        rounds = math.ceil(num_items / lanes) if self._replica is not None else 0
        self._evaluating = True  # left set if loss_of raises: the crash report says where
        for k in range(lane, max(num_items, rounds * lanes), lanes):
            value = float(loss_of(k if k < num_items else 0))
            if k < num_items and self._counts_losses:
                total[0] += value
                total[1] += 1
        self._evaluating = False
        return self._mean_over_members(total, record)

    def evaluate_pipeline(
        self,
        num_items: int,
        batch_of: BatchOf,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        record: bool = True,
    ) -> float | None:
        """``evaluate`` for a pipelined replica: the mean loss of items ``batch_of(k) -> (inputs, targets)``,
        ``k < num_items``, each replica running its share through its pipeline (forward only)."""
        proto = self._proto
        if proto is None or proto.group is None:
            raise ValueError("ctx.evaluate_pipeline() runs between steps, once steps() has started")
        if proto.skips_evaluation:
            return None  # as ``evaluate`` says
        ids = list(range(proto.group.rank, num_items, proto.group.size))
        total = torch.zeros(2, dtype=torch.float64)
        if ids:
            with self._guard():
                losses = self.pipeline(loss_fn).evaluate(ids, batch_of)
            if self._counts_losses and (self._replica is None or self._replica.shard == 0):  # shards run alike
                total[0], total[1] = sum(losses), len(losses)
        return self._mean_over_members(total, record)

    @property
    def _counts_losses(self) -> bool:
        """Whether this rank's losses count: the tensor ranks of a replica compute the same ones, the first speaks."""
        return self._replica is None or self._replica.tensor == 0

    def _mean_over_members(self, total: torch.Tensor, record: bool) -> float | None:
        """The mean over the members of an evaluation (``total``: this rank's sum and count); with ``record``,
        published as the last committed step's ``eval`` record."""
        proto = self._proto
        assert proto is not None
        with self._guard():
            proto._combine_sum(total)
            if not proto.allreduce_interruptible(total):
                return None
            mean = float(total[0] / total[1])
            if record:
                step = proto.state.step - 1  # the parameters evaluated are those of the last committed step
                proto.publish(RecordKind.EVAL, step=step, val_loss=mean, val_ppl=math.exp(min(mean, 50.0)))
        return mean

    def pipeline(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Pipeline:
        """This rank's pipeline stage (the registered model) under its replica's schedule (``parallel.schedule``);
        ``loss_fn(output, target)`` is the mean loss of a microbatch, computed on the last stage."""
        proto, replica = self._proto, self._replica
        assert proto is not None and self.state.model is not None
        if replica is None or self.layout.pipeline == 1:
            raise ValueError("pipeline() needs parallel.pipeline > 1")
        if self._pipeline is None:
            from unbroken.ft.parallel.pipeline import Pipeline

            self._pipeline = Pipeline(
                self.state.model,
                replica.stage,
                self.layout.pipeline,
                next(self.state.model.parameters()).device,
                replica.stage_group,
                loss_fn,
                self.config.parallel.schedule,
                proto.reducer,
                proto.M,
            )
            eb = self.state.efficient
            if eb is not None:  # MeCeFO: each microbatch's forward on every stage in its plan's mode
                self._pipeline.before_forward = lambda j: eb.set_active(proto.is_efficient(j))
        self._pipeline.loss_fn = loss_fn
        return self._pipeline

    def log(self, kind: str, **fields: Any) -> None:
        """Publish a metrics record into the run's metrics.jsonl (the leader's; the others' calls do nothing):
        ``"eval"`` with ``step`` and ``val_loss`` (``val_ppl`` defaults to exp(val_loss); ``ctx.evaluate``
        records one itself), or ``"user"`` with any fields (numbers, strings, lists, dicts).

        Raises:
            ValueError: another kind, a missing field, a value JSON cannot hold, or before ``steps()``.
        """
        record_kind = check_script_record(kind, fields)
        if record_kind is RecordKind.EVAL and "val_ppl" not in fields:
            fields["val_ppl"] = math.exp(min(float(fields["val_loss"]), 50.0))
        if self._proto is None:
            raise ValueError(f"ctx.log({kind!r}, ...) publishes through the job: call it once steps() has started")
        with self._guard():
            self._proto.publish(record_kind, **fields)

    # -- leaving -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Around every call into the protocol: a decision to stop, or a broken connection to the coordinator,
        ends this worker (``_leave``); the user's code never sees either."""
        try:
            yield
        except StopRun as e:
            self._leave(e)
        except (RuntimeError, TunnelError) as e:
            if self._replica is not None:
                self._replica.collective_failed(e)  # leaves if the replica is down (a replica-mate died)
            if not self._connection_error(e):
                raise
            self._leave(StopRun(str(e).splitlines()[0] if str(e) else type(e).__name__))

    def _connection_error(self, e: Exception) -> bool:
        """A store call failed (the connection to the coordinator broke), as opposed to a bug: only an error
        raised by a call into the control plane is looked into (a ``RuntimeError`` of the user's backward or
        optimizer ends the worker as the bug it is, at once)."""
        client = self._client
        if client is None or not _raised_by_control_plane(e):
            return False
        return client.wait_lost(self._news_s) is not None

    @property
    def _news_s(self) -> float:
        """How long a failure takes at most to become news to the membership: a dead worker's agent reports its
        exit at once, a lost host or coordinator is found by silence (the heartbeat timeout), and one more
        heartbeat timeout and a second for the decision to reach this worker."""
        return 2 * self.config.comm.heartbeat_timeout_s + 1.0

    def _leave(self, e: StopRun) -> None:
        """This worker stops: say why, tell the others if the job must stop, and end (``process.leave``)."""
        client, proto = self._client, self._proto
        code = e.code
        if client is not None and client.lost == "coordinator":
            line = process.stop_without_coordinator(proto, self.run_dir)
            log.error("%s", line)
            code = EXIT_COORDINATOR_LOST
        elif client is not None and client.lost == "cut":
            log.error("stopping: %s; leaving the job (the others go on without this worker)", client.stopped)
            code = EXIT_STOPPED
        elif client is not None and client.done():
            log.info("the run finished before this worker could take part; leaving")
            code = 0
        else:
            log.error("stopping: %s", e)
            if e.fatal and client is not None:
                # The records published so far (the last committed step's) reach the file whoever stops first.
                client.flush_metrics(timeout_s=5.0)
            if e.fatal and client is not None and client.stopped is None:
                if e.shared and proto is not None and proto.group is not None and not proto.leader:
                    # The leader saw the same; it stops the job once its records are out. If it died
                    # meanwhile, stop it from here.
                    client.wait_stopped(2 * self.config.comm.heartbeat_timeout_s)
                if client.stopped is None:
                    client.stop_job(str(e))  # the coordinator records why (the first reason given)
            if client is not None and client.stopped is not None and client.named_to_save():
                client.tell_saved(process.save_at_stop(proto, self.run_dir))
        self.close()
        self._job.leave(code)

    def _where(self) -> tuple[ErrorPhase, int, int | None]:
        """Where the user's code is in the protocol: the phase, the step's index (-1 before the first) and the
        microbatch whose loop body runs (None outside one)."""
        step = self._current
        index = step.index if step is not None else -1
        if self._evaluating:
            return ErrorPhase.EVAL, index, None
        if step is None:
            return ErrorPhase.SETUP, index, None
        if step._committing:
            return ErrorPhase.COMMIT, index, None
        if step._body is not None:
            return ErrorPhase.MICROBATCH, index, step._body
        if step._status in (_Status.OPEN, _Status.REDUCED):
            return ErrorPhase.STEP, index, None
        return ErrorPhase.BETWEEN_STEPS, index, None

    def _report_crash(self, error: Exception) -> None:
        """``error`` ends this worker (nothing caught it): tell the coordinator what and where (``crash``), after
        the records already queued. An op without a deterministic implementation is no bug of the user's code
        but of the run's settings, the same on every worker: the job stops at once with the line that says so."""
        op = determinism.nondeterministic_op(error)
        if op is not None:
            self._leave(StopRun(determinism.stop_line(op), shared=True))
        client = self._client
        worker = client.worker_id if client is not None else self._job.worker_id
        report = crash.describe(error, -1 if worker is None else worker, *self._where())
        if client is not None:
            client.flush_metrics(timeout_s=2.0)
            told = client.report_error(report)
        else:
            told = self._job.report_error(report)
        if not told:
            log.error("could not tell the coordinator of this exception; ending")
            return
        log.info("the coordinator was told of this exception")
        if client is not None:
            # Its answer comes at once: a new epoch without this worker, or a stop for a bug, which may name this
            # worker to save the state it holds (nobody who did not raise is left).
            client.wait_removed(2 * self.config.comm.heartbeat_timeout_s)
            if client.stopped is not None and client.named_to_save():
                client.tell_saved(process.save_at_stop(self._proto, self.run_dir))

    def close(self) -> None:
        """Stop the heartbeats and watchers (done at exit; idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.close()
        self._job.close()

    def _at_exit(self) -> None:
        """The interpreter is exiting (a worker that leaves ends with ``os._exit`` and never comes here): helper
        threads that may be inside C++ (a group of an epoch published as the run ended, being formed ahead;
        MeCeFO's bases) must end first, or a thread returning into the finalizing interpreter aborts the process."""
        self.close()
        comm.settle(self.config.comm.op_timeout_s + 1.0)
        if self.state.efficient is not None:
            self.state.efficient.settle(self.config.comm.op_timeout_s)


class _Status:
    OPEN = "open"  # microbatches not finished yet
    REDUCED = "reduced"  # the gradient is agreed: commit() next
    COMMITTED = "committed"
    ELSEWHERE = "elsewhere"  # the others committed it while this worker recovered; it received their state


class Step:
    """One optimizer step: ``microbatches()``, ``backward()`` for each, then ``commit()``."""

    def __init__(self, ctx: Context, proto: StepProtocol, index: int) -> None:
        self._ctx = ctx
        self._proto = proto
        self.index = index
        self._status = _Status.OPEN
        self._awaiting: int | None = None
        self._started = time.perf_counter()
        self._t0 = 0.0
        self._hooks: list[Any] = []
        self._first = True
        self._factor = 1.0
        self._autocasts = 0
        self._padding = False
        self._body: int | None = None  # the microbatch whose loop body runs (the user's code), for a crash report
        self._committing = False
        self._probing = False  # the current microbatch is the data check's probe: its forward only
        self._probed = False
        self._saved: tuple[Any, ...] = ()  # what the probe's forward must not change: RNG states, buffers

    def microbatches(self) -> Iterator[int]:
        """The microbatch ids this worker computes in this step: its share of the plan, then, if a member died
        meanwhile, its share of the lost ones (so the loop body runs for those too). Call ``backward`` once
        per id. When the iteration ends, ``param.grad`` holds the step's agreed gradient."""
        if self._status is not _Status.OPEN:
            raise ValueError(f"step {self.index}: microbatches() was already iterated")
        if self._ctx.layout.pipeline > 1:
            raise ValueError("under parallel.pipeline > 1 a step runs its microbatches with step.pipeline()")
        proto, guard = self._proto, self._ctx._guard
        try:
            with guard():
                todo = proto.start_step()
            while not self._elsewhere(todo):
                lanes = _rounds(todo, self._ctx.layout.shard, self._ctx._replica)
                started = time.perf_counter()
                for k, (j, padding, round_ids) in enumerate(lanes):
                    with guard():
                        self._enter(j, first=k == 0, last=k == len(lanes) - 1, padding=padding)
                    self._body = j
                    yield j
                    self._body = None
                    if self._awaiting is not None:
                        raise ValueError(f"step {self.index}: call step.backward(loss) for microbatch {j}")
                    if round_ids is not None:
                        proto.round_done(round_ids)
                self._round_timed(started, len(lanes))
                if self._probe_due(bool(lanes)):
                    j = self._enter_probe()
                    yield j
                    if self._awaiting is not None:
                        raise ValueError(f"step {self.index}: call step.backward(loss) for microbatch {j}")
                todo_next = self._reduce()
                if todo_next is None:
                    return
                todo = todo_next
        finally:
            self._exit()

    def _round_timed(self, started: float, computed: int) -> None:
        """On a GPU: the seconds per microbatch of the round just computed, once its kernels have run (one wait
        for the compute stream a round; the gradients' reduction, on its own stream, goes on)."""
        device = self._proto.device
        if device.type != "cuda" or computed == 0:
            return
        torch.cuda.current_stream(device).synchronize()
        self._proto.note_speed((time.perf_counter() - started) / computed)

    def _probe_due(self, computed: bool) -> bool:
        """Whether this worker runs the data check's probe now: it is this step's prober, has not run it yet,
        and its loop gives the library its inputs (known from its own microbatches, if it had any)."""
        probe = self._proto.probe
        if probe is None or probe.prober != self._proto.unit or self._probed:
            return False
        self._probed = True
        return self._ctx._inputs_seen or not computed

    def _enter_probe(self) -> int:
        """The probe's microbatch comes next: only its forward runs (``backward`` takes its inputs' fingerprint
        and back-propagates nothing); the RNG states and the model's buffers it may change are put back then."""
        proto = self._proto
        assert proto.probe is not None and proto.state.model is not None
        cuda = proto.device.type == "cuda"
        buffers = [(b, b.detach().clone()) for b in proto.state.model.buffers()]
        self._saved = (torch.random.get_rng_state(), torch.cuda.get_rng_state(proto.device) if cuda else None, buffers)
        eb = proto.state.efficient
        if eb is not None:
            eb.set_active(False)
        self._probing = True
        self._awaiting = proto.probe.microbatch
        return proto.probe.microbatch

    @torch.no_grad()
    def _leave_probe(self, inputs: Any) -> None:
        proto = self._proto
        if inputs is not None:
            proto.probe_fps[1] = datacheck.fingerprint(inputs)
        cpu_rng, cuda_rng, buffers = self._saved
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, proto.device)
        for b, saved in buffers:
            b.copy_(saved)
        self._saved = ()
        self._probing = False
        self._awaiting = None

    def _elsewhere(self, todo: list[int]) -> bool:
        """The others committed this step while this worker recovered (it received their state): keep ``todo``,
        its share of the next step, for when that starts."""
        if self._proto.state.step == self.index:
            return False
        self._proto.pending_todo = todo
        self._status = _Status.ELSEWHERE
        return True

    def _reduce(self) -> list[int] | None:
        """Reduce this worker's microbatches: None once the step's gradient is agreed, else the ids to compute
        next (its share of those a failure lost, or all its own again after a fixed-point overflow)."""
        with self._ctx._guard():
            todo = self._proto.reduce_step()
        if todo is None:
            self._status = _Status.REDUCED
        return todo

    def pipeline(self, batch_of: BatchOf, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Under ``parallel.pipeline`` > 1, instead of ``microbatches()``: run this replica's microbatches through
        its pipeline (``batch_of(id) -> (inputs, targets)``, stacked along the first dimension; ``loss_fn(output,
        target)`` the mean loss of one microbatch, on the last stage), then, if a replica died meanwhile, its
        share of the lost ones. When it returns, ``param.grad`` holds the step's agreed gradient."""
        if self._status is not _Status.OPEN:
            raise ValueError(f"step {self.index}: its microbatches already ran")
        ctx, proto, guard = self._ctx, self._proto, self._ctx._guard
        model = proto.state.model
        assert model is not None
        with guard():
            pipe = ctx.pipeline(loss_fn)
            todo = proto.start_step()
        while not self._elsewhere(todo):
            proto.injector.step = self.index
            hooks = proto.injector.phase_hooks(model, first=True, last=True)
            started = time.perf_counter()
            # Under FSDP each shard's pipeline runs its lane of the rounds (a padding microbatch where a lane has
            # none left), so that every stage's ranks run as many backwards and reduce-scatters.
            lanes = _rounds(todo, ctx.layout.shard, ctx._replica)
            ids = [j for j, _, _ in lanes]
            padding = {i for i, (_, pad, _) in enumerate(lanes) if pad}
            try:
                with guard():
                    losses = pipe.run(ids, batch_of, padding) if ids else {}
            finally:
                remove(hooks)
                if proto.state.efficient is not None:
                    proto.state.efficient.set_active(False)
            proto.injector.slow_down(time.perf_counter() - started, len(ids))  # this rank (so its replica) slower
            if pipe.last:
                proto.pipelined(losses, {j: int(batch_of(j)[1].numel()) for j in losses})
            proto.round_done(todo, (time.perf_counter() - started) / max(1, len(todo)))
            todo_next = self._reduce()
            if todo_next is None:
                return
            todo = todo_next

    def _enter(self, microbatch: int, first: bool, last: bool, padding: bool = False) -> None:
        proto = self._proto
        proto.injector.step = self.index
        model = proto.state.model
        assert model is not None
        self._hooks = proto.injector.phase_hooks(model, first=first, last=last)
        self._hooks += proto.injector.poison_hook(model, first_of_step=self._first)
        self._first = False
        if last:
            proto.before_last_microbatch(microbatch)
        eb = proto.state.efficient
        if eb is not None:
            eb.set_active(proto.is_efficient(microbatch))
        self._awaiting = microbatch
        self._padding = padding
        proto.before_backward(microbatch, padding)
        self._factor = proto.injector.loss_factor(microbatch)
        self._autocasts = self._ctx._autocasts
        self._t0 = time.perf_counter()

    def _exit(self) -> None:
        remove(self._hooks)
        self._hooks = []
        eb = self._proto.state.efficient
        if eb is not None:
            eb.set_active(False)

    def backward(self, loss: torch.Tensor, tokens: int = 0, inputs: Any = None) -> None:
        """Back-propagate this microbatch's loss (its mean over its tokens); the library divides it by M, the
        microbatches of a step, so the step's gradient is their average whoever computed them. ``tokens``:
        how many tokens the microbatch trained on (for the step records' throughput). ``inputs``: the
        microbatch's input tensors (a tensor, or a tuple, list or dict of them), which the data check compares
        across workers (``unbroken.ft.datacheck``): give them, and data that is not a pure function of (seed,
        step, id) is caught."""
        j = self._awaiting
        if j is None:
            raise ValueError("step.backward() outside the microbatches() loop, or twice for one microbatch")
        if inputs is not None:
            datacheck.check_inputs(inputs)
            self._ctx._inputs_seen = True
        if self._probing:
            self._leave_probe(inputs)
            return
        proto = self._proto
        probe = proto.probe
        if inputs is not None and probe is not None and probe.microbatch == j:
            proto.probe_fps[0] = datacheck.fingerprint(inputs)
        self._ctx._check_autocast(self._autocasts)
        if self._factor != 1.0:
            loss = loss * self._factor
        if self._padding:
            loss = loss * 0.0  # a padding microbatch of a round: it takes part in FSDP's collectives only
        with self._ctx._guard():  # failure injection inside the backward talks to the launcher
            try:
                (loss / proto.M).backward()
            except RuntimeError as e:
                op = determinism.nondeterministic_op(e)
                if op is None:
                    raise
                raise StopRun(determinism.stop_line(op), shared=True) from None  # the same on every worker
        remove(self._hooks)
        self._hooks = []
        eb = proto.state.efficient
        if eb is not None:
            eb.set_active(False)
        elapsed = time.perf_counter() - self._t0
        elapsed += proto.injector.slow_down(elapsed)  # an injected slow-down: this worker computes slower
        self._awaiting = None
        if not self._padding:
            # On a GPU the time so far is the kernels' launch, not their run (timed per round, ``_round_timed``);
            # the loss stays on the device: nothing here waits for it.
            seconds = None if proto.device.type == "cuda" else elapsed
            proto.after_backward(j, loss.detach(), tokens, seconds)

    def commit(self, optimizer: torch.optim.Optimizer | None = None, clip_grad_norm: float = 0.0) -> StepOutcome:
        """End the step: unless the gradient is not finite (then the step is skipped on every member alike),
        clip it to ``clip_grad_norm`` (0: no clipping) and step ``optimizer`` (default: the registered one);
        then save the checkpoint if one is due. Returns what the step did (the others' outcome if they
        committed it while this worker was recovering)."""
        proto, ctx = self._proto, self._ctx
        if self._status == _Status.ELSEWHERE:
            self._status = _Status.COMMITTED
            return proto.state.last
        if self._status != _Status.REDUCED:
            raise ValueError(f"step {self.index}: iterate microbatches() to the end before commit()")
        optimizer = optimizer if optimizer is not None else proto.state.optimizer
        self._committing = True  # left set if the optimizer raises: the crash report says where
        with ctx._guard():
            outcome = proto.commit(optimizer, clip_grad_norm, time.perf_counter() - self._started)
            self._status = _Status.COMMITTED
            proto.save_checkpoint_if_due()
        self._committing = False
        return outcome


_CONTROL_PLANE = str(Path(__file__).resolve().parent.parent / "control") + os.sep


def _raised_by_control_plane(e: BaseException) -> bool:
    """Whether ``e`` was raised inside a call into the control plane (a store call, a new connection)."""
    return isinstance(e, TunnelError) or any(
        os.path.realpath(frame.f_code.co_filename).startswith(_CONTROL_PLANE)
        for frame, _ in traceback.walk_tb(e.__traceback__)
    )


def _rounds(todo: list[int], shard: int, replica: Replica | None) -> list[tuple[int, bool, list[int] | None]]:
    """This rank's microbatches of ``todo`` as (id, padding, the round's ids): a replica of ``shard`` FSDP ranks
    computes them in rounds of ``shard``, rank j taking the j-th id of each (a microbatch is never split over
    ranks, so its gradient is the same bits whoever computes it); a rank with none left in the last round
    runs the round's first id as padding. A replica of one rank: its ids, no rounds."""
    if replica is None:
        return [(j, False, None) for j in todo]
    out: list[tuple[int, bool, list[int] | None]] = []
    for start in range(0, len(todo), shard):
        ids = todo[start : start + shard]
        mine = replica.shard < len(ids)
        out.append((ids[replica.shard] if mine else ids[0], not mine, ids))
    return out


def _peak_tflops(device: torch.device, cfg: RunConfig) -> float:
    """One device's dense peak TFLOP/s for the MFU of the step records: ``train.peak_tflops``, else from the table
    of GPUs for the precision the matmuls run in (bf16 under autocast; tf32 where float32 matmuls may use it);
    0 (unknown) for the CPU or a GPU not in the table."""
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops
    if device.type != "cuda":
        return 0.0
    if cfg.train.precision is Precision.BF16:
        precision = "bf16"
    else:
        precision = "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"
    return table_peak_tflops(torch.cuda.get_device_name(device), precision) or 0.0


def init(
    config: RunConfig | str | os.PathLike[str] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    overrides: Sequence[str] = (),
) -> Context:
    """Join the job named by the environment (``UNBROKEN_COORDINATOR``, set by ``unbroken launch``, the
    per-host agent, or by hand under torchrun/srun with ``UNBROKEN_TOKEN``), or, without one, start a job of
    one worker in this process (``config``, a ``RunConfig`` or a TOML path, and ``run_dir`` then say what and
    where; defaults: the default config and ``runs/<script>-<time>``). ``overrides``: command-line arguments
    (e.g. ``sys.argv[1:]``) whose ``--section.key=value`` ones override the config's keys, as ``unbroken
    launch`` takes them; the others (the script's own) are left alone. Under a launcher the job's config is the
    coordinator's, and both are ignored (with a warning). Sets the process up for training (threads, logging,
    memory).

    Raises:
        ValueError: an override or the TOML names an unknown key or a bad value, or a ``RunConfig`` comes with
            overrides (give a path, or apply them to it yourself).
    """
    given = [a for a in overrides if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]]
    if isinstance(config, RunConfig):
        if given:
            raise ValueError(
                f"ft.init(config=RunConfig(...), overrides={given}): overrides apply to a TOML path or the defaults"
            )
        cfg: RunConfig | None = config
    else:
        cfg = load_config(config, given) if config is not None or given else None
    return Context(process.Job.from_environment(cfg, Path(run_dir) if run_dir is not None else None))
