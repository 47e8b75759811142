"""Exact mode's local contribution: every microbatch's gradient folded into an int64 fixed-point accumulator.

Owns ``ExactFold`` (the accumulator, the gradients waiting to be folded, the per-tensor power-of-two scale
``exponents`` and its ``limit``, and what the fold saw: ``LocalFlags`` and the peaks) and ``PENDING_FOLDS``.
Each gradient is rounded to a multiple of ``2**-exponent`` and summed as integers (``foldkernel.quantise_sum``);
integer addition is associative, so the reduced sum is bitwise the same whichever worker computed which
microbatch. On the CPU kernels a parameter's gradients of up to ``PENDING_FOLDS`` microbatches wait and are
folded in one pass; elsewhere (a GPU) the parameters with one waiting gradient are folded together, their peaks
left on the device and read back at once. A gradient that is not finite, or that would not fit, is noted in
``flags`` (a property of the microbatch, so every worker agrees after the reduction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unbroken.ft.comm.buckets import Buckets
from unbroken.ft.comm.dtensors import local_tensor
from unbroken.ft.foldkernel import (
    KERNEL_ARITY,
    dequantise,
    kernel_applies,
    kernels_serve,
    quantise_sum,
    quantise_sum_many,
)

# Exact mode on the CPU: a parameter's gradients of up to this many microbatches wait to be folded in one pass
# (the fold is bound by memory writes: one write of the sum instead of one per microbatch), at the price of
# keeping up to this many gradients at once.
PENDING_FOLDS = KERNEL_ARITY


@dataclass
class LocalFlags:
    """What the local microbatches' gradients showed this step (reported through the side vector)."""

    nonfinite_ids: list[int] = field(default_factory=list)  # microbatches with a NaN or an infinity
    first_bad_param: int | None = None  # index of the first parameter whose gradient was not finite
    overflow: int = 0  # microbatches whose gradient did not fit the fixed point


class ExactFold:
    """The int64 sum of this worker's microbatch gradients of ``params`` (laid out as ``layout``), on ``device``.

    A parameter's slice of the accumulator counts as zero until first written, and its gradients wait, not yet
    folded, as (microbatch id, gradient) until ``PENDING_FOLDS`` of them are there or its bucket is filled: one
    pass then reads them all and writes their sum once. Filling a bucket leaves the accumulator and the waiting
    gradients as they are, so a reduction restarted on a new group fills it again from them."""

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: Buckets, device: torch.device) -> None:
        self.params = params
        self.layout = layout
        self.accumulator = torch.zeros(layout.total, dtype=torch.int64, device=device)
        self.exponents = [0] * len(params)
        self.limit = math.inf
        # Off the CPU kernels (a GPU): the fold and the conversion back run over all parameters at once. Only
        # exact mode asks: loading the kernels (numba) costs a process about 57 MiB.
        self._together = not kernels_serve(device)
        self.reset()

    def reset(self) -> None:
        """Forget the local contribution (a new step, or a step that must be redone)."""
        self._written = [False] * len(self.params)
        self._unfolded: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.params]
        self._overflowed: set[int] = set()  # microbatches with a gradient that did not fit
        self._flags = LocalFlags()
        self._observed = [0.0] * len(self.params)  # max |microbatch gradient| seen, per tensor
        # Folded gradients' peaks still on the device, as ((parameter index, microbatch id) of each peak, peaks):
        # read back all at once when the flags are needed (one wait for the device per reduction).
        self._unread: list[tuple[list[tuple[int, int]], torch.Tensor]] = []

    def set_exponents(self, exponents: Sequence[int], limit: float) -> None:
        """Values are rounded to multiples of ``2**-exponents[i]``; |value x 2**e| < ``limit``."""
        assert len(exponents) == len(self.params)
        self.exponents = list(exponents)
        self.limit = limit

    @property
    def flags(self) -> LocalFlags:
        """What the fold saw in this step's local microbatches so far."""
        self._read_peaks()
        return self._flags

    @property
    def observed(self) -> list[float]:
        """The largest |microbatch gradient| folded so far, per tensor."""
        self._read_peaks()
        return self._observed

    def _read_peaks(self) -> None:
        """Note the peaks still on the device (one transfer for all of them)."""
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        values = torch.cat([peaks for _, peaks in unread]).tolist()
        at = 0
        for pairs, _ in unread:
            for index, microbatch in pairs:
                self.note(index, microbatch, values[at])
                at += 1

    # -- taking and folding -------------------------------------------------------------------------
    def take(self, index: int, microbatch: int) -> None:
        """Take parameter ``index``'s gradient of ``microbatch`` out of ``param.grad`` into the waiting ones."""
        p = self.params[index]
        if p.grad is None:
            return
        grad = local_tensor(p.grad)
        p.grad = None
        self._unfolded[index].append((microbatch, grad))

    def take_all(self, microbatch: int) -> None:
        """``take`` every parameter's gradient of ``microbatch``."""
        for index in range(len(self.params)):
            self.take(index, microbatch)

    def fold(self, microbatch: int) -> None:
        """Move the gradient of ``microbatch``, just back-propagated, into the local contribution."""
        self.take_all(microbatch)
        self._fold_due(range(len(self.params)))

    def _fold_due(self, indices: Sequence[int]) -> None:
        """Fold into the accumulator the waiting gradients of ``indices`` that are due: on the CPU kernels once
        PENDING_FOLDS of a parameter's wait, elsewhere at once (torch's ops gain nothing from waiting)."""
        due = [
            i
            for i in indices
            if self._unfolded[i]
            and (len(self._unfolded[i]) >= PENDING_FOLDS or not kernel_applies(self._unfolded[i][0][1]))
        ]
        self._fold_into(due, self.accumulator)
        for i in due:
            self._unfolded[i].clear()
            self._written[i] = True

    def _fold_into(self, indices: Sequence[int], target: torch.Tensor) -> None:
        """``_fold`` of each of ``indices`` into its view of ``target`` (the accumulator, or the buffer the
        collective reduces). Off the CPU kernels, the parameters with one waiting gradient (all of them, on a
        GPU) are folded together, in a number of kernel launches that does not grow with their count."""
        view = self.layout.view
        together = [i for i in indices if len(self._unfolded[i]) == 1 and not kernel_applies(self._unfolded[i][0][1])]
        alone = set(indices).difference(together)
        for index in indices:
            if index in alone:
                self._fold(index, view(target, index))
        if not together:
            return
        peaks = quantise_sum_many(
            [self._unfolded[i][0][1] for i in together],
            [view(self.accumulator, i) if self._written[i] else None for i in together],
            [view(target, i) for i in together],
            [self.exponents[i] for i in together],
        )
        self._unread.append(([(i, self._unfolded[i][0][0]) for i in together], peaks))

    @torch.no_grad()
    def _fold(self, index: int, out: torch.Tensor) -> None:
        """``out`` = parameter ``index``'s accumulated sum plus its waiting gradients, fixed point; notes what
        each gradient's microbatch showed (not finite, did not fit). Folding the same gradients again (a
        reduction restarted on a new group) notes nothing new."""
        unfolded = self._unfolded[index]
        accumulated = self.layout.view(self.accumulator, index) if self._written[index] else None
        exponent = self.exponents[index]
        # The accumulator is written before the checks: a microbatch that fails them makes the step skipped
        # (not finite) or redone from an empty accumulator (did not fit), never committed.
        peaks = quantise_sum([g for _, g in unfolded], accumulated, out, exponent, self.limit, lazy=True)
        if isinstance(peaks, torch.Tensor):
            self._unread.append(([(index, microbatch) for microbatch, _ in unfolded], peaks))
            return
        for (microbatch, _), value in zip(unfolded, peaks, strict=True):
            self.note(index, microbatch, value)

    def note(self, index: int, microbatch: int, value: float) -> bool:
        """What microbatch ``microbatch``'s gradient of parameter ``index`` showed (its max |value|): True if it
        is finite and fits the fixed point; else the flags say so (the step is then skipped or redone)."""
        if not math.isfinite(value):
            if microbatch not in self._flags.nonfinite_ids:
                self._flags.nonfinite_ids.append(microbatch)
            if self._flags.first_bad_param is None or index < self._flags.first_bad_param:
                self._flags.first_bad_param = index
            fits = False
        else:
            self._observed[index] = max(self._observed[index], value)
            fits = value * 2.0 ** self.exponents[index] < self.limit
            if not fits:
                self._overflowed.add(microbatch)
        self._flags.overflow = len(self._overflowed - set(self._flags.nonfinite_ids))
        return fits

    def accumulate(self, index: int, values: torch.Tensor) -> None:
        """Add ``values`` (int64, parameter ``index``'s local shard, folded by FSDP's reduce-scatter) into the
        local contribution."""
        view = self.layout.view(self.accumulator, index)
        if self._written[index]:
            view.add_(values)
        else:
            view.copy_(values)
            self._written[index] = True

    # -- the reduction's buffer ---------------------------------------------------------------------
    def fill(self, bucket: Sequence[int], flat: torch.Tensor) -> None:
        """The sum of the parameters of ``bucket`` into their slices of ``flat`` (the buffer the collective
        reduces); the accumulator and the waiting gradients stay as they are."""
        self._fold_into([i for i in bucket if self._unfolded[i]], flat)
        for index in bucket:
            if not self._unfolded[index]:
                view = self.layout.view(flat, index)
                if self._written[index]:
                    view.copy_(self.layout.view(self.accumulator, index))
                else:
                    view.zero_()

    def reduced(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The reduced integers of ``flat`` as each parameter's local gradient (int64 to float32 rounds once;
        the power-of-two scale is exact)."""
        view = self.layout.view
        if self._together and all(local_tensor(p).dtype == torch.float32 for p in self.params):
            # One conversion of the whole buffer and one multi-tensor scaling: the same bits as ``dequantise``
            # parameter by parameter, without a kernel launch per parameter.
            floats = flat.to(torch.float32)
            converted = [view(floats, index) for index in range(len(self.params))]
            torch._foreach_mul_(converted, [2.0**-e for e in self.exponents])
            return [grad.view_as(local_tensor(p)) for grad, p in zip(converted, self.params, strict=True)]
        return [
            dequantise(view(flat, index), self.exponents[index], p.dtype).view_as(local_tensor(p))
            for index, p in enumerate(self.params)
        ]
