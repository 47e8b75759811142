"""The fixed-point scale of the exact reduction: replicated state, and the rules that change it.

In exact mode every microbatch gradient (already scaled by 1/M) is rounded to an integer multiple of
``2**-e`` per tensor and summed as int64, so the sum is the same bits whoever computed which microbatch. The
exponent ``e`` of a tensor comes from its *bound* ``2**b``: every microbatch value must stay below the bound so
that M of them fit in int64 (``e = 62 - ceil(log2 M) - b``).

Everything the reduction's arithmetic depends on is replicated training state, listed here:

- ``bound_exp`` (per tensor, this class): sent to a rejoining worker with the rest of the state, saved in and
  restored from checkpoints, and changed only by the two rules below, whose inputs are the same on every
  replica;
- M (the configuration) and the order of the registered parameters (the same model on every replica);
- nothing else: no per-process multiplier, nothing reset by a restart.

The rules:

- ``grow(observed)`` after a step in which some microbatch did not fit: ``observed`` is the per-tensor maximum
  of |microbatch gradient| over all M microbatches (a MAX all-reduce of what each member saw, so the same on
  every replica whoever computed what). The bound becomes the next power of two above it, so the redone step
  fits; bounds only ever reach ``MAX_BOUND_EXP`` (above the largest finite float32), so a redo always fits
  and no loop is unbounded.
- ``track(reduced)`` after every committed step: the bound follows the reduced gradient's per-tensor maximum
  with ``HEADROOM_EXP`` bits of headroom (shrinking when gradients shrink, growing when they grow), clamped
  to [``MIN_BOUND_EXP``, ``MAX_BOUND_EXP``]. The reduced gradient is the same bits on every replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

HEADROOM_EXP = 10  # a microbatch gradient may be up to 2^10 x the previous step's reduced gradient
MIN_BOUND_EXP = -40  # finest bound: values above 2^-40 x 2^-59 keep full precision
MAX_BOUND_EXP = 128  # every finite float32 is below 2^128
INITIAL_BOUND_EXP = 0


def _exp_above(value: float) -> int:
    """The smallest b with value < 2**b (value > 0 and finite)."""
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return exponent


class FixedPointScale:
    """Per-tensor power-of-two bounds for the exact reduction of ``num_tensors`` tensors, M microbatches."""

    def __init__(self, num_tensors: int, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.headroom_bits = 62 - math.ceil(math.log2(max(2, num_microbatches)))
        self.bound_exp = [INITIAL_BOUND_EXP] * num_tensors

    @property
    def limit(self) -> float:
        """|value x 2**e| must stay below this for M of them to fit in int64."""
        return float(2**self.headroom_bits)

    def exponents(self) -> list[int]:
        """The scale exponent e of each tensor (values are rounded to multiples of 2**-e)."""
        return [self.headroom_bits - b for b in self.bound_exp]

    def grow(self, observed: Sequence[float]) -> list[int]:
        """After an overflow: raise each bound above the largest |value| observed in the step; returns the
        indices of the tensors whose bound grew."""
        assert len(observed) == len(self.bound_exp)
        grown = []
        for i, value in enumerate(observed):
            assert math.isfinite(value), "non-finite gradients are skipped, never scaled"
            if value > 0 and value >= 2.0 ** self.bound_exp[i]:
                self.bound_exp[i] = min(MAX_BOUND_EXP, _exp_above(value))
                grown.append(i)
        return grown

    def track(self, reduced_max: Sequence[float]) -> None:
        """After a committed step: bounds follow the reduced gradient's per-tensor maximum |value|."""
        assert len(reduced_max) == len(self.bound_exp)
        for i, value in enumerate(reduced_max):
            assert math.isfinite(value)
            target = _exp_above(value) + HEADROOM_EXP if value > 0 else MIN_BOUND_EXP
            self.bound_exp[i] = max(MIN_BOUND_EXP, min(MAX_BOUND_EXP, target))

    def state_dict(self) -> dict[str, Any]:
        return {"bound_exp": list(self.bound_exp), "num_microbatches": self.num_microbatches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bounds = [int(b) for b in state["bound_exp"]]
        if len(bounds) != len(self.bound_exp) or int(state["num_microbatches"]) != self.num_microbatches:
            raise ValueError(
                f"exact-mode scale of {len(bounds)} tensors and M = {state['num_microbatches']} does not fit this "
                f"run ({len(self.bound_exp)} tensors, M = {self.num_microbatches})"
            )
        self.bound_exp = bounds
