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

Owns ``Context`` (the worker's handle on the job) and ``init``. ``Context.steps`` joins the job on first use:
it builds the step protocol (``protocol.StepProtocol``) on one ``stepcontext.StepContext`` (the settings, the
coordinator client, the training state, the fault hook: ``inject.phase_hook``, the null one when nothing is
scheduled) and yields ``step.Step`` objects, the thin shells the user's loop drives. Nothing here raises into
model code: every call into the protocol runs under ``leaving.Leaving.guard``, and when this worker must leave
(the job stops, it was excluded) the process ends with the status the launcher expects. An exception of the
user's code that nothing catches ends the worker once it has told the coordinator what and where (``crash``,
``Leaving.report_crash``). ``Context.evaluate`` is ``evaluation.Evaluation``'s.

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
model on it (``ft.apply_tensor_parallel`` on ``mesh["tensor"]``, then ``ft.apply_fsdp`` on ``mesh["shard"]``);
``Context.stage`` / ``stages`` say which pipeline stage this rank builds; ``Step.microbatches`` then yields this
rank's ids round by round (a rank with nothing left in a round gets a padding microbatch that counts for
nothing; the tensor ranks of a shard compute the same ids together), and a pipelined replica runs its
microbatches with ``Step.pipeline`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
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
from unbroken.ft import comm, crash, datacheck, foldkernel, process
from unbroken.ft.evaluation import Evaluation
from unbroken.ft.inject import phase_hook
from unbroken.ft.leaving import Leaving
from unbroken.ft.mecefo import EfficientBackward, EfficientConfig, apply_efficient_backward
from unbroken.ft.protocol import ProtocolConfig, StepProtocol, StopRun
from unbroken.ft.state import StepOutcome, TrainingState
from unbroken.ft.step import Autocast, Loop, Step
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.transforms import apply_activation_checkpointing, apply_compile, check_compiler

if TYPE_CHECKING:  # imported where a replica of several ranks needs them: they cost a worker about a second
    from torch.distributed.device_mesh import DeviceMesh

    from unbroken.ft.parallel.pipeline import BatchOf, Pipeline
    from unbroken.ft.parallel.replica import Replica

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
        self._evaluation: Evaluation | None = None
        self._leaving = Leaving(job, self._where, self.close)
        self._closed = False
        self._flops_per_token = 0.0
        self.layout = ReplicaLayout.of(self.config.parallel)
        self._replica = self._leaving.replica = (
            _form_replica(job, self.layout, self._leaving.replica_down) if self.layout.size > 1 else None
        )
        autocast = Autocast(self.config.train.precision, self.state, lambda: job.device)
        self._loop = Loop(self._leaving.guard, autocast, self.layout, self._replica, self.pipeline)
        self._pipeline: Pipeline | None = None
        self._current: Step | None = None  # the step the user's loop is in (or has just committed)
        install_tee(self._speaks_for_job, self._console_place)  # under a launcher: the leader's prints on its console
        atexit.register(self._at_exit)
        if job.exit_process and threading.current_thread() is threading.main_thread():
            crash.install(self._leaving.report_crash)

    def _speaks_for_job(self, before_joining: bool) -> bool:
        """Whether a line this worker prints goes to the launcher's console: while it publishes the group's
        records (the leader), or before it has joined, when the launcher said so (worker 0's first start)."""
        proto = self._proto
        return before_joining if proto is None else proto.membership.publisher

    def _console_place(self) -> tuple[int | None, int]:
        """What a line this worker prints is tagged with on the launcher's console: its id, and the step it is in
        or has just committed (-1 before the first): the console shows it after that step's records."""
        return self._job.worker_id, self._current.index if self._current is not None else -1

    # -- a replica of several ranks -------------------------------------------------------------------
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
        return self._loop.autocast()

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
        self.state.efficient = _apply_transforms(model, self.config, self._loop.autocast.device_type())

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
        if self._proto is None or self._proto.membership.group is None:
            raise ValueError(f"{what} is known once steps() has started (the group forms there)")
        return self._proto.membership.group

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
        with self._leaving.guard():
            proto = self._join(total)
        while proto.state.step < total:
            if (reason := self._client.stopped) is not None:  # type: ignore[union-attr]
                self._leaving.leave(StopRun(reason))
            step = Step(self._loop, proto, proto.state.step)
            self._current = step
            yield step
            if step._open and proto.state.step == step.index:
                # Without it the next step would start on this one's reduced gradient (still in param.grad).
                raise ValueError(f"step {step.index}: call step.commit() before the next step")
        with self._leaving.guard():
            proto.finish()

    def _join(self, total: int) -> StepProtocol:
        if self._proto is not None:
            return self._proto
        if self.state.model is None:
            raise ValueError("call register_state(model=...) before steps()")
        job = self._job
        device = next(self.state.model.parameters()).device
        if self.config.recovery.reduction is Reduction.EXACT and foldkernel.kernels_serve(device):
            foldkernel.warm()  # before the heartbeats start, not in the first backward (see warm)
        try:
            self._client = client = self._leaving.client = job.register()
        except Refused as e:  # exact mode: another fingerprint than the group's (core.numerics)
            raise StopRun(str(e), fatal=False) from None
        process.name_logs(f"worker {client.worker_id}")
        if self._replica is not None and self._replica.worker_id != client.worker_id:
            try:  # a rank of a spare replica, promoted
                self._replica.take_place(client.worker_id)
            except RuntimeError as e:
                self._leaving.replica_down(str(e))
        step_ctx = StepContext(
            ProtocolConfig.of(self.config),
            client,
            self.state,
            self.run_dir,
            phase_hook(FailureSchedule.parse(self.config.failures.schedule), client.store, client.worker_id),
            device,
            job.backend,
            self.layout,
            self._replica,
            self.layout.replicas(range(job.expected_workers())),  # MeCeFO's ring: the configured replicas
            total,
            self._flops_per_token,
            _peak_tflops(device, self.config),
        )
        self._proto = self._leaving.proto = proto = StepProtocol(step_ctx)
        self._evaluation = Evaluation(proto, self.layout, self._replica, self._leaving.guard)
        if self._replica is not None:
            # No news of a replica-mate's death within a heartbeat or two: the error was a bug, raised on every rank
            # (waiting the replica's collective timeout instead, 4 minutes by default, only delayed the bug's stop).
            self._replica.removed = lambda: client.wait_removed(self._leaving.news_s)
        proto.join(resume=job.resume(), late=client.late)
        return proto

    def evaluate(self, num_items: int, loss_of: Callable[[int], float], *, record: bool = True) -> float | None:
        """The mean of ``loss_of(k)`` over ``k in range(num_items)``, the items split over the members (each
        computes its share), recorded as the validation loss of the last committed step (an ``eval`` record;
        ``record=False``: only returned). None if a failure interrupted it, or the step it follows (the members
        may have recovered at different points: every one skips it): skip this evaluation (the protocol has
        already recovered, and the next step goes on as usual)."""
        return self._evaluator("ctx.evaluate()").evaluate(num_items, loss_of, record)

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
        evaluator = self._evaluator("ctx.evaluate_pipeline()")
        return evaluator.evaluate_pipeline(num_items, lambda: self.pipeline(loss_fn), batch_of, record)

    def _evaluator(self, what: str) -> Evaluation:
        evaluation = self._evaluation
        if evaluation is None or evaluation.proto.membership.group is None:
            raise ValueError(f"{what} runs between steps, once steps() has started")
        return evaluation

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
                proto.reduction.reducer,
                proto.M,
            )
            eb, plan = self.state.efficient, proto.plan
            if eb is not None:  # MeCeFO: each microbatch's forward on every stage in its plan's mode
                self._pipeline.before_forward = lambda j: eb.set_active(plan.is_efficient(j))
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
        with self._leaving.guard():
            self._proto.membership.publish(record_kind, **fields)

    # -- leaving -----------------------------------------------------------------------------------
    def _where(self) -> tuple[ErrorPhase, int, int | None]:
        """Where the user's code is in the protocol: the phase, the step's index (-1 before the first) and the
        microbatch whose loop body runs (None outside one)."""
        step = self._current
        index = step.index if step is not None else -1
        if self._evaluation is not None and self._evaluation.evaluating:
            return ErrorPhase.EVAL, index, None
        if step is None:
            return ErrorPhase.SETUP, index, None
        return (phase := step._where())[0], index, phase[1]

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


def _form_replica(job: process.Job, layout: ReplicaLayout, down: Callable[[str], NoReturn]) -> Replica:
    """Form this rank's replica (its own process group and mesh) with its replica-mates (``down``: the replica
    cannot form; this worker leaves)."""
    from unbroken.ft.parallel.replica import Replica

    spare = job.worker_id is None and job.spare is not None  # a rank of a whole spare replica (control.host.spares)
    if (job.worker_id is None and not spare) or job.local is not None:
        raise ValueError(
            f"parallel.shard = {layout.shard}, parallel.pipeline = {layout.pipeline}, parallel.tensor "
            f"= {layout.tensor}: a replica of several ranks needs a job of several workers with known ids "
            "(unbroken launch / agent set UNBROKEN_WORKER_ID; torchrun sets RANK)"
        )
    try:
        return Replica(
            layout,
            job.spare if spare else job.worker_id,
            job.connect(),
            os.environ.get(INCARNATION_ENV, DEFAULT_INCARNATION),
            4 * job.config.comm.op_timeout_s,
            job.device,
            job.backend,
            down,
            spare=spare,
        )
    except (RuntimeError, TunnelError) as e:
        down(f"its ranks did not meet ({str(e).splitlines()[0] if str(e) else type(e).__name__})")


def _apply_transforms(model: nn.Module, cfg: RunConfig, device_type: str) -> EfficientBackward | None:
    """The ``[train]`` transforms of the registered model, in order: activation checkpointing, MeCeFO's efficient
    backward (returned, or None), ``torch.compile``."""
    efficient = None
    if cfg.train.activation_checkpointing is ActivationCheckpointing.BLOCK:
        apply_activation_checkpointing(model)
    if cfg.recovery.policy.mecefo:
        m = cfg.mecefo
        efficient = apply_efficient_backward(
            model, EfficientConfig(m.rank, m.refresh_every, m.oversample, m.power_iters)
        )
    if cfg.train.compile:
        if device_type == "cpu":
            check_compiler()
        apply_compile(model)
    return efficient


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
