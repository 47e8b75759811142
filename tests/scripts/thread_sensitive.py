"""A loop whose gradient depends on how a large sum is split over threads (torch's parallel reductions split
their input by the intra-op thread count): the same microbatch's gradient differs in its last bits between 1
and 2 threads."""

import torch
from torch import nn

import unbroken.ft as ft


def batch_for(seed: int, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + microbatch)
    seq = torch.randint(0, 64, (64, 33), generator=g)
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    ctx = ft.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.register_state(model, optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            x, y = batch_for(0, step.index, mb)
            logits = model(x)  # (64, 32, 64): 131,072 values, above torch's grain for one thread
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + logits.sum() ** 2 * 1e-9
            step.backward(loss)
        step.commit(optimizer)


if __name__ == "__main__":
    main()
