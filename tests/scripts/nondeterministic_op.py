"""A loop with an op that has no deterministic implementation (``Tensor.put_``, on the CPU too) in one microbatch of
step 2, in its backward or (``UNBROKEN_TEST_NONDETERMINISTIC_IN=forward``) in the user's forward: under deterministic
kernels (exact mode's default) the run must stop with one line naming the op and the setting to change."""

import os

import torch
from torch import nn

import unbroken.ft as ft


class PutInBackward(torch.autograd.Function):
    """The identity, whose backward writes its gradient through ``put_``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(grad).reshape(-1)
        out.put_(torch.arange(out.numel()), grad.reshape(-1))
        return out.view_as(grad)


def main() -> None:
    ctx = ft.init()
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx.register_state(model, optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            g = torch.Generator().manual_seed(step.index * 100 + mb)
            out = model(torch.randn(4, 8, generator=g))
            if step.index == 2 and os.environ.get("UNBROKEN_TEST_NONDETERMINISTIC_IN") == "forward":
                out = out.reshape(-1).clone().put_(torch.arange(out.numel()), out.reshape(-1)).view_as(out)
            elif step.index == 2:
                out = PutInBackward.apply(out)
            step.backward(out.square().mean())
        step.commit(optimizer)


if __name__ == "__main__":
    main()
