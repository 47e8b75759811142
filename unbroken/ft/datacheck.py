"""Microbatch data as a pure function of (seed, step, microbatch id): the seeded generator a loop draws its data
from, and the check that catches data that is not.

What the library promises (a dead worker's microbatches, recomputed by another, are the ones it lost; in exact
mode a run with failures is bitwise the failure-free run) holds only if a microbatch's inputs depend on
(seed, step, id) alone, never on the process that computes them. ``generator`` is seeded from exactly that, the
same in every process (unlike Python's ``hash()`` of a string, randomised per process).

The check is a probe. At the first step a worker runs in each membership epoch of two members or more, one
microbatch of the plan is computed twice: by its owner, as usual, and by a second member (the prober: the one
with the fewest ids, idle when there are more members than microbatches), which runs only its forward, after its
own microbatches, while the gradient's reduction is already under way; its gradient is never taken, and the
random number generators and the model's buffers are put back as they were. Both fingerprint the microbatch's
inputs (``fingerprint``: what the loop passes as ``step.backward(loss, inputs=...)``) into the side vector, and
once it is reduced every member compares the two. A loop that gives no inputs is not checked (nor probed). The
cost: one forward of one microbatch per membership change, on the least busy member, and two fingerprints.
Nothing here touches the gradient or the plan's accounting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.core.plan import Assignment

FINGERPRINT_BITS = 48  # exact in the float64 side vector (< 2**53), and 0 stays free for "not computed"


def seed_of(seed: int, step: int, microbatch: int) -> int:
    """A 63-bit seed for microbatch ``microbatch`` of step ``step`` under the run's ``seed``: the same in every
    process (a hash of the three numbers, not Python's per-process ``hash()``)."""
    digest = hashlib.blake2b(f"unbroken.ft/{seed}/{step}/{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(seed: int, step: int, microbatch: int, device: torch.device | str | None = None) -> torch.Generator:
    """A ``torch.Generator`` (on ``device``, default the CPU) seeded by ``seed_of(seed, step, microbatch)``: draw a
    microbatch's data from it (``torch.randint(..., generator=g)``) and the data is the same on any worker."""
    return torch.Generator(device=device if device is not None else "cpu").manual_seed(seed_of(seed, step, microbatch))


def _tensors(inputs: Any, where: str) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, Mapping):
        return [t for key in sorted(inputs, key=str) for t in _tensors(inputs[key], f"{where}[{key!r}]")]
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        return [t for k, item in enumerate(inputs) for t in _tensors(item, f"{where}[{k}]")]
    raise ValueError(
        f"step.backward(inputs=...): {where} is a {type(inputs).__name__}; give the microbatch's input tensors "
        "(a tensor, or a tuple, list or dict of them)"
    )


def check_inputs(inputs: Any) -> None:
    """ValueError (one line) unless ``inputs`` is a tensor or a tuple, list or dict of them (nested)."""
    _tensors(inputs, "inputs")


def fingerprint(inputs: Any) -> float:
    """A fingerprint of a microbatch's input tensors (their dtypes, shapes and bytes, in order), as an integer in
    [1, 2**48] held exactly by a float64. It reads the tensors once (a copy to the host for a GPU tensor)."""
    h = hashlib.blake2b(digest_size=8)
    for t in _tensors(inputs, "inputs"):
        data = t.detach().reshape(-1).contiguous()
        h.update(f"{data.dtype}{tuple(t.shape)};".encode())
        h.update(data.view(torch.uint8).cpu().numpy().tobytes())
    return float((int.from_bytes(h.digest(), "little") >> (64 - FINGERPRINT_BITS)) + 1)


@dataclass(frozen=True)
class Probe:
    """Microbatch ``microbatch``, which ``owner`` computes, computed again (inputs only) by ``prober``."""

    microbatch: int
    owner: int
    prober: int


def choose_probe(plan: Assignment) -> Probe | None:
    """The probe of a step planned as ``plan`` (every member computes the same): the prober is the member with the
    fewest ids (the last such), the microbatch the first id of the first other member that has one. None for a
    group of one member."""
    members = list(plan.members)
    if len(members) < 2:
        return None
    prober = min(reversed(members), key=lambda w: len(plan.ids_for(w)))
    owner = next((w for w in members if w != prober and plan.ids_for(w)), None)
    if owner is None:
        return None
    return Probe(plan.ids_for(owner)[0], owner, prober)


def mismatch(step: int, probe: Probe, owner_fp: float, prober_fp: float) -> str | None:
    """The one line a failed check says (None when both fingerprints are known and equal, or one is unknown)."""
    if owner_fp == 0 or prober_fp == 0 or owner_fp == prober_fp:
        return None
    return (
        f"step {step}: microbatch {probe.microbatch} has different inputs on worker {probe.owner} and worker "
        f"{probe.prober} (fingerprints {int(owner_fp):012x} and {int(prober_fp):012x}): the data is not a pure "
        "function of (seed, step, microbatch id), so a microbatch recomputed after a failure is not the one that "
        "was lost; seed it with ctx.generator(step.index, mb) (Python's hash() of a string differs between "
        "processes)"
    )
