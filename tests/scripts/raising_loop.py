"""A user's loop with a bug in it (tests/test_user_errors.py), otherwise examples/plain_loop.py's shape.

    --raise microbatch   the backward of microbatch 3 of step 5 raises, whichever worker computes it (a bug: the
                         same data, the same code, the same error anywhere)
    --raise worker       the loss of step 5 raises on worker 2 only (a bad host: the others compute it fine)
    --raise rank0        rank 0's logging after steps 3, 7, ... raises (a bug in code that one rank runs: the
                         next worker to be rank 0 reaches it later)
    --raise optimizer    the optimizer's step of step 5 raises on every worker (a bug in code that every rank
                         runs; under parallel.shard, the model is sharded with FSDP on ``ctx.mesh``)
    (nothing)            no error: the reference run

The data of a microbatch is a pure function of (step, id), so any worker can compute any one.
"""

import argparse

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import unbroken.ft as ft

STEP, MICROBATCH, BAD_WORKER = 5, 3, 2


class Checked(torch.autograd.Function):
    """The identity, whose backward refuses the gradient of a corrupt microbatch."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, corrupt: bool) -> torch.Tensor:
        ctx.corrupt = corrupt
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.corrupt:
            raise RuntimeError("corrupt microbatch: its gradient cannot be computed")
        return grad, None


def batch_for(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1_009 + microbatch)
    tokens = torch.randint(0, 32, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, corrupt: bool) -> torch.Tensor:
    logits = Checked.apply(model(x), corrupt)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class BuggyAdamW(torch.optim.AdamW):
    """AdamW whose step raises once ``step_index`` is ``STEP``."""

    step_index = -1

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        if self.step_index == STEP:
            raise RuntimeError("the optimizer's state is inconsistent")
        return super().step(closure)


def log_progress(step: int, outcome: ft.StepOutcome) -> None:
    logged = {"step": step, "loss": outcome.loss}
    print(f"step {step}: loss {logged['loss']:.4f}, validation {logged['val_loss']:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--raise", dest="mode", choices=["microbatch", "worker", "rank0", "optimizer"])
    mode = parser.parse_args().mode
    ctx = ft.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    if ctx.mesh is not None:
        fully_shard(model, mesh=ctx.mesh)
    optimizer = BuggyAdamW(model.parameters(), lr=1e-2)
    ctx.register_state(model, optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            if mode == "worker" and step.index == STEP and ctx.worker_id == BAD_WORKER:
                raise ValueError(f"bad memory on this host (worker {ctx.worker_id})")
            x, y = batch_for(step.index, mb)
            corrupt = mode == "microbatch" and step.index == STEP and mb == MICROBATCH
            step.backward(loss_of(model, x, y, corrupt), tokens=x.numel())
        optimizer.step_index = step.index if mode == "optimizer" else -1
        outcome = step.commit(optimizer)
        if mode == "rank0" and ctx.rank == 0 and step.index % 4 == 3:
            log_progress(step.index, outcome)


if __name__ == "__main__":
    main()
