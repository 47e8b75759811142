"""What decides the bits a worker computes: the environment deterministic kernels need, and the fingerprint of
a worker's hardware and software that exact mode compares at join. Pure Python (no torch).

Exact mode (``recovery.reduction = "exact"``) promises that a run with failures is bitwise the failure-free
run and that N workers train bit for bit what one worker trains. The reduction's arithmetic is exact, so the
promise rests on each microbatch's gradient being the same bits whichever worker computes it, which takes:

- deterministic kernels (``train.deterministic``, on by default under exact mode): the same inputs give the
  same bits on one device every time; on CUDA this needs ``CUBLAS_WORKSPACE_CONFIG`` in the environment
  before cuBLAS starts (``DETERMINISTIC_ENV``, which the launcher and the agent put in every worker's
  environment and ``unbroken.ft`` sets in its process);
- identical hardware and software on every worker (``Fingerprint``): the same GPU model and SM count, CUDA,
  cuBLAS and cuDNN versions, torch version, TF32 and matmul precision settings; on a CPU the ISA the kernels
  were picked for, the torch build and the intra-op thread count. A worker whose fingerprint differs from
  the group's is refused at join (``refusal``).

A fingerprint is a flat mapping of field names to strings, carried in the registration request (one JSON
object: ``control.member.registration``) and in the coordinator's ``admitted`` records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace setting (NVIDIA's documented choice)
DETERMINISTIC_ENV = {CUBLAS_WORKSPACE_ENV: CUBLAS_WORKSPACE}

Fingerprint = Mapping[str, str]

# Fields that describe the worker without deciding its bits: reported, never compared.
INFORMATIONAL = frozenset({"host", "device_index"})


def differences(mine: Fingerprint, reference: Fingerprint) -> list[str]:
    """The compared fields on which ``mine`` differs from ``reference``, as ``name: mine vs reference``."""
    names = sorted((set(mine) | set(reference)) - INFORMATIONAL)
    return [
        f"{name}: {mine.get(name, '-')} vs {reference.get(name, '-')}"
        for name in names
        if mine.get(name) != reference.get(name)
    ]


def _key(fingerprint: Fingerprint) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in fingerprint.items() if k not in INFORMATIONAL))


def group_fingerprint(fingerprints: Mapping[int, Fingerprint]) -> Fingerprint:
    """The fingerprint most workers share (a tie goes to the one of the lowest worker id): what the group's
    first epoch is formed of under exact mode. ``fingerprints``: worker id -> its fingerprint (not empty)."""
    if not fingerprints:
        raise ValueError("no fingerprint to choose from")
    counts = Counter(_key(fp) for fp in fingerprints.values())
    best = max(counts.values())
    first = min(w for w, fp in fingerprints.items() if counts[_key(fp)] == best)
    return fingerprints[first]


def refusal(worker: int, mine: Fingerprint, reference: Fingerprint) -> str | None:
    """The one line refusing ``worker`` under exact mode, or None when its fingerprint matches the group's."""
    diff = differences(mine, reference)
    if not diff:
        return None
    return (
        f"worker {worker} refused: exact mode needs identical hardware and software on every worker, and it "
        f"differs from the group in {'; '.join(diff)} (this worker vs the group); run it on a matching machine, "
        "or use recovery.reduction = fp32"
    )
