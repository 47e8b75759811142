"""The exact fold's CPU kernels give the bits of the torch ops they replace (the reducer that defers folds to
use them: tests/test_comm.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from unbroken.ft import foldkernel

pytestmark = pytest.mark.timeout(120)

LIMIT = 2.0**59  # FixedPointScale's limit for M = 8


def awkward_values(n: int, seed: int) -> torch.Tensor:
    """float32 values over many binades, with exact ties (x.5), signed zeros and subnormals."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 20, (n,), generator=g).float())
    values[:400] = torch.arange(400, dtype=torch.float32) * 0.5 - 100  # ties both ways, after a scale of 1
    values[400:402] = torch.tensor([0.0, -0.0])
    values[402:404] = torch.tensor([1e-45, -3e-44])  # subnormals
    return values


def reference_sum(grads: list[torch.Tensor], base: torch.Tensor | None, exponent: int) -> torch.Tensor:
    total = torch.zeros(grads[0].numel(), dtype=torch.int64) if base is None else base.clone()
    for g in grads:
        total += g.reshape(-1).mul(2.0**exponent).round().to(torch.int64)
    return total


def test_the_kernels_are_compiled_here() -> None:
    """numba is a dependency: a CPU run that fell back to the torch ops would be correct but slow."""
    assert foldkernel.kernel_applies(torch.zeros(4))


@pytest.mark.parametrize("exponent", [0, 1, 23, 40, -5, -69, 99])
@pytest.mark.parametrize("count", [1, 2, foldkernel.KERNEL_ARITY + 1])  # the last in two passes
def test_quantise_sum_is_the_torch_ops_bit_for_bit(exponent: int, count: int) -> None:
    n = 10_007
    grads = []
    for j in range(count):
        values = awkward_values(n, seed=j)
        values[values.abs() * 2.0**exponent >= LIMIT / 16] = 0.0  # the caller's bound holds
        grads.append(values)
    base = torch.randint(-(2**50), 2**50, (n,), generator=torch.Generator().manual_seed(9))
    for start in (None, base):
        out = torch.empty(n, dtype=torch.int64)
        peaks = foldkernel.quantise_sum(grads, start, out, exponent, LIMIT)
        assert torch.equal(out, reference_sum(grads, start, exponent))
        assert peaks == [float(g.abs().max()) for g in grads]
    in_place = base.clone()
    foldkernel.quantise_sum(grads, in_place, in_place, exponent, LIMIT)
    assert torch.equal(in_place, reference_sum(grads, base, exponent))


@pytest.mark.parametrize("exponent", [0, 40, -69, 99])
def test_dequantise_is_the_torch_ops_bit_for_bit(exponent: int) -> None:
    g = torch.Generator().manual_seed(exponent & 0xFFFF)
    acc = torch.randint(-(2**62), 2**62, (20_000,), generator=g)
    acc[:1000] = torch.randint(-(2**30), 2**30, (1000,), generator=g)  # where the float32 conversion is exact
    acc[1000:1003] = torch.tensor([0, 2**24 + 1, -(2**24 + 3)])  # ties of the conversion
    assert torch.equal(foldkernel.dequantise(acc, exponent), acc.to(torch.float32).mul_(2.0**-exponent))


def test_peak_names_nan_and_infinity() -> None:
    values = awkward_values(1000, seed=3)
    assert foldkernel.peak(values) == float(values.abs().max())
    values[17] = -float("inf")
    assert foldkernel.peak(values) == math.inf
    values[500] = float("nan")
    assert math.isnan(foldkernel.peak(values))
    assert foldkernel.peak(torch.tensor([-2.5, 1.0])) == 2.5


def test_batched_peaks_and_square_sums_are_the_kernels_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``peaks_of`` and ``square_sums`` (a GPU's path: computed on the device, read back once) give the values the
    CPU kernels give one tensor at a time, NaN and infinity included."""
    tensors = [awkward_values(5_003 + k, seed=10 + k) for k in range(3)]
    tensors[1][7] = -float("inf")
    exponents = [-30, 0, 12]
    finite = [tensors[0], tensors[2]]
    kernel_peaks = [foldkernel.peak(t) for t in tensors]
    kernel_sums = [foldkernel.square_sum(t, e) for t, e in zip(finite, exponents, strict=False)]
    assert foldkernel.peaks_of(tensors) == kernel_peaks
    monkeypatch.setattr(foldkernel, "_kernels", lambda: None)
    assert foldkernel.peaks_of(tensors) == kernel_peaks
    assert foldkernel.square_sums(finite, exponents[:2]) == kernel_sums
    tensors[2][3] = float("nan")
    assert math.isnan(foldkernel.peaks_of(tensors)[2])


@pytest.mark.parametrize("chunk", [1 << 26, 6_000])  # one pass over all the tensors; a pass per chunk
def test_quantise_sum_many_is_quantise_sum_tensor_by_tensor(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """A GPU's fold (all parameters in one multi-tensor pass, per chunk) writes the bits and returns the peaks
    that ``quantise_sum`` gives one tensor at a time: no base, a base that is the output, another base; NaN and
    infinity among the peaks."""
    monkeypatch.setattr(foldkernel, "MANY_CHUNK_ELEMENTS", chunk)
    exponents = [0, 23, -69, 99, 40, 7]
    grads = []
    for k, exponent in enumerate(exponents):
        values = awkward_values(4_001 + 997 * k, seed=20 + k)
        values[values.abs() * 2.0**exponent >= LIMIT / 16] = 0.0
        grads.append(values)
    grads[1][11] = float("inf")  # its sum is discarded by the caller; its peak must say so
    grads[4][5] = float("nan")
    g = torch.Generator().manual_seed(3)
    bases = [
        None if k % 3 == 0 else torch.randint(-(2**50), 2**50, (t.numel(),), generator=g) for k, t in enumerate(grads)
    ]
    outs = [
        b if k % 3 == 1 else torch.empty(t.numel(), dtype=torch.int64)
        for k, (t, b) in enumerate(zip(grads, bases, strict=True))
    ]
    expected = [reference_sum([t], b, e) for t, b, e in zip(grads, bases, exponents, strict=True)]
    peaks = foldkernel.quantise_sum_many(grads, bases, outs, exponents).tolist()
    for k, (out, want) in enumerate(zip(outs, expected, strict=True)):
        if k not in (1, 4):
            assert torch.equal(out, want), k
    assert peaks[1] == math.inf and math.isnan(peaks[4])
    assert [p for k, p in enumerate(peaks) if k not in (1, 4)] == [
        float(t.abs().max()) for k, t in enumerate(grads) if k not in (1, 4)
    ]


WARM_CHECK = """
import torch
from unbroken.ft import foldkernel
kernels = foldkernel._kernels()
assert not any(kernel.signatures for kernel in kernels), "compiled before warm"
foldkernel.warm()
warmed = [list(kernel.signatures) for kernel in kernels]
assert all(warmed), warmed
grads = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(6)]
acc = torch.zeros(1000, dtype=torch.int64)
foldkernel.quantise_sum(grads, None, acc, 10, 2.0**40)
foldkernel.quantise_sum(grads[:2], acc, acc, 10, 2.0**40)
foldkernel.dequantise(acc, 10)
foldkernel.peaks_of(grads)
foldkernel.square_sums(grads, [3] * len(grads))
assert [list(kernel.signatures) for kernel in kernels] == warmed, "the fold compiled more after warm"
"""


def test_warm_compiles_every_signature_the_fold_calls() -> None:
    """``warm`` (run before a worker registers) leaves nothing for the fold to load: in a fresh process, after
    it, the calls a fold makes (several gradients with and without a base, the norm's square sums, the peaks,
    the conversion back) add no signature to any kernel."""
    if foldkernel._kernels() is None:
        pytest.skip("numba is not installed: the fold runs torch ops")
    done = subprocess.run([sys.executable, "-c", WARM_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
