"""Your own model, data and optimizer, made fault tolerant with unbroken.ft (docs/library.md).

    python examples/plain_loop.py --train.steps=50                  # one worker, in this process
    unbroken launch --workers 4 examples/plain_loop.py              # 4 workers; kill any of them
    unbroken launch --workers 4 --recovery.reduction=exact --failures.schedule="kill:worker=1,step=5" \
        examples/plain_loop.py                                      # bitwise the failure-free run

The data of a microbatch is a pure function of (seed, step, microbatch id), so any worker can compute any one:
it is drawn from ``ft.generator(seed, step, id)``, and ``step.backward(..., inputs=...)`` lets the library check it.
"""

import sys

import torch
from torch import nn

import unbroken.ft as ft


class TinyLM(nn.Module):
    """A next-token model over a 64-symbol vocabulary: embedding, one MLP block, output head."""

    def __init__(self, vocab: int = 64, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.mlp(h))


def batch_for(seed: int, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 32 tokens: a noisy counting pattern the model can learn. Pure in (seed, step, id)."""
    g = ft.generator(seed, step, microbatch)  # the same on every worker (unlike Python's hash() of a string)
    start = torch.randint(0, 64, (8, 1), generator=g)
    seq = (start + torch.arange(33)) % 64
    noise = torch.randint(0, 64, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


@torch.no_grad()
def eval_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def main() -> None:
    ctx = ft.init(overrides=sys.argv[1:])  # joins the job the launcher started, or runs one worker here
    seed = ctx.config.train.seed
    torch.manual_seed(seed)  # every worker starts from the same weights
    model = TinyLM().to(ctx.device)  # the CPU, or this worker's own GPU (train.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.register_state(model, optimizer)  # what a rejoining worker receives and checkpoints hold
    for step in ctx.steps():  # train.steps of them, from wherever the job is
        for mb in step.microbatches():  # this worker's ids, and a dead worker's after a failure
            x, y = (t.to(ctx.device) for t in batch_for(seed, step.index, mb))
            with ctx.autocast():  # bf16 under train.precision = "bf16"
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            step.backward(loss, tokens=x.numel(), inputs=(x, y))  # inputs: the data check compares them
        result = step.commit(optimizer, clip_grad_norm=1.0)
        if ctx.rank == 0 and step.index % 10 == 0:  # the leader's prints reach the launcher's console
            print(f"step {step.index}: loss {result.loss:.4f}", flush=True)
        if (step.index + 1) % 50 == 0 or step.index + 1 == ctx.config.train.steps:  # held out: another seed
            ctx.evaluate(4, lambda k: eval_loss(model, *(t.to(ctx.device) for t in batch_for(seed + 1, 0, k))))


if __name__ == "__main__":
    main()
