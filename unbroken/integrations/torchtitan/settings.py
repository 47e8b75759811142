"""What each side owns: a torchtitan job's settings checked against the unbroken job, and mapped onto it.

``own(config, run)`` takes the user's torchtitan ``Trainer.Config`` and the job's ``RunConfig`` before the
Trainer is built, and either adapts the torchtitan config (returning one line per setting changed) or raises
``ValueError`` with one line naming the setting it cannot honour and what is allowed. Who owns what:

- torchtitan keeps its model and model registry, ``parallelize_fn`` (FSDP2 and tensor parallelism inside a
  replica, activation checkpointing, ``torch.compile``, its mixed precision), its optimizer and LR-schedule
  containers and its tokenizer.
- unbroken owns the job: the layout (``--workers``, ``[parallel] shard`` / ``tensor``: torchtitan's
  ``data_parallel_shard_degree`` and ``tensor_parallel_degree`` follow it, or must equal it), the steps
  (``train.steps``: torchtitan's ``training.steps`` takes its value, so its LR schedule spans the run), the
  microbatches (``train.microbatches`` of ``training.local_batch_size`` sequences: torchtitan's gradient
  accumulation is off), the seed (``train.seed``, unless ``debug.seed`` is set), the loss normalisation (the
  mean over a microbatch's tokens, averaged over the M microbatches), clipping (``training.max_norm``, applied
  by ``step.commit``), the data (``unbroken.data``, ``data.py``), the checkpoints (``[checkpoint]``, DCP; the
  torchtitan checkpointer only loads, once, the model of a torchtitan checkpoint the job starts from,
  ``checkpoint.initial_load_path``; ``checkpoint.py`` writes a job's checkpoint in torchtitan's layout).
- Switched off: torchtitan's chunked loss (``ChunkedLossWrapper`` calls backward inside the loss function: its
  inner loss runs on the whole output instead), its dataloader, its gradient accumulation.
- Refused: torchtitan's own fault tolerance (a ``fault_tolerance`` section enabled), pipeline, context and
  expert parallelism, ``data_parallel_replicate_degree`` (unbroken's replicas are the data-parallel ones), a
  Trainer subclass's config, its validator, profiler, CPU offload and seed checkpoint, a full-state resume of
  a torchtitan checkpoint (its step, data stream and schedule are not the job's); on unbroken's side
  ``parallel.pipeline``, ``train.activation_checkpointing``, ``train.compile`` and ``train.precision = "bf16"``
  (torchtitan's settings do these) and MeCeFO policies (its efficient backward does not know torchtitan's
  blocks).
"""

from __future__ import annotations

import os
import re
from typing import Any

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.trainer import Trainer

from unbroken.core.config import ActivationCheckpointing, Precision, RunConfig

INTEGRATION = "unbroken.integrations.torchtitan"


def own(config: Any, run: RunConfig) -> list[str]:
    """Check ``config`` (a torchtitan ``Trainer.Config``) against the job ``run`` and adapt it (module docstring);
    returns one line per setting changed.

    Raises:
        ValueError: one line: a setting the integration cannot honour, and what is allowed.
    """
    _refuse_other_fault_tolerance(config)
    _refuse_unsupported(config)
    _refuse_unbroken_settings(run)
    _refuse_full_resume(config)
    changed = _layout(config, run)
    changed += _step(config, run)
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = config.loss.loss_fn
        changed.append("loss: ChunkedLossWrapper -> its inner loss (it calls backward inside the loss function)")
    if config.debug.seed is None:
        config.debug.seed = run.train.seed
        changed.append(f"debug.seed -> {run.train.seed} (train.seed): every replica initialises the same weights")
    return changed


def _refuse_other_fault_tolerance(config: Any) -> None:
    section = getattr(config, "fault_tolerance", None)
    if section is not None and getattr(section, "enable", False):
        raise ValueError(
            "fault_tolerance.enable = true: torchtitan's torchft fault tolerance would act on the same failures as "
            f"unbroken's; turn it off under {INTEGRATION} (unbroken's replicas take torchft's place)"
        )
    if type(config) is not Trainer.Config:
        raise ValueError(
            f"the config function returned a {type(config).__qualname__}, the config of a Trainer subclass; "
            f"{INTEGRATION} runs torchtitan's own Trainer (Trainer.Config)"
        )


def _refuse_unsupported(config: Any) -> None:
    p, t = config.parallelism, config.training
    refused = {
        "parallelism.pipeline_parallel_degree": (p.pipeline_parallel_degree != 1, "use FSDP and TP inside a replica"),
        "parallelism.context_parallel_degree": (p.context_parallel_degree != 1, "use FSDP and TP inside a replica"),
        "parallelism.expert_parallel_degree": (p.expert_parallel_degree != 1, "use FSDP and TP inside a replica"),
        "parallelism.data_parallel_replicate_degree": (
            p.data_parallel_replicate_degree != 1,
            "unbroken's replicas are the data-parallel ones: launch more workers",
        ),
        "validator.enable": (config.validator.enable, "torchtitan's validation reads its own dataloader"),
        "profiler.enable_profiling": (config.profiler.enable_profiling, "torchtitan's profiler follows its loop"),
        "training.enable_cpu_offload": (t.enable_cpu_offload, "FSDP's CPU offload is not supported"),
        "checkpoint.create_seed_checkpoint": (
            config.checkpoint.create_seed_checkpoint,
            "every replica initialises the same weights from debug.seed",
        ),
        "comm.mode": (config.comm.mode != "default", "the replica's process group is unbroken's"),
    }
    for key, (set_, allowed) in refused.items():
        if set_:
            value = getattr(getattr(config, key.split(".")[0]), key.split(".")[1])
            raise ValueError(f"{key} = {value} is not supported under {INTEGRATION}: {allowed}")


def _refuse_unbroken_settings(run: RunConfig) -> None:
    tc = run.train
    refused = {
        "parallel.pipeline": (run.parallel.pipeline != 1, "torchtitan's pipelining is not supported"),
        "train.activation_checkpointing": (
            tc.activation_checkpointing is not ActivationCheckpointing.NONE,
            "torchtitan's --activation_checkpoint.* does it",
        ),
        "train.compile": (tc.compile, "torchtitan's --compile.enable does it"),
        "train.precision": (tc.precision is not Precision.FP32, "torchtitan's training.mixed_precision_param does it"),
        "recovery.policy": (run.recovery.policy.mecefo, "MeCeFO's efficient backward knows no torchtitan block"),
    }
    for key, (set_, allowed) in refused.items():
        if set_:
            section, name = key.split(".")
            value = getattr(getattr(run, section), name)
            shown = getattr(value, "value", value)
            raise ValueError(f"{key} = {shown} is not supported under {INTEGRATION}: {allowed}")


def _refuse_full_resume(config: Any) -> None:
    """A job starts from a torchtitan checkpoint's model only: its optimizer, schedule and step would continue
    torchtitan's run, whose data stream, step count and schedule length are not the job's."""
    c = config.checkpoint
    if not c.enable:
        return
    why = (
        f"under {INTEGRATION} a job starts from a torchtitan checkpoint's model only (--checkpoint.initial_load_path "
        "PATH): its steps, data order and LR schedule start with the job"
    )
    if c.initial_load_path and not c.initial_load_model_only:
        raise ValueError(f"checkpoint.initial_load_model_only = false: {why}")
    folder = os.path.join(config.dump_folder, c.folder)
    steps = [n for n in (os.listdir(folder) if os.path.isdir(folder) else []) if re.fullmatch(r"step-\d+", n)]
    if any(os.path.isfile(os.path.join(folder, n, ".metadata")) for n in steps):
        raise ValueError(f"checkpoint.folder {folder} holds torchtitan's {sorted(steps)[-1]} to resume: {why}")


def _layout(config: Any, run: RunConfig) -> list[str]:
    """torchtitan's replica mesh follows the job's: ``tensor_parallel_degree`` = ``parallel.tensor``,
    ``data_parallel_shard_degree`` = ``parallel.shard`` (-1 and 1 are taken as "not set")."""
    p = config.parallelism
    changed = []
    for key, theirs, ours in (
        ("tensor_parallel_degree", p.tensor_parallel_degree, run.parallel.tensor),
        ("data_parallel_shard_degree", p.data_parallel_shard_degree, run.parallel.shard),
    ):
        if theirs in (-1, 1) and ours != theirs:
            setattr(p, key, ours)
            changed.append(f"parallelism.{key} -> {ours} (parallel.{'tensor' if 'tensor' in key else 'shard'})")
        elif theirs not in (-1, 1) and theirs != ours:
            flag = "tensor" if "tensor" in key else "shard"
            raise ValueError(
                f"parallelism.{key} = {theirs} but the job's replicas have parallel.{flag} = {ours}: launch with "
                f"--parallel.{flag}={theirs} (unbroken forms the replicas), or leave parallelism.{key} unset"
            )
    return changed


def _step(config: Any, run: RunConfig) -> list[str]:
    """A step: ``train.steps`` steps of ``train.microbatches`` microbatches of ``training.local_batch_size``
    sequences; torchtitan's ``global_batch_size`` may only say the same (then its accumulation is off)."""
    t, m = config.training, run.train.microbatches
    step_batch = m * t.local_batch_size
    if t.global_batch_size > 0 and t.global_batch_size != step_batch:
        raise ValueError(
            f"training.global_batch_size = {t.global_batch_size} asks for gradient accumulation against train."
            f"microbatches = {m} of training.local_batch_size = {t.local_batch_size} sequences ({step_batch} a "
            f"step): leave it unset or set --train.microbatches={t.global_batch_size // t.local_batch_size}"
        )
    changed = []
    if t.global_batch_size > 0:
        t.global_batch_size = -1
        changed.append(f"training.global_batch_size -> -1 (the step's {m} microbatches are unbroken's)")
    if t.steps != run.train.steps:
        changed.append(f"training.steps {t.steps} -> {run.train.steps} (train.steps)")
        t.steps = run.train.steps
    return changed
