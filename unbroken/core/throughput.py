"""Throughput in the units GPU users compare: tokens per second per worker and per GPU, and MFU. Pure Python.

The one definition every reader uses (step records, the run summary, the status page, TensorBoard):

- ``tokens_per_s``: the tokens of a step's counted microbatches over its wall time (the step record's own);
- ``tokens_per_s_per_worker``: that over the worker processes alive in the step (every rank of every replica);
- ``tokens_per_s_per_gpu``: that over the GPUs they use (``train.workers_per_gpu`` workers may share one);
  not defined on the CPU;
- MFU (model FLOPs utilisation): ``tokens_per_s_per_gpu x flops_per_token / peak``, where ``flops_per_token``
  is the model's training FLOPs per token (``flavours.flops_per_token``: 6 N + 12 L d T; a user's own model
  gives its own to ``ft``) and ``peak`` the device's dense peak for the precision it computes in, from
  ``PEAK_TFLOPS`` or ``train.peak_tflops``. Recomputation (activation checkpointing, MeCeFO's FFN) is not
  model FLOPs: it lowers MFU, as in PaLM's definition.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets, per precision the matmuls run in: bf16
# (autocast), tf32 (float32 with TF32 matmuls allowed) and fp32. Matched against torch.cuda.get_device_name()
# in order (the first pattern found wins, so the more specific come first).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"\bH100\b", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM (HBM3)
    (r"\bGH200\b", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH200\b", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bA100\b", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bA10\b", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def table_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of ``device_name`` (as CUDA names it) in ``precision`` (bf16, tf32 or fp32);
    None for a device not in ``PEAK_TFLOPS`` (give ``train.peak_tflops``)."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1] (more would mean the FLOPs or the peak are wrong); NaN when any input is
    unknown (zero or NaN)."""
    if not (tokens_per_s_per_gpu > 0 and flops_per_token > 0 and peak_tflops > 0):
        return math.nan
    return tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12)


def gpus_in_use(workers: int, workers_per_gpu: int) -> int:
    """The GPUs ``workers`` processes use when ``workers_per_gpu`` of them share one."""
    return max(1, math.ceil(workers / max(1, workers_per_gpu)))


def step_throughput(
    tokens: int,
    seconds: float,
    workers: int,
    gpus: int,
    flops_per_token: float,
    peak_tflops: float,
) -> dict[str, float]:
    """A step record's throughput fields: ``tokens`` counted in ``seconds`` of wall time by ``workers``
    processes on ``gpus`` GPUs (0 on the CPU: no per-GPU rate, no MFU)."""
    rate = tokens / seconds if seconds > 0 else math.nan
    per_gpu = rate / gpus if gpus > 0 else math.nan
    return {
        "workers": workers,
        "gpus": gpus,
        "tokens_per_s_per_worker": rate / workers if workers > 0 else math.nan,
        "tokens_per_s_per_gpu": per_gpu,
        "flops_per_token": flops_per_token,
        "peak_tflops": peak_tflops,
        "mfu": mfu(per_gpu, flops_per_token, peak_tflops),
    }


def run_throughput(steps: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """A run's throughput from its committed steps' records (the fields of ``step_throughput``): tokens over
    the summed step time, per worker and per GPU weighted by each step's own counts, and MFU over the same
    time. Records without the fields (an older run) count towards ``tokens_per_s`` only."""
    tokens = seconds = worker_seconds = gpu_seconds = model_flops = peak_flops = 0.0
    for r in steps:
        t = r.get("step_time_s", math.nan)
        if not t > 0:
            continue
        tokens += r["tokens"]
        seconds += t
        worker_seconds += t * r.get("workers", 0)
        gpus = r.get("gpus", 0)
        if gpus > 0:
            gpu_seconds += t * gpus
            if r.get("flops_per_token", 0) > 0 and r.get("peak_tflops", 0) > 0:
                model_flops += r["tokens"] * r["flops_per_token"]
                peak_flops += t * gpus * r["peak_tflops"] * 1e12
    return {
        "tokens_per_s": tokens / seconds if seconds else math.nan,
        "tokens_per_s_per_worker": tokens / worker_seconds if worker_seconds else math.nan,
        "tokens_per_s_per_gpu": tokens / gpu_seconds if gpu_seconds else math.nan,
        "mfu": model_flops / peak_flops if peak_flops else math.nan,
    }
