"""torchtitan's Trainer with its steps driven by ``unbroken.ft``: two overrides, no copy of its ``__init__``.

``UnbrokenTrainer`` is torchtitan's ``Trainer`` (its ``__init__`` builds the model from the registry on the meta
device, runs the model's ``parallelize_fn``, builds the optimizer and LR-schedule containers, the tokenizer and
the dataloader slot, which holds ``data.UnbrokenData``) with:

- ``init_distributed``: the replica's process group, which ``ft.init()`` formed (this process's default group,
  over the replica's ranks; a replica of one rank gets a group of one), so torchtitan's ``ParallelDims`` builds
  its FSDP x TP mesh over the replica's ranks: a replica is the failure domain;
- ``train``: the step loop of ``unbroken.ft``. The model part and the container's optimizer are the registered
  state, with the LR schedulers and the Trainer's own train state (step, tokens seen) as extra state; each step
  runs ``step.microbatches()`` (this rank's ids, more after a failure), torchtitan's forward and loss per
  microbatch (the mean over its tokens), ``step.backward``, then ``step.commit``, which clips to
  ``training.max_norm`` and steps torchtitan's optimizer container and LR schedulers (``_ContainerStep``).

A job may start from a torchtitan checkpoint's model (``checkpoint.enable`` with ``checkpoint.initial_load_path``):
torchtitan's checkpointer loads it once, before the first step; from then on checkpoints are unbroken's
(``checkpoint.py`` writes one in torchtitan's layout).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.trainer import Trainer

import unbroken.ft as ft
from unbroken.integrations.torchtitan.checkpoint import ARGS_KEY
from unbroken.integrations.torchtitan.data import UnbrokenData

log = logging.getLogger(__name__)


class _ContainerStep:
    """What ``step.commit`` needs of an optimizer: ``param_groups`` (the step record's learning rate) and
    ``step()``, which steps torchtitan's optimizer container (each optimizer, with the container's hooks), then
    its LR schedulers, and counts the step in the Trainer's train state: all inside the commit, before a
    checkpoint due at this step is written."""

    def __init__(self, trainer: UnbrokenTrainer, tokens_per_step: int) -> None:
        self.trainer = trainer
        self.tokens_per_step = tokens_per_step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.trainer.optimizers.optimizers[0].param_groups

    def step(self) -> None:
        trainer = self.trainer
        trainer.optimizers.step()
        trainer.lr_schedulers.step()
        trainer.step += 1
        trainer.ntokens_seen += self.tokens_per_step


class UnbrokenTrainer(Trainer):
    """torchtitan's Trainer whose replica, steps, state and checkpoints are unbroken's (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config, ctx: ft.Context, args: list[str]) -> None:
        self.ctx = ctx
        self.args = list(args)  # the job's torchtitan command line: its checkpoints' metadata (``checkpoint.py``)
        super().__init__(config)
        inner = getattr(getattr(self.model_config, "first_attention", None), "inner_attention", None)
        self._masked = isinstance(inner, FlexAttention.Config | VarlenAttention.Config)

    def init_distributed(self) -> ParallelDims:
        """The replica's ranks as torchtitan's world: ``ft.init()`` made the replica's group this process's
        default one; a replica of one rank gets a group of one."""
        if not dist.is_initialized():
            backend = "nccl" if self.ctx.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return ParallelDims.from_config(self.config.parallelism, dist.get_world_size())

    def train(self) -> None:
        """The job's steps through ``unbroken.ft`` (module docstring)."""
        ctx, training = self.ctx, self.config.training
        if len(self.model_parts) != 1 or len(self.optimizers.optimizers) != 1:
            raise ValueError(
                f"{len(self.model_parts)} model parts and {len(self.optimizers.optimizers)} optimizers: the "
                "integration drives one model part with one optimizer (one optimizer name in optimizer.param_groups)"
            )
        self._load_torchtitan_checkpoint()
        model = self.model_parts[0]
        plain_state_dict(model)
        ctx.register_state(
            model,
            self.optimizers.optimizers[0],
            lr_scheduler=self.lr_schedulers,
            train_state=self,
            metadata={ARGS_KEY: json.dumps(self.args)},
            flops_per_token=float(self.metrics_processor.num_flops_per_token),
        )
        data = self.dataloader
        assert isinstance(data, UnbrokenData)
        tokens = ctx.config.train.microbatches * training.local_batch_size * training.seq_len
        commit = _ContainerStep(self, tokens)
        for step in ctx.steps():
            self.gc_handler.run(step.index + 1)
            for j in step.microbatches():
                inputs, labels = data.microbatch(step.index, j)
                self._microbatch(step, inputs, labels)
            step.commit(commit, clip_grad_norm=float(training.max_norm))  # type: ignore[arg-type]

    def _microbatch(self, step: ft.Step, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """One microbatch's forward (torchtitan's input processing, model and loss: the mean over its valid
        tokens) and ``step.backward``."""
        given = (inputs, labels)
        batch = {"input": inputs.to(self.device)}
        if self._masked:  # FlexAttention and varlen attention take their (causal) masks from the positions
            batch["positions"] = torch.arange(inputs.shape[1], device=self.device).expand(inputs.shape)
        seen = self.ntokens_seen  # the train state counts committed steps' tokens (``_ContainerStep``)
        inputs, labels, extra = self.post_dataloading_process(batch, labels.to(self.device))
        self.ntokens_seen = seen
        with self.train_context():
            pred = self.model_parts[0](inputs, **extra)
            loss, _ = self.loss_fn(pred, labels, (labels != IGNORE_INDEX).sum())
            del pred
            with spmd.no_typecheck():
                step.backward(loss, tokens=labels.numel(), inputs=given)

    def _load_torchtitan_checkpoint(self) -> None:
        """The model of a torchtitan checkpoint the job starts from (``checkpoint.enable`` and
        ``checkpoint.initial_load_path``, model only: ``settings`` refuses the rest), loaded by torchtitan's
        checkpointer. A job that resumes or rejoins then takes unbroken's state over it in ``ctx.steps()``."""
        checkpointer = self.checkpointer
        if not self.config.checkpoint.enable:
            return
        if "dataloader" not in checkpointer.exclude_from_loading:
            checkpointer.exclude_from_loading = [*checkpointer.exclude_from_loading, "dataloader"]
        if checkpointer.load(step=self.config.checkpoint.load_step):
            log.info("starting from the model of torchtitan's checkpoint %s", self.config.checkpoint.initial_load_path)


def plain_state_dict(model: torch.nn.Module) -> int:
    """Remove from ``model`` the state-dict hooks of torchtitan's modules, which rewrite its keys (``FusedQKVLinear``
    splits its fused ``wqkv`` into ``wq``/``wk``/``wv``, gathering it over the replica's mesh, and merges them back
    on load): unbroken's state is the parameters as they are, each rank's part by its parameter's name, which a
    rejoining rank copies into its own and DCP saves shard by shard. Returns how many hooks were removed;
    ``checkpoint.py`` applies them again when it writes torchtitan's layout."""
    removed = 0
    for module in model.modules():
        for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
            theirs = [k for k, h in hooks.items() if getattr(h, "hook", h).__module__.startswith("torchtitan.")]
            for key in theirs:
                del hooks[key]
            removed += len(theirs)
    return removed


def build(ctx: ft.Context, config: Any, args: list[str]) -> UnbrokenTrainer:
    """The integration's Trainer for the torchtitan ``config`` (a ``Trainer.Config``, already checked by
    ``settings.own``), parsed from the command line ``args``."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return UnbrokenTrainer(UnbrokenTrainer.Config(**fields), ctx, args)
