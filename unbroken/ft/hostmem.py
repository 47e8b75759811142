"""Host memory of a training process: keep freed buffers for reuse instead of returning them every step.

A CPU training step allocates and frees the same large buffers every microbatch (logits and their
gradient are ``batch x seq_len x vocab`` floats: 16 MiB for the small model). glibc's malloc serves such
blocks with ``mmap`` and returns them to the kernel on ``free``, or trims the top of its heap once enough
is free there, and whether a given process ends up doing so depends on its allocation history (glibc
raises its mmap threshold after the first free of a large block). When it does, every microbatch
page-faults its buffers back in (docs/benchmarks.md has the count of minor faults per step and its cost).
``retain_freed_memory`` pins both thresholds, so buffers up to 32 MiB come from the heap and freed memory
stays in it: the process's resident size stays at its peak, and a steady step
faults nothing. Where there is no glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest allowed mmap threshold on 64-bit
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: trim only past 2 GiB free at the heap's top


def retain_freed_memory() -> bool:
    """Make this process's malloc serve blocks up to 32 MiB from its heap and keep freed memory (up to 2 GiB
    free at the heap's top) instead of giving it back to the kernel. Call it early in a training process.
    Returns whether the settings took effect."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the symbols already loaded into this process, libc's among them
    except (OSError, AttributeError):  # no mallopt: not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not done:
        log.warning("could not set malloc thresholds; freed memory may be returned to the kernel every step")
    return done
