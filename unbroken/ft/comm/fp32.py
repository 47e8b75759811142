"""fp32 mode's local contribution: the microbatches' gradients as backward accumulated them in ``param.grad``.

Owns ``Fp32Gradients``: a bucket's slices of the reduced buffer filled from ``param.grad`` (which no collective
touches, so a reduction restarted on a new group fills them again), the reduced buffer handed back as views (no
copy back, unlike DDP's default), and the diagnosis of a non-finite local gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from unbroken.ft.comm.buckets import Buckets
from unbroken.ft.comm.dtensors import local_tensor
from unbroken.ft.comm.fold import LocalFlags


class Fp32Gradients:
    """The local gradients of ``params`` (laid out as ``layout``) in fp32 mode."""

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: Buckets) -> None:
        self.params = params
        self.layout = layout
        self.reset()

    def reset(self) -> None:
        """Forget what the last step's diagnosis found."""
        self.flags = LocalFlags()

    def fill(self, bucket: Sequence[int], flat: torch.Tensor) -> None:
        """The local gradients of the parameters of ``bucket`` into their slices of ``flat`` (zero without one)."""
        for index in bucket:
            view = self.layout.view(flat, index)
            if self.params[index].grad is None:
                view.zero_()
            else:
                grad = local_tensor(self.params[index].grad)
                assert grad.data_ptr() != view.data_ptr(), "reset_local() must drop the last step's reduced views"
                view.copy_(grad.reshape(-1))

    def reduced(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's reduced gradient: a view of ``flat``. The step's local gradients are no longer needed
        once the reduction completed, and ``flat`` is next written by the following step's reduction, after
        ``reset_local`` has dropped these views."""
        view = self.layout.view
        return [view(flat, index).view_as(local_tensor(p)) for index, p in enumerate(self.params)]

    def check_nonfinite(self, microbatch_ids: Sequence[int]) -> None:
        """Note whether the local gradient (of microbatches ``microbatch_ids``) holds a NaN or an infinity (one
        fused pass; called only on the path that diagnoses a skipped step)."""
        grads = [(i, local_tensor(p.grad)) for i, p in enumerate(self.params) if p.grad is not None]
        if not grads:
            return
        peaks = torch._foreach_norm([g for _, g in grads], float("inf"))
        bad = [i for (i, _), peak in zip(grads, peaks, strict=True) if not math.isfinite(float(peak))]
        if bad:
            self.flags.first_bad_param = bad[0]
            self.flags.nonfinite_ids = list(microbatch_ids)
