"""The gradient norm of a step and its clipping, for parameters whole or split over the ranks of a replica.

A rank holds ``grads``, its local part of some of the model's tensors (all of them, sharded, under FSDP; a
stage's, whole, under pipelining; split or whole under tensor parallelism; all of them, whole, in a replica of
one rank). ``index[i]`` is the position of ``grads[i]`` among the model's ``numels`` tensors, ``counted[i]``
whether this rank's part of it counts in the replica's sums (a part the tensor ranks hold alike counts once),
and ``reduce_max`` / ``reduce_sum`` combine a vector over the replica's ranks (the identity for a replica of one
rank).

``exact_clip`` is exact mode's: the norm is the same bits however the tensors are split, so exact mode's
trajectory does not depend on the layout. A float32 value's square is exact in float64; each tensor's squares
are summed as int64 in fixed point with a power-of-two scale taken from the tensor's global max and size
(``foldkernel.square_sum``), and integer sums are associative; the per-tensor sums are then combined in the
tensors' order. ``float_clip`` is fp32 mode's for a split model: per-rank sums of squares, summed over the
replica (as FSDP's own clipping of DTensors does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from unbroken.ft.foldkernel import peaks_of, square_sums

Combine = Callable[[torch.Tensor], None]
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def _square_exponent(value: float, numel: int) -> int:
    """The scale 2**e under which ``numel`` squares of values at most ``value`` sum below 2**62."""
    top = math.frexp(value * value)[1]  # value**2 < 2**top
    return 62 - math.ceil(math.log2(max(2, numel))) - top


def peaks(
    grads: Sequence[torch.Tensor], index: Sequence[int], numels: Sequence[int], reduce_max: Combine
) -> list[float]:
    """max |value| of each of the model's tensors (0 for one without gradient), over the whole replica."""
    out = torch.zeros(len(numels), dtype=torch.float64)
    present = [(g, i) for g, i in zip(grads, index, strict=True) if g.numel()]
    for (_, i), value in zip(present, peaks_of([g for g, _ in present]), strict=True):
        out[i] = value
    reduce_max(out)
    return out.tolist()


def exact_clip(
    grads: Sequence[torch.Tensor],
    index: Sequence[int],
    numels: Sequence[int],
    max_norm: float,
    reduce_max: Combine,
    reduce_sum: Combine,
    counted: Sequence[bool] | None = None,
) -> float:
    """The global L2 norm of the gradient (module docstring); if ``max_norm`` > 0 and it exceeds it, every
    gradient is scaled by ``max_norm / (norm + 1e-6)`` in place. Returns the norm (NaN if not finite)."""
    top = peaks(grads, index, numels, reduce_max)
    if not all(math.isfinite(v) for v in top):
        return math.nan
    exponents = [_square_exponent(v, n) if v > 0 else 0 for v, n in zip(top, numels, strict=True)]
    sums = torch.zeros(len(numels), dtype=torch.int64)
    counts = counted if counted is not None else [True] * len(grads)
    nonzero = [(g, i) for g, i, c in zip(grads, index, counts, strict=True) if c and top[i] > 0 and g.numel()]
    values = square_sums([g for g, _ in nonzero], [exponents[i] for _, i in nonzero])
    for (_, i), value in zip(nonzero, values, strict=True):
        sums[i] = value
    reduce_sum(sums)
    total = 0.0
    for s, e in zip(sums.tolist(), exponents, strict=True):
        total += float(s) * 2.0**-e
    norm = math.sqrt(total)
    _clip(grads, norm, max_norm)
    return norm


def float_clip(
    grads: Sequence[torch.Tensor], max_norm: float, reduce_sum: Combine, counted: Sequence[bool] | None = None
) -> float:
    """fp32 mode, a split model: the global L2 norm from each rank's sum of squares; clipped as ``exact_clip``."""
    local = torch.zeros(1, dtype=torch.float64)
    counts = counted if counted is not None else [True] * len(grads)
    present = [g for g, c in zip(grads, counts, strict=True) if c and g.numel()]
    if present:
        norms = torch.stack(torch._foreach_norm(present, 2.0)).tolist()  # one wait for a GPU, not one per tensor
        local[0] = sum(n**2 for n in norms)
    reduce_sum(local)
    norm = math.sqrt(float(local[0]))
    _clip(grads, norm, max_norm)
    return norm


@torch.no_grad()
def _clip(grads: Sequence[torch.Tensor], norm: float, max_norm: float) -> None:
    if max_norm <= 0 or not math.isfinite(norm):
        return
    coefficient = max_norm / (norm + CLIP_EPS)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
