"""The gradient reduction of a step: ``GradientReducer``, which sums the workers' local gradients bucket by bucket.

Owns the launch and the wait of the bucket collectives: while a step's last local backward runs (``arm``), a
bucket's all-reduce starts as soon as all its gradients are final, so communication overlaps compute (as DDP does),
and the side vector's all-reduce ends the step's collectives. The buckets (``buckets.Buckets``), the local
contribution the reduced buffer is filled from (exact mode's ``fold.ExactFold``, fp32 mode's
``fp32.Fp32Gradients``) and the collectives (``collectives``, ``waits``) are its collaborators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from unbroken.ft.comm.buckets import Buckets
from unbroken.ft.comm.collectives import allreduce_async
from unbroken.ft.comm.dtensors import is_dtensor, local_tensor
from unbroken.ft.comm.fold import ExactFold, LocalFlags
from unbroken.ft.comm.fp32 import Fp32Gradients
from unbroken.ft.comm.groups import Group
from unbroken.ft.comm.waits import Pending, WaitStatus, wait_all


class GradientReducer:
    """Sums the workers' local gradients into a separate flat buffer, bucket by bucket.

    Buckets hold parameters in reverse registration order (the order backward produces them). While a step's
    last local backward runs (``arm``), a bucket's all-reduce starts as soon as all its gradients are final,
    so communication overlaps compute (as DDP does). Buckets start strictly in index order on every worker,
    so the collectives match across workers whatever order the hooks fire in.

    In ``exact`` mode every microbatch's gradient is folded into a local int64 fixed-point accumulator with a
    per-tensor power-of-two scale (``exact.FixedPointScale``, set with ``set_exponents``); integer addition
    is associative, so the reduced gradient is bitwise the same whichever worker computed which microbatch.
    The armed backward folds each gradient as soon as it is final, so exact mode overlaps too. A gradient
    that is not finite, or that would not fit, is noted in ``flags`` (a property of the microbatch, so every
    worker agrees after the reduction); the step is then skipped or redone, never committed.

    The local contribution (``param.grad`` in fp32 mode, the int64 accumulator in exact mode) is never
    touched by a collective, so a reduction interrupted by a failure is restarted on the next group from it.

    Parameters sharded by FSDP or split by tensor parallelism (``DTensor``s) are reduced as their local parts:
    across replicas, rank coordinate by rank coordinate. In exact mode FSDP's parameters have their microbatch
    gradients folded inside FSDP's reduce-scatter (``fsdp.ExactReduceScatter``, through ``note`` and
    ``accumulate``) instead of by ``fold``.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        bucket_bytes: int,
        num_extras: int,
        exact: bool = False,
        first_bucket_bytes: int | None = None,
        buckets: list[list[int]] | None = None,
    ) -> None:
        self.params = list(params)
        self.num_extras = num_extras
        self.exact = exact
        # Sharded by FSDP (its units give the buckets): FSDP's reduce-scatter folds their gradients. Tensor
        # parallelism alone also makes ``DTensor``s, whose local parts are folded here as whole tensors are.
        self.sharded = buckets is not None and any(is_dtensor(p) for p in self.params)
        numels = [local_tensor(p).numel() for p in self.params]
        device = local_tensor(self.params[0]).device
        self.layout = Buckets(numels, bucket_bytes, 8 if exact else 4, first_bucket_bytes, buckets)
        self.flat = torch.zeros(self.layout.total, dtype=torch.int64 if exact else torch.float32, device=device)
        self.extras = torch.zeros(num_extras, dtype=torch.float64)
        self.local: ExactFold | Fp32Gradients = (
            ExactFold(self.params, self.layout, device) if exact else Fp32Gradients(self.params, self.layout)
        )
        # Exact mode: the armed backward's gradients are taken as they come (FSDP's reduce-scatter has folded a
        # sharded parameter's already).
        self._taker = self.local if isinstance(self.local, ExactFold) and not self.sharded else None
        self._group: Group | None = None
        self._ready: list[int] = [0] * len(self.layout)
        self._launched = 0
        self._pending: list[Pending] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []  # only while a backward is armed
        self._armed_microbatch: int | None = None
        # The microbatch whose backward runs now (set by the step protocol); a padding microbatch (a rank of a
        # replica with nothing left to compute in a round) contributes nothing.
        self.current: int | None = None
        self.padding = False

    @property
    def buckets(self) -> list[list[int]]:
        """The parameter indices of each bucket, in launch order."""
        return self.layout.buckets

    def _view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        return self.layout.view(buffer, index)

    def reset_local(self) -> None:
        """Forget the local contribution (a new step, or a step that must be redone)."""
        self.local.reset()
        for p in self.params:
            p.grad = None

    @property
    def flags(self) -> LocalFlags:
        """What this step's local microbatches showed so far (exact mode: the fold; fp32: ``check_nonfinite``)."""
        return self.local.flags

    # -- exact mode: the fold (``fold.ExactFold``) ------------------------------------------------------
    def _fold(self) -> ExactFold:
        assert isinstance(self.local, ExactFold), "exact mode only"
        return self.local

    def set_exponents(self, exponents: Sequence[int], limit: float) -> None:
        """Values are rounded to multiples of ``2**-exponents[i]``; |value x 2**e| < ``limit``."""
        self._fold().set_exponents(exponents, limit)

    @property
    def exponents(self) -> list[int]:
        return self._fold().exponents

    @property
    def limit(self) -> float:
        return self._fold().limit

    @property
    def observed(self) -> list[float]:
        """The largest |microbatch gradient| folded so far, per tensor."""
        return self._fold().observed

    def note(self, index: int, value: float) -> bool:
        """The current microbatch's gradient of parameter ``index`` has max |value| ``value`` (folded outside,
        by FSDP's reduce-scatter): True if it is finite and fits the fixed point."""
        assert self.current is not None, "the step protocol names the microbatch before its backward"
        return self._fold().note(index, self.current, value)

    def accumulate(self, index: int, values: torch.Tensor) -> None:
        """Add ``values`` (int64, parameter ``index``'s local shard) into the local contribution."""
        self._fold().accumulate(index, values)

    def fold(self, microbatch: int) -> None:
        """Move the gradient of microbatch ``microbatch``, just back-propagated, into the local contribution
        (the armed backward takes its own gradients as they come; FSDP's reduce-scatter folds sharded
        parameters itself)."""
        fold = self._fold()
        if not self.sharded:
            fold.fold(microbatch)

    # -- fp32 mode ----------------------------------------------------------------------------------
    def check_nonfinite(self, microbatch_ids: Sequence[int]) -> None:
        """Note whether this worker's local gradient (its microbatches ``microbatch_ids``) holds a NaN or an
        infinity (one fused pass; called only on the path that diagnoses a skipped step)."""
        assert isinstance(self.local, Fp32Gradients), "fp32 mode only"
        self.local.check_nonfinite(microbatch_ids)

    # -- overlapped launch --------------------------------------------------------------------------
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        bucket = self.layout.bucket_of[index]

        def hook(_param: torch.Tensor) -> None:
            if self._group is None:
                return
            if self._taker is not None:
                assert self._armed_microbatch is not None
                self._taker.take(index, self._armed_microbatch)  # folded as its bucket is filled
            self._ready[bucket] += 1
            self._launch_ready()

        return hook

    def arm(self, group: Group, microbatch: int) -> None:
        """Overlap the coming backward of ``microbatch`` (the last local one of the step) with the reduction
        on ``group``: each bucket's all-reduce starts once its gradients are final (exact mode: folded).

        The gradient hooks exist only from here to the launch: the step's other backwards (local
        accumulation, like DDP's ``no_sync``) run without a Python call per parameter."""
        self._start(group)
        self._armed_microbatch = microbatch
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    @property
    def armed(self) -> int | None:
        """The microbatch whose backward is armed (its gradients are folded and launched as they come)."""
        return self._armed_microbatch

    @property
    def launched(self) -> int:
        """Buckets whose all-reduce has started in the current reduction."""
        return self._launched

    def _start(self, group: Group) -> None:
        self._group = group
        self._ready = [0] * len(self.layout)
        self._launched = 0
        self._pending = []

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def _fill_bucket(self, b: int) -> None:
        """Bucket ``b``'s sums into its range of the buffer the collective reduces, from the local contribution
        (left as it is, so a restarted reduction fills it again)."""
        self.local.fill(self.layout.buckets[b], self.flat)

    def _launch_ready(self) -> None:
        assert self._group is not None
        buckets = self.layout.buckets
        while self._launched < len(buckets):
            b = self._launched
            if self._ready[b] < len(buckets[b]):
                return
            self._fill_bucket(b)
            start, end = self.layout.ranges[b]
            self._pending.append(allreduce_async(self._group, self.flat[start:end]))
            self._launched += 1

    def launch_gradients(self, group: Group) -> None:
        """Start every bucket that has not started yet (from the intact local contribution)."""
        self._unhook()
        if self._armed_microbatch is not None:
            if self._taker is not None:  # gradients the hooks never saw (none fires without a gradient)
                self._taker.take_all(self._armed_microbatch)
            self._armed_microbatch = None
        if self._group is not group:
            self._start(group)
        self._ready = [len(bucket) for bucket in self.layout.buckets]  # params with no grad this step count as ready
        self._launch_ready()

    def launch_extras(self, extras: torch.Tensor) -> None:
        """Start the extras' reduction, the last collective of the step (after ``launch_gradients``)."""
        assert extras.numel() == self.num_extras and self._group is not None
        self.extras.copy_(extras)
        self._pending.append(allreduce_async(self._group, self.extras))

    def wait(self, timeout_s: float, interrupted: Callable[[], bool]) -> tuple[WaitStatus, torch.Tensor | None]:
        """The wait's status and, when ``DONE``, the reduced extras."""
        pending, self._pending, self._group = self._pending, [], None
        status = wait_all(pending, timeout_s, interrupted)
        return status, (self.extras.clone() if status else None)

    def disarm(self) -> None:
        """Forget an interrupted reduction. Its collectives may still run on the abandoned group and write
        into their buffers, so later reductions get fresh ones; the local contribution is intact."""
        self._unhook()
        self._group = None
        self._pending = []
        self.flat = torch.zeros_like(self.flat)
        self.extras = torch.zeros_like(self.extras)

    @torch.no_grad()
    def apply(self, scale: float = 1.0) -> None:
        """Replace every ``param.grad`` with the reduced sum (times ``scale``) after a successful ``wait``.

        In fp32 mode each ``param.grad`` becomes a view of the reduced buffer (no copy back, unlike DDP's
        default). In exact mode the integers are converted (int64 to float32 rounds once; the power-of-two
        scale is exact)."""
        for p, grad in zip(self.params, self.local.reduced(self.flat), strict=True):
            if scale != 1.0:
                grad.mul_(scale)
            if is_dtensor(p):
                from torch.distributed.tensor import DTensor

                grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            p.grad = grad

    def close(self) -> None:
        self._unhook()
