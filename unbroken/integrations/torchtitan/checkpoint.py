"""A job's checkpoint in torchtitan's own layout, written and read by torchtitan's checkpointer.

unbroken's checkpoints of a torchtitan job are its sharded DCP checkpoints (``RUN_DIR/checkpoints``: the model by
parameter name, the optimizer flattened by name, the LR schedulers' and the Trainer's train state as extra
state, the job's torchtitan command line as metadata ``torchtitan_args``). To move a job back to plain
torchtitan::

    python -m unbroken.integrations.torchtitan.checkpoint RUN_DIR OUT

builds torchtitan's Trainer for the job's command line in one CPU process, loads the job's newest checkpoint that
verifies into its model
parts, optimizer container, LR schedulers and train state, and saves them with torchtitan's ``CheckpointManager``
as ``OUT/step-N`` (its layout: the model's canonical keys, ``wq``/``wk``/``wv`` split by its own state-dict hooks,
``optimizer``, ``lr_scheduler``, ``train_state``; an empty ``dataloader``, whose stream position does not
exist here). Then a second Trainer loads ``OUT/step-N`` with torchtitan's checkpointer and every tensor is
compared with the job's checkpoint (``check``): the command prints one line saying so, or what differs.
Plain torchtitan then continues from it with ``--checkpoint.enable --checkpoint.folder OUT``.

A job may start from a torchtitan checkpoint's model (``--checkpoint.enable --checkpoint.initial_load_path
PATH``, model only, torchtitan's default); ``settings`` refuses a full-state resume of one (``step-N`` in
``checkpoint.folder``, or ``initial_load_model_only = false``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import unbroken.ft as ft
from unbroken.integrations.torchtitan import cpu

ARGS_KEY = "torchtitan_args"  # the job's torchtitan command line, in its checkpoints' metadata


def _plain_trainer(argv: list[str], out: Path) -> Any:
    """torchtitan's own Trainer for the job's command line ``argv``, on this process alone (the CPU, a group of
    one), with checkpointing into ``out`` and no data."""
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    from unbroken.integrations.torchtitan.data import NoData, NoTokenizer, torchtitan_tokenizer

    config = ConfigManager().parse_args(list(argv))
    cpu.adjust_config(config)
    p = config.parallelism
    p.tensor_parallel_degree, p.data_parallel_shard_degree = 1, -1
    config.compile.enable = False
    config.dataloader = NoData.Config()
    if torchtitan_tokenizer(config.hf_assets_path) is None:
        config.tokenizer = NoTokenizer.Config()
    config.dump_folder = str(out)
    c = config.checkpoint
    c.enable, c.folder, c.initial_load_path, c.last_save_model_only = True, str(out), None, False
    c.keep_latest_k, c.load_step = 0, -1
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ.setdefault("LOCAL_RANK", "0")
    return Trainer(config)


def _canonical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by canonical name (no activation-checkpoint wrapper segment), whole
    (a Trainer of one rank holds every tensor)."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    named = [*model.named_parameters(), *model.named_buffers()]
    return {canonical_fqn(name): _local(t) for name, t in named}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (on a Trainer of one rank: the whole tensor)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def export(run_dir: Path, out: Path) -> tuple[Path, dict[str, Any]]:
    """Write the job's newest checkpoint that verifies as torchtitan's ``OUT/step-N``; returns its path and the
    job's state (whole tensors) it was written from.

    Raises:
        ValueError: no checkpoint, or one without the job's torchtitan command line.
    """
    latest = ft.load_latest(run_dir)
    if latest is None:
        raise ValueError(f"{run_dir} holds no checkpoint that verifies")
    state = latest.state
    if ARGS_KEY not in state["metadata"]:
        raise ValueError(f"the checkpoint of step {latest.step} in {run_dir} is not a torchtitan job's (no {ARGS_KEY})")
    trainer = _plain_trainer(json.loads(state["metadata"][ARGS_KEY]), out)
    with torch.no_grad():
        for name, tensor in _canonical(trainer.model_parts[0]).items():
            if name in state["model"]:
                tensor.copy_(state["model"][name])
    trainer.optimizers.load_state_dict(state["optimizer"])
    trainer.lr_schedulers.load_state_dict(state["extra"]["lr_scheduler"])
    trainer.load_state_dict(state["extra"]["train_state"])
    trainer.checkpointer.save(curr_step=trainer.step, last_step=True)
    trainer.close()
    return out / f"step-{trainer.step}", state


def check(out: Path, state: dict[str, Any]) -> list[str]:
    """Load torchtitan's ``out/step-N`` into a fresh torchtitan Trainer with its checkpointer and compare it with
    ``state`` (``export``'s): one line per tensor or value that differs (empty: equal)."""
    trainer = _plain_trainer(json.loads(state["metadata"][ARGS_KEY]), out.parent)
    trainer.checkpointer.exclude_from_loading = ["dataloader"]
    if not trainer.checkpointer.load(step=int(out.name.removeprefix("step-"))):
        return [f"torchtitan's checkpointer found nothing to load in {out}"]
    theirs = _canonical(trainer.model_parts[0])
    problems = [f"model {k}" for k, v in state["model"].items() if k not in theirs or not torch.equal(theirs[k], v)]
    optimizer = trainer.optimizers.state_dict()
    problems += [
        f"optimizer {k}"
        for k, v in state["optimizer"].items()
        if isinstance(v, torch.Tensor) and not torch.equal(_whole(optimizer.get(k)), v)
    ]
    if trainer.lr_schedulers.state_dict() != state["extra"]["lr_scheduler"]:
        problems.append(f"lr_scheduler {trainer.lr_schedulers.state_dict()} != {state['extra']['lr_scheduler']}")
    if trainer.state_dict() != state["extra"]["train_state"]:
        problems.append(f"train_state {trainer.state_dict()} != {state['extra']['train_state']}")
    trainer.close()
    return problems


def _whole(value: Any) -> torch.Tensor:
    return _local(value) if isinstance(value, torch.Tensor) else torch.tensor(float("nan"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.integrations.torchtitan.checkpoint",
        description="a torchtitan job's checkpoint in torchtitan's layout, checked by loading it with torchtitan",
    )
    parser.add_argument("run_dir", type=Path, help="the job's run directory")
    parser.add_argument("out", type=Path, help="torchtitan's checkpoint folder to write step-N into")
    args = parser.parse_args(argv)
    with cpu.importing():
        import torchtitan.trainer  # noqa: F401 - imported once, adjusted
    cpu.after_import()
    try:
        path, state = export(args.run_dir.resolve(), args.out.resolve())
    except ValueError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 2
    problems = check(path, state)
    if problems:
        print(f"{path}: torchtitan loads it, but {len(problems)} differ: {', '.join(problems[:5])}", file=sys.stderr)
        return 1
    tensors = len(state["model"]) + sum(isinstance(v, torch.Tensor) for v in state["optimizer"].values())
    print(f"{path}: torchtitan's checkpointer loads it; {tensors} tensors equal to the job's step {state['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
