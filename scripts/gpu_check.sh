#!/usr/bin/env bash
# The GPU check: on a machine with CUDA GPUs, install unbroken into a virtual environment, run the GPU-only
# tests (tests/test_gpu.py: bf16 autocast step, MeCeFO's efficient backward and bases on CUDA, NCCL
# all-reduces, and with >= 2 GPUs a kill -9 of one NCCL rank that the survivor recovers from) with
# tests/test_efficient.py, then print the figures docs/gpu.md asks for (MeCeFO efficient microbatch time and
# memory, basis refresh time). Without a CUDA GPU it prints one line and exits with status 2.
#
# Usage: scripts/gpu_check.sh              from anywhere; works in the repository that holds this script
#   GPU_VENV=path        the environment to use or create (default .venv-gpu); one whose torch sees CUDA is
#                        used as it is (nothing is installed: machines without network access)
#   GPU_CHECK_FLAVOUR    the model of the microbatch figures (default 350m)
#   GPU_CHECK_BEFORE=1   also time the float64 full-SVD basis on the CPU (about 90 s or more)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${GPU_VENV:-.venv-gpu}
FLAVOUR=${GPU_CHECK_FLAVOUR:-350m}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_check: no CUDA GPU on this machine (nvidia-smi lists none); nothing was installed or run" >&2
    exit 2
fi

cuda_ok() { [[ -x "$1/bin/python" ]] && "$1/bin/python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

if ! cuda_ok "$VENV"; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e . pytest pytest-timeout
    if ! cuda_ok "$VENV"; then
        echo "gpu_check: the torch installed in $VENV does not see the GPU (a CPU-only build, or a driver too old)" >&2
        exit 3
    fi
fi
PY="$VENV/bin/python"

echo "== machine"
nvidia-smi -L
"$PY" - <<'EOF'
import platform, torch, torch.distributed as dist
nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}; Python {platform.python_version()}")
EOF

echo "== tests"
status=0
"$PY" -m pytest -q -s -rs -p no:cacheprovider tests/test_gpu.py tests/test_efficient.py || status=$?

echo "== MeCeFO efficient microbatch ($FLAVOUR, seq_len 256, batch 8, rank 64), bf16 autocast and float32"
"$PY" -m unbroken.lab.bench_mecefo --device cuda --flavour "$FLAVOUR" --seq-len 256 --batch 8 --data random --autocast
"$PY" -m unbroken.lab.bench_mecefo --device cuda --flavour "$FLAVOUR" --seq-len 256 --batch 8 --data random

echo "== MeCeFO basis refresh (LLaMA-7B FFN shapes, rank 64)"
"$PY" -m unbroken.lab.bench_mecefo --refresh 4096x11008,11008x4096 --device cuda --repeats 20
"$PY" -m unbroken.lab.bench_mecefo --refresh 4096x11008,11008x4096 --device cpu --repeats 5
if [[ "${GPU_CHECK_BEFORE:-0}" == 1 ]]; then
    "$PY" -m unbroken.lab.bench_mecefo --refresh 4096x11008 --method svd --repeats 1
fi

if [[ $status -ne 0 ]]; then
    echo "gpu_check: tests failed (pytest status $status)" >&2
fi
exit $status
