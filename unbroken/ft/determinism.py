"""A worker's numerics: deterministic kernels switched on in its process, the fingerprint it reports at join,
and the one line that stops a run when an op has no deterministic implementation.

``apply(on)`` runs in every worker process as ``unbroken.ft`` sets it up (``process.Job.setup_process``),
whoever started it (``unbroken train`` / ``launch``, the per-host agent, torchrun, a plain ``python
script.py``): ``torch.use_deterministic_algorithms(True)`` (strict: its warn-only mode keeps the
non-deterministic attention backward on GPUs), ``CUBLAS_WORKSPACE_CONFIG`` before cuBLAS starts, cuDNN
deterministic and no cuDNN autotuning. ``settings()`` reads back what is in force; it is part of the
fingerprint (``core.numerics``), so a run's records say what every worker ran with.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import socket

import torch

from unbroken.core.numerics import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_ENV

_VALID_WORKSPACES = (":4096:8", ":16:8")  # the values cuBLAS documents as deterministic
_NO_DETERMINISTIC = re.compile(r"^(.+?) does not have a deterministic implementation")


def apply(on: bool) -> None:
    """Switch deterministic kernels on (``on``) in this process, or leave torch's defaults (off).

    Raises:
        ValueError: ``on``, CUDA was initialised before and ``CUBLAS_WORKSPACE_CONFIG`` is not set to a
            deterministic value (cuBLAS may have read the environment already): call ``ft.init()`` before
            any CUDA work, or export the variable.
    """
    if not on:
        return
    if os.environ.get(CUBLAS_WORKSPACE_ENV) not in _VALID_WORKSPACES:
        if torch.cuda.is_initialized():
            raise ValueError(
                f"deterministic kernels (train.deterministic) need {CUBLAS_WORKSPACE_ENV}={CUBLAS_WORKSPACE} before "
                "CUDA starts, and CUDA was already used in this process: call ft.init() before any CUDA work, or "
                f"export {CUBLAS_WORKSPACE_ENV}={CUBLAS_WORKSPACE}"
            )
        os.environ[CUBLAS_WORKSPACE_ENV] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def settings() -> dict[str, str]:
    """The deterministic settings in force in this process, as fingerprint fields."""
    return {
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()).lower(),
        "deterministic_warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()).lower(),
        "cublas_workspace_config": os.environ.get(CUBLAS_WORKSPACE_ENV, ""),
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic).lower(),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark).lower(),
    }


def _cublas_version() -> str:
    """cuBLAS's version as the library loaded in this process reports it (``cublasLtGetVersion``)."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcublasLt.so.{major}", "libcublasLt.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        return str(lib.cublasLtGetVersion())
    return "unknown"


def _torch_build() -> str:
    """A short digest of torch's build configuration (compiler, BLAS, ISA flags it was built with)."""
    return hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:12]


def local_fingerprint(device: torch.device) -> dict[str, str]:
    """This worker's fingerprint (``core.numerics``): what decides the bits it computes on ``device``, with the
    deterministic settings in force (call after ``apply``)."""
    fp = {
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "torch_build": _torch_build(),
        "device_type": device.type,
        "matmul_precision": torch.get_float32_matmul_precision(),
        **settings(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fp.update(
            {
                "device_index": str(device.index),
                "gpu": props.name,
                "gpu_sm_count": str(props.multi_processor_count),
                "gpu_capability": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda or "none",
                "cublas": _cublas_version(),
                "cudnn": str(torch.backends.cudnn.version()),
                "tf32_matmul": str(torch.backends.cuda.matmul.allow_tf32).lower(),
                "tf32_cudnn": str(torch.backends.cudnn.allow_tf32).lower(),
            }
        )
    else:
        fp.update(
            {
                "cpu_isa": torch.backends.cpu.get_cpu_capability(),
                "cpu_arch": platform.machine(),
                "intra_op_threads": str(torch.get_num_threads()),
            }
        )
    return fp


def nondeterministic_op(error: BaseException) -> str | None:
    """The op named by torch's error for an op without a deterministic implementation; None for other errors."""
    if not isinstance(error, RuntimeError):
        return None
    match = _NO_DETERMINISTIC.match(str(error).strip())
    return match.group(1) if match else None


def stop_line(op: str) -> str:
    """Why the run stops when ``op`` has no deterministic implementation, and the setting to change."""
    return (
        f"{op} has no deterministic implementation on this device, and train.deterministic is on (by default under "
        "recovery.reduction = exact); set --train.deterministic=off (exact mode is then bitwise only where every "
        "kernel happens to be reproducible), use recovery.reduction = fp32, or avoid the op"
    )
