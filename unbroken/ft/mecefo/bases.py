"""MeCeFO's low-rank projection bases: ``LowRankBases``, the V of every FFN weight, and the settings they follow.

Owns ``EfficientConfig`` (the rank r, the period tau of the bases, and the randomized SVD's oversampling and power
iterations), ``randomized_basis`` and ``basis_seed``, and ``LowRankBases``: when the bases are computed, on a
background thread, and how they are joined, saved and loaded.

V is computed by a randomized range finder with ``power_iters`` subspace iterations and ``oversample`` extra
columns (Halko, Martinsson and Tropp 2011, algorithms 4.4 and 5.1), in float32 on the weights' device, with the
Gaussian test matrix drawn from a ``torch.Generator`` seeded from (bases step, block, matrix): the bases are a pure
function of the weights and the step they were taken at, so every worker of one device type and torch build (and,
on CPU, one intra-op thread count) computes bit-identical V from identical weights. docs/gpu.md ("MeCeFO bases")
has the error against the full SVD and the times. The bases of the tau-window ``[k tau, (k+1) tau)`` (tau =
``refresh_every``, the paper's 100) come from the weights at the window's first step at which ``refresh(step,
needed=True)`` is called, i.e. the first step with an efficient microbatch on any member, so a failure-free window
computes nothing. ``refresh`` starts the computation on a background thread (on a CUDA side stream for CUDA
weights), last block first, and returns: the bases are used in the backward only, so the first efficient
microbatch's forward overlaps it and its backward waits, block by block, only for what is not done yet; ``wait()``,
``bases()`` and any ``torch.optim`` optimizer step join all of it (the weights must not change before it has read
them). The intra-op thread count is left alone. The bases live here, not in the model (no parameters or buffers),
so the model's state dict and parameter checksums are unaffected. The defaults (``DEFAULT_OVERSAMPLE`` 16,
``DEFAULT_POWER_ITERS`` 2) add at most 0.0022 to the FFN weight-gradient projection error of the exact top-r
subspace for r = 8 to 128 (docs/gpu.md).

``DEFAULT_RANK`` (64) was chosen from the gradient-error measurements in docs/benchmarks.md ("MeCeFO"): the FFN
weight-gradient error falls slowly with r, and 64 reaches the paper's error level for about half of the exact
weight-gradient cost.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from unbroken.ft.mecefo.blocks import Block, local_part, whole

DEFAULT_RANK = 64
DEFAULT_OVERSAMPLE = 16
DEFAULT_POWER_ITERS = 2


@dataclass(frozen=True)
class EfficientConfig:
    """The transform's settings (a run's ``[mecefo]`` section).

    ``rank`` is r of the FFN weight-gradient projection and ``refresh_every`` the period tau (steps) of its
    bases; ``oversample`` and ``power_iters`` tune the randomized SVD that computes them (docs/gpu.md,
    "MeCeFO bases", has the error each choice gives).
    """

    rank: int = DEFAULT_RANK
    refresh_every: int = 100
    oversample: int = DEFAULT_OVERSAMPLE
    power_iters: int = DEFAULT_POWER_ITERS

    def __post_init__(self) -> None:
        if self.rank < 1 or self.refresh_every < 1:
            raise ValueError(
                f"efficient mode needs rank >= 1 and refresh_every >= 1 (got {self.rank}, {self.refresh_every})"
            )
        if self.oversample < 0 or self.power_iters < 0:
            raise ValueError(
                f"efficient mode needs oversample >= 0 and power_iters >= 0 (got {self.oversample}, {self.power_iters})"
            )


Bases = list[tuple[torch.Tensor | None, ...]]  # per block: (gate, up, down), None where the gradient is exact


@dataclass(eq=False)
class _Refresh:
    """One basis computation in flight on a background thread, block by block from the last (the first one
    a backward reaches): block i's bases are usable once ``ready[i]`` is set (and, for CUDA weights, once the
    stream that uses them has waited for ``events[i]``)."""

    step: int
    device: torch.device  # the weights'
    versions: list[int]  # the weights' version counters when it started: they must not move until it is joined
    bases: list[tuple[torch.Tensor | None, ...] | None]
    ready: list[threading.Event]
    events: list[torch.cuda.Event | None]  # recorded on the side stream after block i's last kernel
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def block(self, index: int) -> tuple[torch.Tensor | None, ...]:
        """Block ``index``'s bases, once computed (re-raises the computation's error)."""
        self.ready[index].wait()
        if self.error is not None:
            raise self.error
        bases, event = self.bases[index], self.events[index]
        assert bases is not None
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for v in bases:
                if v is not None:
                    v.record_stream(stream)  # allocated on the side stream, used on this one
        return bases


class LowRankBases:
    """The projection bases of the FFN weights of ``blocks``: computed when first needed in a tau-window, on a
    background thread, and joined before anything writes the weights (``wait``, and every ``torch.optim``
    optimizer's ``step()``: a global step pre-hook, removed by ``close()``).

    The bases used for step s are a pure function of the weights at ``bases_step``, the first step of s's
    tau-window at which ``refresh(..., needed=True)`` was called, and of that step number; no bases exist
    before the first such call (``bases()`` is then empty). A worker that joins or resumes gets the current
    ones, with their step, through ``load_bases(bases, step)``.
    """

    def __init__(self, blocks: list[Block], config: EfficientConfig) -> None:
        self.config = config
        self._blocks = blocks
        self._step = 0  # the step of the last refresh() call: what an efficient forward without bases keys to
        self._bases: Bases = []
        self._bases_step: int | None = None  # the step of the bases held; None: no bases
        self._pending: _Refresh | None = None
        self._stream: torch.cuda.Stream | None = None
        ref = weakref.ref(self)

        def join_before_step(*_: Any) -> None:
            bases = ref()
            if bases is not None:
                bases.wait()

        self._hook = register_optimizer_step_pre_hook(join_before_step)
        weakref.finalize(self, self._hook.remove)

    @property
    def bases_step(self) -> int | None:
        """The step whose weights the bases come from (those in flight, if a computation is); None: none yet."""
        return self._pending.step if self._pending is not None else self._bases_step

    def refresh(self, step: int, needed: bool = True) -> bool:
        """Start computing the bases from the current weights if ``needed`` and those held (or in flight) are
        not from ``step``'s tau-window; returns whether it started.

        ``needed``: some worker runs an efficient microbatch in ``step`` (the same on every worker, so that
        all hold the same bases). Call it between steps or once the step's plan is known (again after an
        in-step re-plan: a repeated call is free), not between a forward and its backward. The computation
        runs on a background thread, last block first; an efficient microbatch's backward waits for each
        block's bases when it reaches the block, ``wait()`` (and an optimizer step) for all of them.
        """
        self._step = step
        if not needed or self._current(step):
            return False
        self.wait()
        self._start(step)
        return True

    def wait(self) -> None:
        """Join the computation ``refresh`` started, if any, and take its bases (re-raising its error).

        On CUDA the current stream is made to wait for its kernels, so the weights may be written after.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        assert pending.thread is not None
        pending.thread.join()
        bases = [pending.block(i) for i in range(len(self._blocks))]
        if [w._version for w in self._weights()] != pending.versions:
            raise RuntimeError(
                f"the FFN weights changed while the MeCeFO bases of step {pending.step} were computed from them: "
                "call EfficientBackward.wait() before writing the weights"
            )
        self._bases = bases
        self._bases_step = pending.step

    def bases(self) -> list[torch.Tensor]:
        """The V tensors (in_features x min(r, out_features)): block by block, gate, up, down; exact-gradient
        matrices skipped; empty before the first computation.

        The same count and shapes for every handle built from the same model shape and config once it has
        bases, for checkpoints and state transfers (with ``bases_step``); copying into them in place updates
        the handle.
        """
        self.wait()
        return [v for vs in self._bases for v in vs if v is not None]

    def named_bases(self) -> dict[str, torch.Tensor]:
        """``bases()`` keyed by the name of the FFN weight each one projects."""
        self.wait()
        return {
            name: v
            for block, vs in zip(self._blocks, self._bases, strict=True)
            for name, v in zip(block.weight_names, vs, strict=True)
            if v is not None
        }

    def _projected(self) -> Iterator[tuple[str, nn.Linear, tuple[int, int]]]:
        """(weight name, linear, basis shape) of every FFN weight with a basis, in ``bases()``'s order."""
        for b in self._blocks:
            for name, linear in zip(b.weight_names, b.linears, strict=True):
                if (shape := basis_shape(linear.weight, self.config.rank)) is not None:
                    yield name, linear, shape

    def empty_named_bases(self) -> dict[str, torch.Tensor]:
        """``named_bases()``'s names and shapes, uninitialised, on the weights' devices: what a sharded
        checkpoint's bases are read into (``load_named_bases``)."""
        return {
            name: torch.empty(shape, dtype=linear.weight.dtype, device=linear.weight.device)
            for name, linear, shape in self._projected()
        }

    def load_named_bases(self, bases: dict[str, torch.Tensor], step: int | None = None) -> None:
        """``load_bases`` from bases keyed by weight name (``named_bases()``: a sharded checkpoint's, where each
        pipeline stage saved its own blocks').

        Raises:
            ValueError: a basis of this handle's is missing, or the shapes do not match.
        """
        names = [name for name, _, _ in self._projected()]
        missing = [n for n in names if n not in bases]
        if bases and missing:
            raise ValueError(f"MeCeFO bases do not match: none for {missing[0]} (another model or rank?)")
        self.load_bases([bases[n] for n in names] if bases else [], step)

    def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for a computation of bases in flight: a thread still inside torch's
        kernels when the interpreter finalizes can abort the process (call before it exits)."""
        pending = self._pending
        if pending is not None and pending.thread is not None:
            pending.thread.join(timeout_s)

    def load_bases(self, bases: list[torch.Tensor], step: int | None = None) -> None:
        """Replace the bases with copies of ``bases`` (as returned by ``bases()``, e.g. from a checkpoint or a
        live worker) taken from the weights of ``step`` (their ``bases_step``). A computation in flight is
        dropped. Empty ``bases`` or ``step=None`` (a state saved without it): no bases, the next needed
        ``refresh`` computes them.

        Raises:
            ValueError: their count or shapes do not match this handle's (another model shape or rank).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending.thread is not None:
            pending.thread.join()  # superseded: its result (and any error) is dropped
        if not bases or step is None:
            self._bases, self._bases_step = [], None
            return
        shapes = [[basis_shape(linear.weight, self.config.rank) for linear in b.linears] for b in self._blocks]
        own = [shape for row in shapes for shape in row if shape is not None]
        if [tuple(t.shape) for t in bases] != own:
            raise ValueError(
                f"MeCeFO bases do not match: got {len(bases)} of shapes {sorted({tuple(t.shape) for t in bases})}, "
                f"expected {len(own)} of shapes {sorted(set(own))} (another model or rank?)"
            )
        loaded = iter(bases)
        self._bases = [
            tuple(
                None if shape is None else next(loaded).detach().to(linear.weight.device, linear.weight.dtype).clone()
                for shape, linear in zip(row, b.linears, strict=True)
            )
            for row, b in zip(shapes, self._blocks, strict=True)
        ]
        self._bases_step = step

    def _current(self, step: int) -> bool:
        """Whether the bases held or in flight come from ``step``'s tau-window (and not from a later step)."""
        tau = self.config.refresh_every
        at = self.bases_step
        return at is not None and at <= step and at // tau == step // tau

    def _weights(self) -> list[torch.Tensor]:
        """The FFN weights as this process holds them (an FSDP rank: its shards)."""
        return [local_part(linear.weight) for b in self._blocks for linear in b.linears]

    def _full_weights(self) -> list[list[torch.Tensor]]:
        """Per block, its (gate, up, down) weights whole. Weights sharded by FSDP are gathered here, on the
        calling thread (every rank of the replica calls ``refresh`` at the same point of the step protocol, and
        a collective must not run on the background thread beside FSDP's own), once per tau-window."""
        return [[whole(linear.weight) for linear in b.linears] for b in self._blocks]

    def _start(self, step: int) -> None:
        weights = self._weights()
        full = self._full_weights()
        num_blocks = len(self._blocks)
        device = weights[0].device
        pending = _Refresh(
            step,
            device,
            [w._version for w in weights],
            bases=[None] * num_blocks,
            ready=[threading.Event() for _ in range(num_blocks)],
            events=[None] * num_blocks,
        )
        stream = None
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(device))  # the last optimizer step's writes
            pending.events = [torch.cuda.Event() for _ in range(num_blocks)]
        config, blocks = self.config, self._blocks
        threads = torch.get_num_threads()

        def run() -> None:
            # A new thread's first LAPACK calls (the QR and SVD below) run with OpenMP's default thread count
            # (the host's cores), not the process's, until some ATen op has set the thread up: the first basis
            # would then have other bits than the rest, and depend on the host and on which block comes first.
            torch.set_num_threads(threads)
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for b in reversed(blocks):
                        pending.bases[b.index] = tuple(
                            randomized_basis(
                                weight,
                                config.rank,
                                config.oversample,
                                config.power_iters,
                                basis_seed(step, b.name, k),
                            )
                            for k, weight in enumerate(full[b.index])
                        )
                        event = pending.events[b.index]
                        if event is not None:
                            event.record(stream)
                        pending.ready[b.index].set()
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                pending.error = e
            finally:
                for ready in pending.ready:
                    ready.set()

        pending.thread = threading.Thread(target=run, name=f"mecefo-bases-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    def of_block(self, index: int) -> Callable[[], tuple[torch.Tensor | None, ...]]:
        """For an efficient forward of block ``index``: what its backward calls to get the block's bases. A
        computation in flight is joined there, for that block only, so it overlaps the forward; with no bases
        for the last ``refresh`` step's window (a caller that never said ``needed``), one starts now."""
        if not self._current(self._step):
            self.refresh(self._step, needed=True)
        pending = self._pending
        if pending is None:
            held = self._bases[index]
            return lambda: held
        return lambda: pending.block(index)

    def close(self) -> None:
        """Join the computation in flight and remove the optimizer hook."""
        self.wait()
        self._hook.remove()


def basis_shape(weight: torch.Tensor, rank: int) -> tuple[int, int] | None:
    """The shape of a weight's basis: (in_features, min(rank, out_features)), None when rank >= in_features."""
    out_features, in_features = weight.shape
    return None if rank >= in_features else (in_features, min(rank, out_features))


def basis_seed(step: int, block: str, matrix: int) -> int:
    """The test-matrix seed of one weight's basis: distinct per (step, block, matrix), equal on every worker.
    The block is named as in the model (``layers.5``), not numbered, so that a block has the same bases
    whichever part of the model a process holds (a pipeline stage keeps the whole model's names)."""
    return (step * 1_000_003 + 3 * zlib.crc32(block.encode()) + matrix) % (1 << 63)


def randomized_basis(
    weight: torch.Tensor, rank: int, oversample: int, power_iters: int, seed: int
) -> torch.Tensor | None:
    """An orthonormal estimate of the top-``rank`` right singular vectors of ``weight`` (out x in), as an
    (in_features x min(rank, out_features)) tensor of the weight's dtype on its device, or None when
    ``rank >= in_features`` (the gradient stays exact).

    Randomized subspace iteration in float32 on the weight's device: Y = (W^T W)^q W^T Omega with Omega an
    (out x (k + oversample)) Gaussian matrix drawn from a generator seeded with ``seed``, re-orthonormalised
    after every product; then the SVD of the small W Q gives the rotation inside span(Q). A pure function
    of (weight, arguments) on one device type and torch build. Cost: (2 + 2 q) products of W with a
    thin matrix, instead of a full SVD's O(in^2 out).
    """
    shape = basis_shape(weight, rank)
    if shape is None:
        return None
    out_features, in_features = weight.shape
    k = shape[1]
    width = min(k + oversample, out_features, in_features)
    with torch.no_grad():
        w = weight.detach().float()
        gen = torch.Generator(device=w.device).manual_seed(seed)
        omega = torch.randn(out_features, width, generator=gen, device=w.device, dtype=torch.float32)
        q = torch.linalg.qr(w.T @ omega).Q  # (in, width): an orthonormal basis of the sketch of W's row space
        for _ in range(power_iters):
            q = torch.linalg.qr(w.T @ torch.linalg.qr(w @ q).Q).Q
        _, _, vh = torch.linalg.svd(w @ q, full_matrices=False)  # (out, width) -> vh (width, width)
        v = q @ vh[:k].T  # (in, k)
    return v.to(weight.dtype).contiguous()
