#!/usr/bin/env bash
# bench/gpu_native.sh: bench/gpu_native.py on a GPU machine that reaches no package registry.
#
# First, once, on any machine that reaches PyPI:
#     bench/gpu_native.sh fetch
# downloads into .wheels/ (git-ignored, about 1.6 MB) what the program imports beyond what a
# CUDA image with PyTorch already has (torch, numpy, einops, safetensors, sentencepiece,
# matplotlib, httpx, prometheus-client, requests, pyyaml...): kyutai's moshi==0.2.13 and
# huggingface_hub 0.36.2 (moshi's loaders import it; a newer 1.x is not what moshi was
# tested with), and orjson, soxr, msgspec, redis, PyJWT (duplex-serve's own imports), at the
# versions .venv-moshi tests. Wheels for CPython 3.12 on x86-64 by default; match the GPU
# machine's python3 with WHEEL_PYTHON (WHEEL_PYTHON=3.11 fetches 3.11's).
#
# Then, on the machine with the GPU (an H100 or H200; it needs no package registry), in the
# repository root of a checkout that has .wheels/ (copy it along: it is git-ignored):
#     OUT=/tmp/gpu-native bash bench/gpu_native.sh
# installs the wheels with pip --no-deps --no-index into /tmp/gpu-native-site (first on
# PYTHONPATH; the machine's own packages stay as they are), then runs
#     python3 -m bench.gpu_native --out "$OUT" [ARGS...]
# under `timeout` (GPU_NATIVE_TIMEOUT_S, default 540 s; the program keeps to its own
# --budget-s, 420 s by default, and writes what it has measured as it goes). Into $OUT:
# gpu_native.json, gpu_native.png, gpu_native.md, gpu_native.log and nvidia-smi.txt.
# Extra arguments go to the program (bash bench/gpu_native.sh --context 1500).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${GPU_NATIVE_WHEELS:-.wheels}
PYTHON=${PYTHON:-python3}
# what .venv-moshi runs (Makefile: moshi==0.2.13 --no-deps; the rest from its resolve)
PACKAGES=(moshi==0.2.13 huggingface_hub==0.36.2 orjson==3.13.0 soxr==1.1.0 msgspec==0.23.0
          redis==5.3.1 PyJWT==2.15.1)

if [[ ${1:-} == fetch ]]; then
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: \
        --python-version "${WHEEL_PYTHON:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
    ls -l "$WHEELS"
    exit 0
fi

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]} == 0)); then
    echo "no wheels in $WHEELS/: run 'bench/gpu_native.sh fetch' where PyPI is reachable," \
         "and carry $WHEELS/ to this machine with the checkout (it is git-ignored)" >&2
    exit 2
fi
SITE=${GPU_NATIVE_SITE:-/tmp/gpu-native-site}
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

out=${OUT:-test-artifacts/gpu_native}
mkdir -p "$out"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
timeout --kill-after=15 "${GPU_NATIVE_TIMEOUT_S:-540}" \
    "$PYTHON" -m bench.gpu_native --out "$out" "$@" 2>&1 | tee "$out/gpu_native.log"
