#!/usr/bin/env bash
# GPU check for gpuvisor on a machine with an NVIDIA GPU and no network.
#
# What it does: installs gpuvisor from the wheels folder beside this script
# into a fresh virtual environment, runs a finetune job on CUDA through the
# job runner, and, where the engine's CUDA build is installed, serves a model
# on the GPU (a GGUF on llama.cpp at 1, 4 and 16 streams); where vLLM is at
# hand, it serves a Hugging Face model on vLLM at 1, 16 and 64 streams. It
# prints the placement, the job's CUDA_VISIBLE_DEVICES, the real VRAM use
# against the estimate, and tokens/s (bench/gpu_check.py).
# With two or more GPUs the finetune books all of them and trains
# data-parallel (one rank per GPU, NCCL); the report gives each GPU's memory
# use while it ran (nvidia-smi --query-gpu) and each rank's peak against the
# job's estimate. With one GPU it runs on that one and says so.
# `-- --ft-gpus N` books N GPUs instead of all.
#
# Dependencies, decided: the machine brings torch, transformers and peft (the
# venv sees them: --system-site-packages); everything else gpuvisor needs at
# run time (msgspec, aiosqlite, gguf, watchfiles, xllamacpp, aiohttp, ...) is
# installed from ./wheels with pip --no-index. The job runner and the server
# import them, so they are installed, not avoided. ./wheels/cuda/, if present,
# holds the engine's CUDA build (an xllamacpp wheel), installed over the CPU one.
#
# vLLM (models of kind hf) is never in the bundle (its CUDA build and torch
# are gigabytes): VLLM_PYTHON names a Python that imports vllm (its venv
# gets our wheel and msgspec from ./wheels, no other dependency, as `make
# install-vllm` does); without it the check's own Python serves vLLM where
# the machine's site packages hold vllm; else the vLLM check is skipped and
# the report says why.
#
# Build the bundle on a machine with network (same Python minor version and
# platform as the GPU machine): `make gpu-check-bundle` writes
# build/gpu_check/ = gpu_check.sh, gpu_check.py, tiny_hf.py, wheels/.
#
# Usage: [VLLM_PYTHON=...] gpu_check.sh [--cpu-dry-run] [--no-install] [-- ARGS for gpu_check.py]
#   (gpu_check.py --kinds llamacpp,vllm picks the engines, --no-finetune skips the finetune)
#   --cpu-dry-run  every step on the CPU, small sizes (checks the script itself)
#   --no-install   use the current python (PYTHON, default python3) as it is
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
DRY=0
INSTALL=1
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-dry-run) DRY=1 ;;
        --no-install) INSTALL=0 ;;
        --) shift; break ;;
        *) echo "unknown option: $1 (see the head of $0)" >&2; exit 2 ;;
    esac
    shift
done

if [ "$INSTALL" = 1 ]; then
    [ -d "$HERE/wheels" ] || { echo "no wheels folder at $HERE/wheels: run make gpu-check-bundle" >&2; exit 2; }
    VENV="$(mktemp -d "${TMPDIR:-/tmp}/gvcheck-venv.XXXXXX")"
    trap 'rm -rf "$VENV"' EXIT
    "$PYTHON" -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install --quiet --no-index --find-links "$HERE/wheels" gpuvisor
    if compgen -G "$HERE/wheels/cuda/xllamacpp-*.whl" > /dev/null; then
        "$VENV/bin/python" -m pip install --quiet --no-index --no-deps --force-reinstall \
            "$HERE"/wheels/cuda/xllamacpp-*.whl
    fi
    PYTHON="$VENV/bin/python"
fi

"$PYTHON" -c 'import torch, transformers, peft' \
    || { echo "torch, transformers and peft must be installed on this machine" >&2; exit 2; }

VLLM_ARGS=()
if [ -n "${VLLM_PYTHON:-}" ]; then
    if [ "$INSTALL" = 1 ] && ! "$VLLM_PYTHON" -m pip install --quiet --no-index --no-deps \
            --find-links "$HERE/wheels" gpuvisor msgspec; then
        echo "gpu_check: cannot install gpuvisor's worker into VLLM_PYTHON=$VLLM_PYTHON" \
             "(the wheels are for another Python?): the vLLM check is skipped" >&2
    else
        VLLM_ARGS=(--vllm-python "$VLLM_PYTHON")
    fi
elif "$PYTHON" -c 'import vllm' > /dev/null 2>&1; then
    VLLM_ARGS=(--vllm-python "$PYTHON")
fi
if [ "$DRY" = 1 ]; then
    set -- --cpu-dry-run --steps 3 --hidden 64 --layers 2 --max-tokens 24 ${VLLM_ARGS[@]+"${VLLM_ARGS[@]}"} "$@"
elif ! nvidia-smi -L > /dev/null 2>&1; then
    echo "nvidia-smi finds no GPU (use --cpu-dry-run to check the script itself)" >&2
    exit 2
else
    N_GPUS="$(nvidia-smi -L | grep -c '^GPU ' || true)"
    if [ "$N_GPUS" -ge 2 ]; then
        echo "gpu_check: $N_GPUS GPUs: the finetune trains data-parallel on all of them (unless --ft-gpus)" >&2
    else
        echo "gpu_check: one GPU: the finetune runs on one (data-parallel needs two or more)" >&2
    fi
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >&2
    set -- ${VLLM_ARGS[@]+"${VLLM_ARGS[@]}"} "$@"
fi

# Finetune child processes: one OpenMP thread each unless told otherwise.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
if [ -f "$HERE/../pyproject.toml" ] && [ -d "$HERE/../supervisor" ]; then
    # In the repository: run as a module from its root (bench/ holds other modules).
    cd "$HERE/.." && exec "$PYTHON" -m bench.gpu_check "$@"
fi
cd "$HERE" && exec "$PYTHON" "$HERE/gpu_check.py" "$@"
