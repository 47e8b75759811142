"""The exact fold's arithmetic on one tensor: sum quantised gradients into int64, and convert back.

``quantise_sum(grads, base, out, e, limit)`` writes ``base + sum_j round(grads[j] x 2**e)`` (round half to
even) to ``out`` and returns each gradient's max |value|; ``dequantise(acc, e)`` returns ``acc x 2**-e``
(int64 to float32 rounds once, the power-of-two scale is exact); ``peak(t)`` is max |t|;
``square_sum(t, e)`` is ``sum_i round(t_i**2 x 2**e)`` as an integer (a float32's square is exact in float64),
which does not depend on how ``t`` is split: the exact gradient norm's part.

On the CPU, for float32, each is one numba loop. The fold is bound by memory traffic, writes above all:
torch's ops (extremes, multiply, round, convert, add) make six passes per microbatch and cost about 15% of a
microbatch's forward and backward here, while one loop that reads several microbatches' gradients and
writes their sum once costs a fraction of that (docs/benchmarks.md). Elsewhere (a GPU, another dtype, numba
not installed) they are torch ops, which run at memory bandwidth on a GPU. Both paths give the same bits
(tests/test_foldkernel.py): IEEE multiplication by a power of two is exact below the bound the caller
checks, and both round half to even.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

_INF_BITS = 0x7F800000  # float32 infinity; every NaN's bits (sign cleared) are above it
KERNEL_ARITY = 4  # gradients summed in one pass (more are summed four at a time)
_NO_BASE = np.zeros(1, dtype=np.int64)
MANY_CHUNK_ELEMENTS = 1 << 26  # quantise_sum_many's scratch: 12 bytes an element (the scaled floats, their integers)


_Kernels = tuple[Callable[..., tuple[int, ...]], Callable[..., int], Callable[..., None], Callable[..., int]]


@functools.cache
def _kernels() -> _Kernels | None:
    """The compiled CPU kernels (cached on disk by numba), or None when numba is not installed."""
    try:
        import numba
    except ImportError:
        return None

    # The largest |value| is found as the largest bit pattern with the sign cleared: for floats that are not
    # NaN, the order of those integers is the order of the magnitudes, and every NaN is above infinity. An
    # integer maximum vectorises where a NaN-aware float one does not.
    @numba.njit(cache=True, nogil=True)
    def peak_bits(values: Any) -> int:
        bits = values.view(np.int32)
        peak = np.int32(0)
        for i in range(bits.size):
            magnitude = bits[i] & np.int32(0x7FFFFFFF)
            peak = magnitude if magnitude > peak else peak
        return peak

    # Up to four gradients in one pass, with their peaks. Fixed arity, the unused ones skipped by
    # loop-invariant tests that the compiler hoists out of the loop (a tuple of any length, indexed in the
    # loop, does not vectorise as well).
    @numba.njit(cache=True, nogil=True)
    def quantise_sum4(
        g0: Any, g1: Any, g2: Any, g3: Any, count: int, base: Any, out: Any, scale: Any, has_base: bool
    ) -> tuple[int, int, int, int]:
        bits0, bits1, bits2, bits3 = g0.view(np.int32), g1.view(np.int32), g2.view(np.int32), g3.view(np.int32)
        sign_off = np.int32(0x7FFFFFFF)
        peak0 = peak1 = peak2 = peak3 = np.int32(0)
        for i in range(out.size):
            total = base[i] if has_base else np.int64(0)
            magnitude = bits0[i] & sign_off
            peak0 = magnitude if magnitude > peak0 else peak0
            total += np.int64(np.rint(g0[i] * scale))
            if count > 1:
                magnitude = bits1[i] & sign_off
                peak1 = magnitude if magnitude > peak1 else peak1
                total += np.int64(np.rint(g1[i] * scale))
            if count > 2:
                magnitude = bits2[i] & sign_off
                peak2 = magnitude if magnitude > peak2 else peak2
                total += np.int64(np.rint(g2[i] * scale))
            if count > 3:
                magnitude = bits3[i] & sign_off
                peak3 = magnitude if magnitude > peak3 else peak3
                total += np.int64(np.rint(g3[i] * scale))
            out[i] = total
        return peak0, peak1, peak2, peak3

    @numba.njit(cache=True, nogil=True)
    def dequantise(acc: Any, out: Any, scale: Any) -> None:
        for i in range(acc.size):
            out[i] = np.float32(acc[i]) * scale

    @numba.njit(cache=True, nogil=True)
    def square_sum(values: Any, scale: float) -> int:
        total = np.int64(0)
        for i in range(values.size):
            v = np.float64(values[i])
            total += np.int64(np.rint(v * v * scale))
        return total

    return quantise_sum4, peak_bits, dequantise, square_sum


def warm() -> None:
    """Load the CPU kernels and run each once, as the fold calls them, on a few values: numba's first use in a
    process (its registries and cached machine code, about 0.8 s of CPU here, mostly Python) then happens where
    it is called (before a worker registers), not in the first backward, where it held the heartbeat sender
    back (late by 0.4 s and more on a loaded host). Nothing without numba."""
    if _kernels() is None:
        return
    grads = [torch.ones(8) for _ in range(KERNEL_ARITY + 1)]  # two passes: the second adds to the first's sum
    acc = torch.zeros(8, dtype=torch.int64)
    quantise_sum(grads, None, acc, 0, 2.0**40)
    quantise_sum(grads[:1], acc, acc, 0, 2.0**40)
    dequantise(acc, 0)
    peaks_of(grads[:1])
    square_sums(grads[:1], [0])


def _float_of(bits: int) -> float:
    return math.nan if bits > _INF_BITS else float(np.int32(bits).view(np.float32))


def _on_cpu(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous()


def kernel_applies(grad: torch.Tensor) -> bool:
    """Whether the CPU kernels serve this gradient (then summing several microbatches in one pass pays)."""
    return _kernels() is not None and _on_cpu(grad, torch.float32)


def kernels_serve(device: torch.device) -> bool:
    """Whether the CPU kernels serve float32 gradients on ``device`` (the CPU, with numba installed)."""
    return device.type == "cpu" and _kernels() is not None


def extremes(tensor: torch.Tensor) -> tuple[float, float]:
    """(min, max) of ``tensor`` in one pass (NaN if it holds one); max(-min, max) is max |value|, the same value
    as ``vector_norm(tensor, inf)`` at an eighth of its time on the CPU here."""
    low, high = torch.aminmax(tensor)
    return float(low), float(high)


def peak(tensor: torch.Tensor) -> float:
    """max |value| of ``tensor``; NaN if it holds a NaN."""
    kernels = _kernels()
    if kernels is not None and _on_cpu(tensor, torch.float32):
        return _float_of(int(kernels[1](tensor.detach().reshape(-1).numpy())))
    low, high = extremes(tensor.detach())
    return max(-low, high)


def peaks_of(tensors: Sequence[torch.Tensor]) -> list[float]:
    """``peak`` of each of ``tensors`` (on one device): off the CPU kernels computed on the device and read back
    at once, so a GPU is waited for once, not once per tensor."""
    kernels = _kernels()
    if not tensors:
        return []
    if kernels is not None and all(_on_cpu(t, torch.float32) for t in tensors):
        return [peak(t) for t in tensors]
    return torch.stack([torch.linalg.vector_norm(t.detach().reshape(-1), math.inf).double() for t in tensors]).tolist()


def quantise_sum(
    grads: Sequence[torch.Tensor],
    base: torch.Tensor | None,
    out: torch.Tensor,
    exponent: int,
    limit: float,
    lazy: bool = False,
) -> list[float] | torch.Tensor:
    """``out = base + sum_j round(grads[j] x 2**exponent)`` elementwise (``base`` None: zero; ``out`` and ``base``
    flat int64 of the gradients' size, ``out`` may be ``base``); returns each gradient's max |value| (NaN if it
    holds a NaN). Where one is not finite, or times ``2**exponent`` is not below ``limit``, ``out`` is left
    unspecified: the caller discards it (the step is skipped or redone).

    ``lazy``: off the CPU kernels (a GPU), return the peaks as a float64 tensor on the gradients' device instead
    of a list, so that nothing waits for the device: the caller reads many of them back at once."""
    kernels = _kernels()
    flat = [g.detach().reshape(-1) for g in grads]
    if (
        kernels is not None
        and all(_on_cpu(g, torch.float32) for g in flat)
        and _on_cpu(out, torch.int64)
        and (base is None or _on_cpu(base, torch.int64))
    ):
        scale = np.float32(2.0**exponent)
        arrays = [g.numpy() for g in flat]
        target = out.numpy()
        # Without a base, a one-value array stands in for it (not read): passing ``out`` itself would make the
        # compiled loop's overlap check fail and run it unvectorised.
        source = _NO_BASE if base is None else base.numpy()
        peaks: list[float] = []
        for start in range(0, len(arrays), KERNEL_ARITY):
            chunk = arrays[start : start + KERNEL_ARITY]
            padded = chunk + [chunk[0]] * (KERNEL_ARITY - len(chunk))  # not read: ``count`` says how many are
            has_base = base is not None or start > 0
            bits = kernels[0](*padded, len(chunk), source if start == 0 else target, target, scale, has_base)
            peaks += [_float_of(int(b)) for b in bits[: len(chunk)]]
        return peaks
    if base is None:
        out.zero_()
    elif base.data_ptr() != out.data_ptr():
        out.copy_(base)
    if lazy:
        # Every gradient is added: one that does not fit converts to an unspecified integer, and the caller
        # discards ``out`` once it reads the peaks (the step is then skipped or redone).
        for g in flat:
            out.add_(g.mul(2.0**exponent).round_().to(torch.int64))
        return torch.stack([torch.linalg.vector_norm(g, math.inf) for g in flat]).double()
    peaks = [peak(g) for g in flat]
    for g, value in zip(flat, peaks, strict=True):
        if math.isfinite(value) and value * 2.0**exponent < limit:
            out.add_(g.mul(2.0**exponent).round_().to(torch.int64))
    return peaks


def quantise_sum_many(
    grads: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor | None],
    outs: Sequence[torch.Tensor],
    exponents: Sequence[int],
) -> torch.Tensor:
    """``quantise_sum`` of many tensors at once, one gradient each, off the CPU kernels (a GPU): ``outs[i] =
    bases[i] + round(grads[i] x 2**exponents[i])`` (``bases[i]`` None: zero; ``outs[i]`` may be ``bases[i]``), the
    same bits as ``quantise_sum`` tensor by tensor, in a number of passes that does not grow with the number of
    tensors (torch's multi-tensor ops over chunks of at most ``MANY_CHUNK_ELEMENTS``, which bounds the scratch
    memory): one call per parameter would launch several small kernels each, and a model of hundreds of
    parameters then spends longer launching them than computing. Returns the peaks (max |grads[i]|, NaN if one
    holds a NaN) as a float64 tensor on their device, not read back."""
    flat = [g.detach().reshape(-1) for g in grads]
    if not flat:
        return torch.zeros(0, dtype=torch.float64)
    peaks = torch.stack(torch._foreach_norm(flat, math.inf)).double()
    start = 0
    while start < len(flat):
        end, size = start + 1, flat[start].numel()
        while end < len(flat) and size + flat[end].numel() <= MANY_CHUNK_ELEMENTS:
            size += flat[end].numel()
            end += 1
        sizes = [t.numel() for t in flat[start:end]]
        scaled = torch.cat(flat[start:end])
        views = list(scaled.split(sizes))
        torch._foreach_mul_(views, [2.0**e for e in exponents[start:end]])
        torch._foreach_round_(views)
        quantised = scaled.to(torch.int64).split(sizes)
        triples = list(zip(outs[start:end], bases[start:end], quantised, strict=True))
        fresh = [(o, q) for o, b, q in triples if b is None]
        added = [(o, b, q) for o, b, q in triples if b is not None]
        if fresh:
            torch._foreach_copy_([o for o, _ in fresh], [q for _, q in fresh])
        moved = [(o, b) for o, b, _ in added if o.data_ptr() != b.data_ptr()]
        if moved:
            torch._foreach_copy_([o for o, _ in moved], [b for _, b in moved])
        if added:
            torch._foreach_add_([o for o, _, _ in added], [q for _, _, q in added])
        start = end
    return peaks


def dequantise(acc: torch.Tensor, exponent: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``acc x 2**-exponent`` as a new flat tensor of ``dtype`` (converted to ``dtype``, then scaled in it)."""
    kernels = _kernels()
    if kernels is not None and dtype == torch.float32 and _on_cpu(acc, torch.int64):
        out = torch.empty(acc.shape, dtype=torch.float32)
        kernels[2](acc.numpy(), out.numpy(), np.float32(2.0**-exponent))
        return out
    return acc.to(dtype).mul_(2.0**-exponent)


def square_sums(tensors: Sequence[torch.Tensor], exponents: Sequence[int]) -> list[int]:
    """``square_sum`` of each of ``tensors`` (on one device) with its exponent; off the CPU kernels computed on
    the device and read back at once."""
    kernels = _kernels()
    if not tensors:
        return []
    if kernels is not None and all(_on_cpu(t, torch.float32) for t in tensors):
        return [square_sum(t, e) for t, e in zip(tensors, exponents, strict=True)]
    sums = [
        t.detach().reshape(-1).double().square().mul_(2.0**e).round_().to(torch.int64).sum()
        for t, e in zip(tensors, exponents, strict=True)
    ]
    return [int(v) for v in torch.stack(sums).tolist()]


def square_sum(tensor: torch.Tensor, exponent: int) -> int:
    """``sum_i round(tensor_i**2 x 2**exponent)`` (round half to even) for a float32 ``tensor``: each square is
    exact in float64 and so is its scaling (the caller keeps the sum below 2**63), so the result is the same
    integer however the tensor is split and summed."""
    flat = tensor.detach().reshape(-1)
    kernels = _kernels()
    if kernels is not None and _on_cpu(flat, torch.float32):
        return int(kernels[3](flat.numpy(), 2.0**exponent))
    return int(flat.double().square().mul_(2.0**exponent).round_().to(torch.int64).sum())
