#!/usr/bin/env bash
# The GPU check's last command on the device machine (docs/gpu.md says how the calls before it
# carry onnxruntime-gpu there in parts): onnxruntime-gpu unpacked from the parts, then
# `pytest -m gpu`, bench/gpu_check.py and bench/gpu_serve.py, each bounded, results under $OUT.
# usage (on the device, from the project root): bash bench/gpu_run.sh [PYTEST_ARGS...]
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
parts=(/tmp/ortparts/part* .gpu/c/part*)
cat "${parts[@]}" > /tmp/ort.tar.xz
echo "$(cat .gpu/wheels/ORT_TAR_SHA256)  /tmp/ort.tar.xz" | sha256sum -c - || { echo "onnxruntime-gpu parts do not add up"; exit 3; }
mkdir -p /tmp/site && tar -xJf /tmp/ort.tar.xz -C /tmp/site || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, onnxruntime as ort; print('onnxruntime', ort.__version__, ort.get_available_providers())"

step() {  # name, seconds, command...: one bounded step, its output in $OUT/name.log
    local name=$1 seconds=$2; shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s"
}
tests=(tests/service/backends/test_gpu.py tests/e2e/test_cuda_shm.py tests/service/decode/test_sequences.py)
if (($#)); then tests=("$@"); fi
step pytest_gpu "${PYTEST_SECONDS:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider "${tests[@]}"
step gpu_check "${CHECK_SECONDS:-240}" python3 bench/gpu_check.py --out "$OUT"
step gpu_serve "${SERVE_SECONDS:-170}" python3 bench/gpu_serve.py --out "$OUT" --seconds "${SERVE_RUN_SECONDS:-3}" --workers "${WORKERS:-1,2,4}"
tail -5 "$OUT/pytest_gpu.log"
tail -15 "$OUT/gpu_serve.log"
