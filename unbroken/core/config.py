"""Run configuration: a frozen dataclass tree loaded from TOML with ``--section.key=value`` overrides.

Owns the schema (every section, its fields and their validation), loading, overriding and writing the
resolved config, and what a ``--resume`` may change of a run's config (``RESUME_FREE``, ``resume_config``).
Each component receives only its own section (``Trainer(cfg.train, ...)``), never the root. User mistakes
raise ``ValueError`` with a one-line message naming the key and what is allowed.

Precedence: command-line overrides > TOML file > dataclass defaults.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import shlex
import time
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from unbroken.core.atomic import write_sealed
from unbroken.core.records import RecordKind, append_records, make

FLAVOURS = ("tiny", "small", "60m", "130m", "350m", "1b", "7b")  # core.flavours.FLAVOURS (test_model checks)


class RecoveryPolicy(StrEnum):
    """What the survivors do when a worker dies (docs/library.md, "failures")."""

    RECOVER = "recover"  # ReCoVer: the lost microbatches are recomputed in the same step (same trajectory)
    DROP = "drop"  # torchft's behaviour: they are skipped and the gradient renormalised (the batch shrinks)
    RESTART = "restart"  # checkpoint-and-restart: every worker stops; the survivors restart from the last one
    MECEFO = "mecefo"  # MeCeFO: the dead worker's microbatches go to its ring neighbour, in efficient mode
    MECEFO_SPREAD = "mecefo-spread"  # ours: they are spread over every survivor, in efficient mode

    @property
    def mecefo(self) -> bool:
        return self in (RecoveryPolicy.MECEFO, RecoveryPolicy.MECEFO_SPREAD)


class Reduction(StrEnum):
    FP32 = "fp32"  # a SUM of float32 gradients (the order of summation changes with the membership)
    EXACT = "exact"  # each microbatch gradient summed as int64 fixed point: bitwise independent of who did what


class Workload(StrEnum):
    """How the microbatches of a step are spread over the alive workers."""

    EVEN = "even"  # equal quotas (the first M mod R workers get one more)
    THROUGHPUT = "throughput"  # quotas minimise the slowest worker's time given per-microbatch times


class SlowPolicy(StrEnum):
    """What the coordinator does about a fail-slow worker (control.coordinator.failslow: the rule that finds one)."""

    OFF = "off"  # nothing is watched
    REPORT = "report"  # a ``slow`` record and a warning; the run goes on unchanged
    REBALANCE = "rebalance"  # ... and workload = "throughput" while any worker is fail-slow
    EXCLUDE = "exclude"  # ... and the worker is removed like a failed one when that saves more than it costs


class NonfinitePolicy(StrEnum):
    SKIP = "skip"  # the whole step is skipped on every member (no optimizer step), and recorded
    STOP = "stop"  # the run stops, keeping the last good checkpoint


class Backend(StrEnum):
    AUTO = "auto"  # nccl with CUDA, else gloo
    GLOO = "gloo"
    NCCL = "nccl"


class HeartbeatMode(StrEnum):
    """Who sends a worker's heartbeats to the coordinator (``comm.heartbeats``; ``control.member.hostbeat``)."""

    WORKER = "worker"  # each worker: one store call every interval
    HOST = "host"  # the agent of the worker's host: one store call every interval for all its workers


class Precision(StrEnum):
    """The compute precision of the forward (docs/library.md, "Precision"); weights, gradients, their reduction
    and the optimizer stay float32 either way."""

    FP32 = "fp32"
    BF16 = "bf16"  # torch.autocast(device type, bfloat16) around forward and loss (Context.autocast)


class ActivationCheckpointing(StrEnum):
    NONE = "none"
    BLOCK = "block"  # every transformer block recomputes its forward in the backward (torch.utils.checkpoint)


class Device(StrEnum):
    AUTO = "auto"  # cuda when this host has a CUDA GPU, else cpu
    CPU = "cpu"
    CUDA = "cuda"  # one GPU per worker: the worker's index on its host (LOCAL_RANK-style, unbroken.ft.process)


class Determinism(StrEnum):
    """Whether a worker's kernels must give the same bits every time (docs/gpu.md, "Exact mode on GPUs")."""

    AUTO = "auto"  # on under recovery.reduction = exact, off otherwise
    ON = "on"  # torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG, cuDNN deterministic, no autotuning
    OFF = "off"  # the fastest kernels, reproducible or not


class PipelineSchedule(StrEnum):
    """The pipeline schedule of a replica's stages (``torch.distributed.pipelining``)."""

    ONE_F_ONE_B = "1f1b"  # Schedule1F1B (GPipe for a step where a replica runs fewer microbatches than stages)
    GPIPE = "gpipe"  # ScheduleGPipe


def _enum_fields(section: Any) -> None:
    """Store enum fields as their enum (a section built in code may be given the plain string); ValueError
    naming the key and what is allowed for an unknown value."""
    name = type(section).__name__.removesuffix("Config").lower()
    for f in fields(section):
        kind = typing.get_type_hints(type(section))[f.name]
        value = getattr(section, f.name)
        if isinstance(kind, type) and issubclass(kind, Enum) and not isinstance(value, kind):
            object.__setattr__(section, f.name, _coerce(f"{name}.{f.name}", value, kind))


def option(default: Any, help: str) -> Any:
    """A config field with its help text (``unbroken train --help`` lists every one)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    flavour: str = option("small", "the built-in LLaMA's size: " + ", ".join(FLAVOURS))
    vocab_size: int = option(0, "0: taken from the tokenizer; otherwise must be >= the tokenizer's vocabulary")
    n_kv_heads: int = option(0, "0: the flavour's default (grouped-query attention when < n_heads)")
    hf_config: str = option(
        "", 'train Hugging Face LlamaForCausalLM instead: a config.json path or a preset ("llama-tiny")'
    )

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ValueError(f"model.flavour = {self.flavour!r} is unknown; allowed: {', '.join(FLAVOURS)}")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size = {self.vocab_size} must be >= 0 (0 = from the tokenizer)")
        if self.n_kv_heads < 0:
            raise ValueError(f"model.n_kv_heads = {self.n_kv_heads} must be >= 0 (0 = flavour default)")


@dataclass(frozen=True)
class DataConfig:
    source: str = option(
        "shakespeare",
        '"shakespeare" (the embedded corpus); prepared data, read in place: a folder written by `unbroken '
        "prepare`, a Megatron/NeMo .bin/.idx dataset, nanoGPT or llm.c .bin files; or text, tokenized and "
        "cached on first use: a text file, a folder of text files, a .jsonl or .parquet file, or a folder "
        "written by datasets' save_to_disk",
    )
    text_field: str = option("text", "the field holding the text in JSONL, parquet and datasets sources")
    tokenizer: str = option(
        "",
        '"" trains a byte-level BPE on the training split (prepared data: uses its own); else a tokenizer.json '
        "path (prepared data: must be the one it was made with)",
    )
    vocab_size: int = option(
        8192,
        'size of the BPE trained when tokenizer = "" on text; unused with a tokenizer or prepared data (their '
        "vocabulary; for prepared data the run's config.toml records it here)",
    )
    seq_len: int = option(256, "tokens per sequence (the model sees seq_len inputs, predicts seq_len targets)")
    microbatch_size: int = option(4, "sequences per microbatch")
    val_fraction: float = option(0.05, "share of the text held out for validation (the tail of the corpus)")
    cache_dir: str = option(".cache/unbroken", "tokenizer and token arrays, keyed by a hash of the inputs")
    verify: bool = option(True, "prepared data: check every file's sha256 before training (false: sizes only)")

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError('data.source is empty; give "shakespeare", prepared data or a path to text data')
        if self.vocab_size < 256 or self.vocab_size > 2**20:
            raise ValueError(f"data.vocab_size = {self.vocab_size} must be in [256, 1048576]")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len = {self.seq_len} must be >= 2")
        if self.microbatch_size < 1:
            raise ValueError(f"data.microbatch_size = {self.microbatch_size} must be >= 1")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction = {self.val_fraction} must be in (0, 0.5)")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(200, "optimizer steps")
    schedule_steps: int = option(
        0,
        "the steps the LR warm-up and cosine span (0: train.steps); past them the final LR is held, so a run "
        "extended by --resume --train.steps=N keeps its schedule (--resume sets it)",
    )
    microbatches: int = option(8, "M: microbatches per step, fixed whatever the number of workers")
    lr: float = option(3e-3, "peak learning rate")
    warmup_fraction: float = option(0.1, "linear warm-up over this share of the steps")
    min_lr_ratio: float = option(0.1, "the cosine decays to lr * min_lr_ratio")
    weight_decay: float = option(0.01, "AdamW weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.999, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "max global gradient norm; 0 disables clipping")
    seed: int = option(0, "model init and data order")
    eval_every: int = option(50, "validation every this many steps (and at the end); 0 = only at the end")
    eval_microbatches: int = option(8, "validation microbatches per evaluation")
    threads: int = option(
        0,
        "torch intra-op threads per worker; 0 = OMP_NUM_THREADS if set, else 1 under recovery.reduction = exact "
        "(a worker's kernels then do not depend on how many workers share the host), else cores / workers here",
    )
    deterministic: Determinism = option(
        Determinism.AUTO,
        "auto (on under recovery.reduction = exact), on, off: deterministic kernels in every worker "
        "(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, cuDNN deterministic)",
    )
    retain_host_memory: bool = option(True, "keep freed host buffers in the heap (no page faults per step)")
    nonfinite: NonfinitePolicy = option(
        NonfinitePolicy.SKIP, "a NaN or infinite gradient: skip the step on every member, or stop the run"
    )
    max_nonfinite_skips: int = option(5, "stop after this many consecutive skipped steps")
    precision: Precision = option(
        Precision.FP32, "bf16: autocast the forward and loss to bfloat16 (float32 weights, gradients, reduction)"
    )
    activation_checkpointing: ActivationCheckpointing = option(
        ActivationCheckpointing.NONE, "block: recompute each transformer block's forward in the backward"
    )
    compile: bool = option(False, "torch.compile each transformer block (inductor; on CPU it needs a C++ compiler)")
    device: Device = option(Device.AUTO, "where each worker trains: cuda = one GPU per worker, the NCCL backend")
    workers_per_gpu: int = option(
        1, "workers sharing one GPU (for testing on a machine with fewer GPUs; > 1 needs comm.backend = gloo or auto)"
    )
    peak_tflops: float = option(
        0.0, "the device's peak TFLOP/s for MFU; 0 = from the table of common GPUs for train.precision (CPU: no MFU)"
    )
    out_dir: str = option("", '"" = runs/<config name>-<timestamp>')

    @property
    def schedule_length(self) -> int:
        """The steps the LR schedule spans (``schedule_steps``, 0: ``steps``)."""
        return self.schedule_steps or self.steps

    def __post_init__(self) -> None:
        _enum_fields(self)
        if self.steps < 1:
            raise ValueError(f"train.steps = {self.steps} must be >= 1")
        if self.schedule_steps < 0:
            raise ValueError(f"train.schedule_steps = {self.schedule_steps} must be >= 0 (0 = train.steps)")
        if self.microbatches < 1:
            raise ValueError(f"train.microbatches = {self.microbatches} must be >= 1 (M microbatches per step)")
        if not self.lr > 0:
            raise ValueError(f"train.lr = {self.lr} must be > 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"train.warmup_fraction = {self.warmup_fraction} must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay = {self.weight_decay} must be >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"train.{name} = {value} must be in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"train.eps = {self.eps} must be > 0")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip = {self.grad_clip} must be >= 0 (0 disables clipping)")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every = {self.eval_every} must be >= 0")
        if self.eval_microbatches < 1:
            raise ValueError(f"train.eval_microbatches = {self.eval_microbatches} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"train.seed = {self.seed} must be >= 0")
        if self.threads < 0:
            raise ValueError(f"train.threads = {self.threads} must be >= 0 (0 = automatic)")
        if self.max_nonfinite_skips < 1:
            raise ValueError(f"train.max_nonfinite_skips = {self.max_nonfinite_skips} must be >= 1")
        if self.workers_per_gpu < 1:
            raise ValueError(f"train.workers_per_gpu = {self.workers_per_gpu} must be >= 1")
        if self.peak_tflops < 0:
            raise ValueError(f"train.peak_tflops = {self.peak_tflops} must be >= 0 (0 = from the table of GPUs)")


@dataclass(frozen=True)
class CommConfig:
    backend: Backend = option(Backend.AUTO, "collectives between workers")
    bucket_mb: float = option(25.0, "gradient all-reduce bucket size (DDP's default); buckets overlap the backward")
    first_bucket_mb: float = option(1.0, "the first bucket closes at this size, so it overlaps the backward")
    op_timeout_s: float = option(60.0, "bound on any collective; past it the coordinator decides (retry, exclude)")
    heartbeat_interval_s: float = option(0.25, "how often a worker tells the coordinator it is alive")
    heartbeat_timeout_s: float = option(2.0, "a worker silent this long is declared dead (a hang, SIGSTOP)")
    heartbeats: HeartbeatMode = option(
        HeartbeatMode.WORKER,
        'who sends the heartbeats of workers an agent started: "worker" (each its own) or "host" (its agent, one '
        "store call for all of them: less load on the coordinator at scale; docs/control.md)",
    )
    join_timeout_s: float = option(120.0, "how long the coordinator waits for the expected workers at start")

    def __post_init__(self) -> None:
        _enum_fields(self)
        for name in (
            "bucket_mb",
            "first_bucket_mb",
            "op_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
            "join_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"comm.{name} = {getattr(self, name)} must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"comm.heartbeat_timeout_s = {self.heartbeat_timeout_s} must exceed "
                f"comm.heartbeat_interval_s = {self.heartbeat_interval_s}"
            )


@dataclass(frozen=True)
class RecoveryConfig:
    policy: RecoveryPolicy = option(RecoveryPolicy.RECOVER, "what the survivors do when a worker dies")
    workload: Workload = option(Workload.EVEN, "even, or throughput (a slow worker gets fewer microbatches)")
    reduction: Reduction = option(
        Reduction.FP32, "fp32, or exact (int64 fixed point: bitwise the failure-free run whoever computed what)"
    )
    slow: SlowPolicy = option(
        SlowPolicy.REPORT,
        "off; report a fail-slow worker (docs/goodput.md); rebalance (throughput workload while "
        "one is); or exclude it when that pays off",
    )
    slow_rejoin: bool = option(True, "an excluded fail-slow worker may come back (restarted as a failed one is)")
    slow_window: int = option(10, "fail-slow rule: steps per window")
    slow_windows: int = option(3, "fail-slow rule: consecutive slow windows that make a worker fail-slow")
    slow_ratio: float = option(1.5, "fail-slow rule: a window's median time over the other members' must exceed this")

    def __post_init__(self) -> None:
        _enum_fields(self)
        if self.slow_window < 2 or self.slow_windows < 1 or not self.slow_ratio > 1.0:
            raise ValueError(
                f"recovery.slow_window = {self.slow_window}, slow_windows = {self.slow_windows}, slow_ratio = "
                f"{self.slow_ratio}: needs slow_window >= 2, slow_windows >= 1 and slow_ratio > 1"
            )


@dataclass(frozen=True)
class MecefoConfig:
    rank: int = option(64, "rank r of the FFN weight-gradient projection in efficient mode")
    refresh_every: int = option(100, "the projection bases are recomputed every this many steps (tau)")
    oversample: int = option(16, "randomized SVD of the bases: extra columns of the range finder")
    power_iters: int = option(2, "randomized SVD of the bases: power iterations")

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"mecefo.rank = {self.rank} must be >= 1")
        if self.refresh_every < 1:
            raise ValueError(f"mecefo.refresh_every = {self.refresh_every} must be >= 1")
        if self.oversample < 0 or self.power_iters < 0:
            raise ValueError(f"mecefo.oversample = {self.oversample}, power_iters = {self.power_iters} must be >= 0")


@dataclass(frozen=True)
class FailureConfig:
    schedule: str = option(
        "",
        'injected failures, e.g. "kill:worker=2,step=10,phase=backward; hang:worker=1,step=5" '
        "(the grammar: unbroken/core/failures.py)",
    )
    mttr_s: float = option(0.0, "restart a worker that died (scheduled or not) after this many seconds; 0 = never")
    mtbf_s: float = option(0.0, "add seeded random kills with this mean time between failures; 0 = none")
    seed: int = option(0, "seed of the random kills")
    step_time_s: float = option(1.0, "expected seconds per step, to place random kills (given in seconds) on steps")
    scenario: str = option("", "MeCeFO's failure scenarios: low, mid or high (rule in unbroken/core/failures.py)")
    scenario_hours: float = option(64.0, "hours of the paper's cluster time the run's steps stand for")

    def __post_init__(self) -> None:
        if self.scenario not in ("", "low", "mid", "high"):
            raise ValueError(f"failures.scenario = {self.scenario!r} is unknown; allowed: low, mid, high")
        if not self.scenario_hours > 0:
            raise ValueError(f"failures.scenario_hours = {self.scenario_hours} must be > 0")
        for name in ("mttr_s", "mtbf_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"failures.{name} = {getattr(self, name)} must be >= 0")
        if not self.step_time_s > 0:
            raise ValueError(f"failures.step_time_s = {self.step_time_s} must be > 0")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = option(50, "save every this many steps (and at the end); 0 = only at the end")
    keep: int = option(3, "checkpoints kept on disk (older ones are deleted after a good save)")

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every = {self.every} must be >= 0 (0 = only at the end)")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep = {self.keep} must be >= 1")


@dataclass(frozen=True)
class CoordinatorConfig:
    state: str = option(
        "journal",
        'where the coordinator keeps the state that must outlive it: "journal" (a file in the run directory; '
        'unbroken train restarts a dead coordinator) or "etcd://host:port[,host:port...]" (a standby takes over)',
    )
    hold_s: float = option(60.0, "how long workers keep training and wait for a coordinator to come back")
    rejoin_window_s: float = option(10.0, "how long a restarted coordinator waits for the last members to return")
    lease_s: float = option(5.0, "etcd: the leader's lease; a standby takes over at most this long after it dies")
    status_port: int = option(0, "port of the live status page and JSON endpoint (0: any free port; -1: none)")
    status_host: str = option("127.0.0.1", "address the status page listens on (other hosts need the job's token)")
    news_relay: bool = option(
        False,
        "experimental: each host's agent watches the coordinator's epochs and stop once and relays them to its "
        "workers over a Unix socket (false: every worker watches the coordinator itself; docs/control.md)",
    )

    def __post_init__(self) -> None:
        if self.state != "journal" and not self.state.startswith("etcd://"):
            raise ValueError(
                f'coordinator.state = {self.state!r} is unknown; allowed: "journal", "etcd://HOST:PORT,..."'
            )
        for name in ("hold_s", "rejoin_window_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"coordinator.{name} = {getattr(self, name)} must be > 0")
        if not -1 <= self.status_port <= 65535:
            raise ValueError(f"coordinator.status_port = {self.status_port} must be -1 (none), 0 (any) or a port")


@dataclass(frozen=True)
class ParallelConfig:
    shard: int = option(1, "FSDP2 ranks per replica (HSDP: sharded inside a replica, replicated across replicas)")
    pipeline: int = option(1, "pipeline stages per replica (torch.distributed.pipelining)")
    tensor: int = option(1, "tensor-parallel ranks per replica (torch's parallelize_module: Megatron-style TP)")
    sequence_parallel: bool = option(
        False, "with parallel.tensor > 1: the norms work on a rank's share of the sequence"
    )
    schedule: PipelineSchedule = option(PipelineSchedule.ONE_F_ONE_B, "the pipeline schedule")

    def __post_init__(self) -> None:
        _enum_fields(self)
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError(
                "parallel.sequence_parallel = true needs parallel.tensor > 1 (it splits the sequence over them)"
            )
        for name in ("shard", "pipeline", "tensor"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} = {getattr(self, name)} must be >= 1")


@dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = option(False, "also write TensorBoard event files (needs the tensorboard extra)")
    goodput_every: int = option(
        50, "a goodput record (core.goodput: the account so far) every N committed steps; 0: none"
    )
    alert_command: str = option("", "run on each alert with its JSON on stdin (control.alerts); empty: none")
    alert_webhook: str = option("", "an http(s) URL to POST each alert's JSON to; empty: none")
    alert_goodput: float = option(0.0, "alert when goodput stays below this fraction of the ideal; 0: never")
    alert_goodput_minutes: float = option(10.0, "... for this many minutes")

    def __post_init__(self) -> None:
        if self.goodput_every < 0:
            raise ValueError(f"metrics.goodput_every = {self.goodput_every} must be >= 0 (0: no goodput records)")
        try:
            words = shlex.split(self.alert_command)
        except ValueError as e:
            raise ValueError(f"metrics.alert_command = {self.alert_command!r}: {e}; give a command line") from None
        if self.alert_command and not words:
            raise ValueError(f"metrics.alert_command = {self.alert_command!r} names no program; give one, or ''")
        if self.alert_webhook and not self.alert_webhook.startswith(("http://", "https://")):
            raise ValueError(f"metrics.alert_webhook = {self.alert_webhook!r} must be an http:// or https:// URL")
        if not 0.0 <= self.alert_goodput < 1.0 or not self.alert_goodput_minutes > 0:
            raise ValueError(
                f"metrics.alert_goodput = {self.alert_goodput}, alert_goodput_minutes = {self.alert_goodput_minutes}: "
                "needs 0 <= alert_goodput < 1 (a fraction of the ideal; 0: never) and minutes > 0"
            )


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    mecefo: MecefoConfig = field(default_factory=MecefoConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.train.workers_per_gpu > 1 and self.comm.backend is Backend.NCCL:
            raise ValueError(
                f"train.workers_per_gpu = {self.train.workers_per_gpu} with comm.backend = nccl: NCCL refuses two "
                "ranks on one GPU; use comm.backend = gloo (or auto, which picks gloo then)"
            )
        if self.parallel.sequence_parallel and self.parallel.tensor > 1 and self.recovery.policy.mecefo:
            raise ValueError(
                f"recovery.policy = {self.recovery.policy} with parallel.sequence_parallel (the FFN's input split by "
                "sequence) is not supported; use sequence_parallel = false, or policy recover, drop or restart"
            )


def deterministic_kernels(cfg: RunConfig) -> bool:
    """Whether the run's workers use deterministic kernels (``train.deterministic``; auto: under exact mode)."""
    setting = cfg.train.deterministic
    return setting is Determinism.ON or (setting is Determinism.AUTO and cfg.recovery.reduction is Reduction.EXACT)


def _field_type(cls: type, name: str) -> type:
    hints = typing.get_type_hints(cls)
    return hints[name]


def _coerce(key: str, value: Any, expected: type) -> Any:
    """Return ``value`` as ``expected`` or raise a one-line ValueError naming ``key``."""
    origin = typing.get_origin(expected)
    if origin in (types.UnionType, typing.Union):
        raise AssertionError(f"union field types are not supported in config ({key})")
    if origin is tuple:  # tuple[str, ...] or tuple[SomeEnum, ...]: a TOML array of strings
        item, ellipsis = typing.get_args(expected)
        assert ellipsis is Ellipsis, f"unsupported config field type {expected} for {key}"
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(_coerce(key, v, item) for v in value) if item is not str else tuple(value)
        raise ValueError(f"{key} = {value!r} has the wrong type; expected a list of strings")
    if isinstance(expected, type) and issubclass(expected, Enum):
        allowed = ", ".join(str(m.value) for m in expected)
        if isinstance(value, str):
            try:
                return expected(value)
            except ValueError:
                raise ValueError(f"{key} = {value!r} is unknown; allowed: {allowed}") from None
        raise ValueError(f"{key} = {value!r} has the wrong type; expected one of {allowed}")
    if expected is bool:
        if isinstance(value, bool):
            return value
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif expected is str:
        if isinstance(value, str):
            return value
    else:
        raise AssertionError(f"unsupported config field type {expected} for {key}")
    raise ValueError(f"{key} = {value!r} has the wrong type; expected {expected.__name__}")


def _parse_override_value(key: str, text: str, expected: type) -> Any:
    """Parse the text of ``--key=text`` into the field's type (a list of strings is comma-separated)."""
    if expected is str or (isinstance(expected, type) and issubclass(expected, Enum)):
        return text
    if typing.get_origin(expected) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if expected is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key} = {text!r} has the wrong type; expected bool (true or false)")
    try:
        if expected is int:
            return int(text)
        if expected is float:
            return float(text)
    except ValueError:
        raise ValueError(f"{key} = {text!r} has the wrong type; expected {expected.__name__}") from None
    raise AssertionError(f"unsupported config field type {expected} for {key}")


def _section_types(root: type) -> dict[str, type]:
    """Section name -> section dataclass of a config tree such as ``RunConfig``."""
    return typing.get_type_hints(root)


def _build(raw: dict[str, Any], where: str, root: type = RunConfig) -> Any:
    section_types = _section_types(root)
    sections: dict[str, Any] = {}
    for section_name, section_values in raw.items():
        if section_name not in section_types:
            allowed = ", ".join(section_types)
            raise ValueError(f"unknown config section [{section_name}] in {where}; allowed: {allowed}")
        cls = section_types[section_name]
        if not isinstance(section_values, dict):
            raise ValueError(f"{section_name} in {where} must be a table [{section_name}], not a value")
        names = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in section_values.items():
            if key not in names:
                raise ValueError(
                    f"unknown config key {section_name}.{key} in {where}; "
                    f"allowed in [{section_name}]: {', '.join(sorted(names))}"
                )
            kwargs[key] = _coerce(f"{section_name}.{key}", value, _field_type(cls, key))
        sections[section_name] = cls(**kwargs)
    return root(**sections)


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """``["--train.steps=10", "--data.source=x"]`` -> ``{"train": {"steps": "10"}, ...}`` (still text)."""
    out: dict[str, dict[str, str]] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
            raise ValueError(f"override {arg!r} is malformed; expected --section.key=value")
        dotted, value = arg[2:].split("=", 1)
        section, key = dotted.split(".", 1)
        out.setdefault(section, {})[key] = value
    return out


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML file (or the defaults when ``path`` is None) and apply ``--section.key=value`` overrides.

    Raises:
        ValueError: the file is missing or malformed, a section or key is unknown, a value has the wrong
            type or is out of range. The message is one line and names the key or path.
    """
    return load_tree(RunConfig, path, overrides)


def load_tree(root: type, path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> Any:
    """``load_config`` for any frozen dataclass tree whose fields are its sections (the simulator's scenario)."""
    section_types = _section_types(root)
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {where} does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {where} is not valid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"config file {where} is not UTF-8 text") from None
    for section, values in parse_overrides(overrides or []).items():
        if section not in section_types:
            raise ValueError(f"unknown config section in override --{section}.*; allowed: {', '.join(section_types)}")
        cls = section_types[section]
        names = {f.name for f in fields(cls)}
        for key, text in values.items():
            if key not in names:
                raise ValueError(
                    f"unknown config key {section}.{key} in override; "
                    f"allowed in [{section}]: {', '.join(sorted(names))}"
                )
            raw.setdefault(section, {})
            if not isinstance(raw[section], dict):
                raise ValueError(f"{section} in {where} must be a table [{section}], not a value")
            raw[section][key] = _parse_override_value(f"{section}.{key}", text, _field_type(cls, key))
    return _build(raw, where, root)


def config_from_toml_text(text: str) -> RunConfig:
    """Rebuild a config from the TOML text written by ``dump_config`` (workers get it from the coordinator)."""
    return _build(tomllib.loads(text), "resolved config")


def to_toml(cfg: Any) -> str:
    """The resolved config (a ``RunConfig`` or another tree ``load_tree`` reads) as TOML text: every section
    and every field, so a run can be reproduced."""
    lines: list[str] = []
    for section_name in (f.name for f in fields(cfg)):
        section = getattr(cfg, section_name)
        lines.append(f"[{section_name}]")
        for f in fields(section):
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, Enum):
        return _toml_value(str(value.value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} as TOML")


def _write_atomic(path: Path, text: str) -> None:
    write_sealed(path, text.encode(), path.with_suffix(".toml.tmp"))


def dump_config(cfg: RunConfig, out_dir: str | os.PathLike[str]) -> Path:
    """Write the resolved config to ``out_dir/config.toml`` atomically and return its path."""
    path = Path(out_dir) / "config.toml"
    _write_atomic(path, to_toml(cfg))
    return path


def dump_resumed_config(cfg: RunConfig, out_dir: str | os.PathLike[str], changes: list[KeyChange]) -> str:
    """A resumed session's ``changes`` (``config_changes``), written before its coordinator starts: its config
    becomes ``out_dir/config.toml`` (every reader gets the config in force), the one it replaces is kept as
    ``config.N.toml`` (N = 1, 2, ... numbers the run's configs in order: ``config.1.toml`` is the first session's,
    nothing is lost), and a ``config_change`` record in metrics.jsonl lists the changes. Returns the kept name."""
    out = Path(out_dir)
    n = 1
    while (out / f"config.{n}.toml").exists():
        n += 1
    kept = out / f"config.{n}.toml"
    _write_atomic(kept, (out / "config.toml").read_text())
    dump_config(cfg, out)
    record = make(RecordKind.CONFIG_CHANGE, time.time(), changes=[c.as_json() for c in changes], kept=kept.name)
    append_records(out, [record])
    return kept.name


def replace(section: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` re-exported so callers derive configs without mutating them. A change given as the
    value of an enum-typed key (``reduction="exact"``) becomes that enum's member, as a TOML file's would: code
    that compares with ``is Reduction.EXACT`` must see the same value whichever way the config was made.

    Raises:
        ValueError: a value that is not one of the enum's."""
    hints = typing.get_type_hints(type(section))
    for name, value in changes.items():
        kind = hints.get(name)
        if isinstance(kind, type) and issubclass(kind, Enum) and not isinstance(value, kind):
            try:
                changes[name] = kind(value)
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in kind)
                raise ValueError(f"{name} = {value!r}: must be one of {allowed}") from None
    return dataclasses.replace(section, **changes)


def preset_path(name: str, suffix: str = ".toml") -> Path:
    """The config shipped with the package as ``unbroken/configs/<name><suffix>`` (``tiny``, ``default``,
    ``sim/recover_512``, ``hf_llama_tiny`` with ``.json``, ...); ValueError (one line) if there is none."""
    path = Path(str(importlib.resources.files("unbroken") / "configs" / f"{name}{suffix}"))
    if not path.is_file():
        raise ValueError(f"no packaged config named {name!r} ({path})")
    return path


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    if typing.get_origin(tp) is tuple:
        return "list of " + _type_name(typing.get_args(tp)[0])
    return getattr(tp, "__name__", str(tp))


# What configures the built-in trainer (``unbroken train``: its model, data and optimizer) and nothing in a
# script's run (``unbroken launch``, ``unbroken.ft``), whose model, data and optimizer are its own: a script may
# read them from ``ctx.config``, but the library does not act on them. Sections, or ``section.key``.
TRAINER_ONLY = frozenset(
    {"model", "data"}
    | {f"train.{k}" for k in ("lr", "warmup_fraction", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps")}
    | {"train.grad_clip", "train.eval_every", "train.eval_microbatches", "train.schedule_steps"}
)


# What a resumed session may change freely (``resume_config``): the keys that decide where and how fast the same
# computation runs (workers and their layout, threads, kernels, device), how it is watched and saved (evaluation,
# metrics, checkpoints, the control plane) and which faults are injected. Every other key changes what the run
# computes, its trajectory: the model, the data, the optimizer and the LR schedule, M (train.microbatches), the
# seed, the reduction, the precision, the recovery policy and MeCeFO's approximation. train.steps is neither: a
# resume may change it, the schedule kept (train.schedule_steps). Sections, or ``section.key``.
RESUME_FREE = frozenset(
    {"comm", "failures", "checkpoint", "coordinator", "parallel", "metrics"}
    | {"data.cache_dir", "data.verify"}
    | {f"train.{k}" for k in ("eval_every", "eval_microbatches", "threads", "deterministic", "retain_host_memory")}
    | {f"train.{k}" for k in ("nonfinite", "max_nonfinite_skips", "activation_checkpointing", "compile", "device")}
    | {"train.workers_per_gpu", "train.peak_tflops", "train.out_dir"}
    | {f"recovery.{k}" for k in ("workload", "slow", "slow_rejoin", "slow_window", "slow_windows", "slow_ratio")}
)


@dataclass(frozen=True)
class KeyChange:
    """A key to which a resumed session gives another value than the run's config (``config_changes``): the
    values as JSON holds them, and whether the change alters what the run computes (``RESUME_FREE``)."""

    key: str  # section.key
    old: Any
    new: Any
    trajectory: bool

    def words(self) -> str:
        """``train.lr = 0.003 -> 0.001``."""
        return f"{self.key} = {json.dumps(self.old)} -> {json.dumps(self.new)}"

    def as_json(self) -> dict[str, Any]:
        """Its form in a ``config_change`` record (``core.records``)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> KeyChange:
        return KeyChange(str(data["key"]), data["old"], data["new"], bool(data["trajectory"]))


def _plain(value: Any) -> Any:
    """A config value as JSON holds it (an enum by its value, a tuple as a list)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _changes_trajectory(key: str, old: RunConfig, new: RunConfig) -> bool:
    if key == "train.steps":
        return False  # the schedule's own length is train.schedule_steps
    if key == "train.schedule_steps":
        return old.train.schedule_length != new.train.schedule_length
    return key not in RESUME_FREE and key.split(".", 1)[0] not in RESUME_FREE


def config_changes(old: RunConfig, new: RunConfig) -> list[KeyChange]:
    """Every key whose value differs between ``old`` and ``new``, in the schema's order."""
    changes = []
    for section in fields(old):
        before, after = getattr(old, section.name), getattr(new, section.name)
        for f in fields(before):
            a, b = getattr(before, f.name), getattr(after, f.name)
            if a != b:
                key = f"{section.name}.{f.name}"
                changes.append(KeyChange(key, _plain(a), _plain(b), _changes_trajectory(key, old, new)))
    return changes


def describe_changes(changes: list[KeyChange]) -> str:
    """One line: ``train.steps = 8 -> 12, train.lr = 0.003 -> 0.001 (changing what the run computes)``."""
    return ", ".join(c.words() + (" (changing what the run computes)" if c.trajectory else "") for c in changes)


def config_change_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line for each ``config_change`` record of a run's records (every session, in file order): the step its
    session resumed at (its ``resume`` record), the changes, and the file that keeps the config it replaced."""
    lines = []
    for i, r in enumerate(records):
        if r.get("type") != RecordKind.CONFIG_CHANGE:
            continue
        at = next((x.get("step") for x in records[i + 1 :] if x.get("type") == RecordKind.RESUME), None)
        where = f"at step {at}" if at is not None else "at a resume"
        changes = describe_changes([KeyChange.from_json(c) for c in r.get("changes", [])])
        lines.append(f"{where}: {changes}; the earlier config is {r.get('kept')}")
    return lines


def resume_config(
    stored: RunConfig, requested: RunConfig, steps_done: int, allow_changes: bool, where: str
) -> RunConfig:
    """The config a resumed session runs with: ``requested`` (the run's ``stored`` config with the session's
    overrides, or the config a coordinator was given) with the LR schedule kept: where ``requested`` leaves
    ``train.schedule_steps`` at 0 and the run's length or schedule differs, it is set to the run's schedule length,
    so more (or fewer) ``train.steps`` continue the same schedule and hold its final LR past its end.

    Raises:
        ValueError (one line, naming ``where``): ``train.steps`` is below ``steps_done``; or a key outside
            ``RESUME_FREE`` changes (listed with its old and new value) and not ``allow_changes``.
    """
    tc = requested.train
    if tc.steps < steps_done:
        raise ValueError(
            f"{where}: train.steps = {tc.steps} is fewer than the {steps_done} steps the run has done (its newest "
            f"checkpoint); give train.steps >= {steps_done}"
        )
    if tc.schedule_steps == 0 and (stored.train.schedule_steps or tc.steps != stored.train.steps):
        requested = dataclasses.replace(
            requested, train=dataclasses.replace(tc, schedule_steps=stored.train.schedule_length)
        )
    refused = [c for c in config_changes(stored, requested) if c.trajectory]
    if refused and not allow_changes:
        raise ValueError(
            f"{where}: {', '.join(c.words() for c in refused)} would change what the run computes; a resume keeps "
            "the run's config but for train.steps and the keys that leave its trajectory alone (README.md, "
            '"Resuming a run"); add --resume-with-changes to change it anyway (recorded in metrics.jsonl, the '
            "earlier config kept)"
        )
    return requested


def describe(
    root: type = RunConfig, sections: tuple[str, ...] | None = None, skip: frozenset[str] = frozenset()
) -> str:
    """Every section and key of a config tree with its type, default and help, as ``--help`` lists them (but
    the sections and ``section.key``s in ``skip``)."""
    lines = []
    for section_name, cls in _section_types(root).items():
        if (sections is not None and section_name not in sections) or section_name in skip:
            continue
        lines.append(f"[{section_name}]")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f"{section_name}.{f.name}" in skip:
                continue
            default = f.default.value if isinstance(f.default, Enum) else f.default
            shown = (
                f'"{default}"'
                if isinstance(default, str)
                else str(default).lower()
                if isinstance(default, bool)
                else default
            )
            help_text = f.metadata.get("help", "")
            lines.append(f"  --{section_name}.{f.name}  ({_type_name(hints[f.name])}; default {shown})")
            if help_text:
                lines.append(f"      {help_text}")
    return "\n".join(lines)
