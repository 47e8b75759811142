"""torchtitan 0.3.0 on a CPU: the adjustments its CUDA assumptions need, applied only on a CPU device.

torchtitan assumes an accelerator. On a host whose job trains on the CPU (``ctx.device`` is the CPU) the
integration calls ``importing()`` around torchtitan's first import, ``after_import()`` once it is imported and
``adjust_config(config)`` on the job's torchtitan config; on a GPU none of them is called and torchtitan runs
as it is. Each adjustment names the torchtitan behaviour it adjusts (numbered as docs/torchtitan.md lists them):

1. ``triton``: torchtitan imports its async expert-parallel kernels (``minimal_async_ep.kernels``, written in
   triton) on the Trainer's import path without declaring triton, a 1 GB install that a CPU cannot use: a
   stand-in module takes their place (calling one of its kernels raises).
2. The device type: ``tools.utils`` takes "the available accelerator, else cuda" at import, so on a host with
   none it would make CUDA calls: the lookup answers "cpu" while torchtitan is imported (then device "cpu" and,
   from torch's backend map, gloo).
3. The device module: the metrics' memory monitor calls ``get_device_name``, ``get_device_properties``,
   ``reset_peak_memory_stats``, ``empty_cache`` and ``memory_stats``, which ``torch.cpu`` lacks: the metrics
   module gets a stand-in that answers them for the host.
4. The SPMD backend: the default ``spmd_types`` refuses parameters that are not DTensors on the full mesh:
   ``partial_dtensor`` (plain DTensor sharding, as FSDP2 and tensor parallelism make it).
5. Attention: FlexAttention has no backward on the CPU and varlen attention needs CUDA: the model's attention
   runs ``F.scaled_dot_product_attention`` (causal; the integration's data has no document masks anyway).

Two more that a CPU run of plain torchtitan needs are not adjusted here, since the integration does not reach
them: FSDP2's ``PREMUL_SUM`` reduction (gloo lacks it), which ``ctx.register_state`` replaces by a sum on every
FSDP unit on any device; and ``torch.distributed.set_timeout`` (missing from torch 2.13), called by torchtitan's
``train()`` only, which the integration's loop replaces (the replica's collectives have unbroken's bound).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

log = logging.getLogger(__name__)

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


def _no_triton(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):  # what the import system and inspect ask a module (__file__, __path__, ...)
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{KERNELS_MODULE}.{name} needs triton and a GPU (this worker trains on the CPU)")

    return kernel


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Around torchtitan's first import on a CPU worker: adjustments 1 and 2."""
    # 1. triton: a stand-in for the one module of triton kernels torchtitan imports unconditionally. A top-level
    # stand-in ``triton`` package would break torch._inductor instead, so only this module is replaced.
    if importlib.util.find_spec("triton") is None and KERNELS_MODULE not in sys.modules:
        stand_in = types.ModuleType(KERNELS_MODULE, "stand-in: torchtitan's triton kernels on a CPU worker")
        stand_in.__getattr__ = _no_triton  # type: ignore[method-assign]  # every kernel name resolves, and raises
        sys.modules[KERNELS_MODULE] = stand_in
    # 2. torchtitan.tools.utils computes its device type (and module) once, at import, from torch's available
    # accelerator, "cuda" if there is none: it answers "cpu" for that import only.
    from torch import _utils

    lookup = _utils._get_available_device_type
    _utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401 - computes the device type now
    finally:
        _utils._get_available_device_type = lookup
    yield


class _HostDevice:
    """3. What the metrics' memory monitor asks a device module, answered for the host (``torch.cpu`` lacks it)."""

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_properties(device: object = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}


def after_import() -> None:
    """Once torchtitan is imported on a CPU worker: adjustment 3."""
    from torchtitan.components import metrics

    metrics.device_module = _HostDevice()  # the monitor's calls (module docstring, 3)


def adjust_config(config: Any) -> list[str]:
    """Adjustments 4 and 5 on the job's torchtitan ``Trainer.Config`` (before the Trainer is built); returns one
    line per setting changed."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    changed = []
    parallelism = config.parallelism
    if parallelism.spmd_backend != "partial_dtensor":  # 4.
        changed.append(f"parallelism.spmd_backend {parallelism.spmd_backend} -> partial_dtensor")
        parallelism.spmd_backend = "partial_dtensor"
    model = config.model_spec.model if config.model_spec is not None else None
    masked = [] if model is None else list(model.traverse(FlexAttention.Config | VarlenAttention.Config))
    for _, _, parent, attr in masked:  # 5.
        if parent is not None:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    if masked:
        changed.append(f"attention of {len(masked)} blocks -> scaled_dot_product_attention (causal)")
    return changed


def on_cpu(device: torch.device) -> bool:
    """Whether the adjustments apply to a worker training on ``device``."""
    return device.type == "cpu"
