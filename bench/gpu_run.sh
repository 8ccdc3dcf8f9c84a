#!/usr/bin/env bash
# The GPU check's last command on the device machine (docs/gpu.md says how the calls before it
# carry onnxruntime-gpu there in parts): onnxruntime-gpu unpacked from the parts, then each step
# bounded by its seconds (0 skips it), results under $OUT:
#   PYTEST_SECONDS  `pytest -m gpu` (PYTEST_ARGS: the test files)
#   CHECK_SECONDS   bench/gpu_check.py
#   SERVE_SECONDS   bench/gpu_serve.py (WORKERS, SERVE_RUN_SECONDS)
#   DECODE_SECONDS  bench/decode.py --wide-only, per backend in DECODE_BACKENDS
#   TUNE_SECONDS    `mha tune` on the default model (TUNE_ARGS), its folder as $OUT/tune.tar.gz
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

step() {  # name, seconds, command...: one bounded step, its output in $OUT/name.log; 0 seconds skips it
    local name=$1 seconds=$2; shift 2
    ((seconds)) || return 0
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s"
}
summary() {  # a decode_wide JSON without its per-step lists
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: v for k, v in r.items() if not k.endswith('_ms')})" "$1"
}
tests=(tests/service/backends/test_gpu.py tests/e2e/test_cuda_shm.py tests/service/decode/test_sequences.py)
if (($#)); then tests=("$@"); fi
step pytest_gpu "${PYTEST_SECONDS:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider "${tests[@]}"
step gpu_check "${CHECK_SECONDS:-240}" python3 bench/gpu_check.py --out "$OUT"
step gpu_serve "${SERVE_SECONDS:-170}" python3 bench/gpu_serve.py --out "$OUT" --seconds "${SERVE_RUN_SECONDS:-3}" --workers "${WORKERS:-1,2,4}"
if ((${DECODE_SECONDS:-90})); then
    for backend in ${DECODE_BACKENDS:-ort-cuda torch ort-cpu}; do
        step "decode_$backend" "${DECODE_SECONDS:-90}" python3 bench/decode.py --wide-only --backend "$backend"
        [ bench/results -ef "$OUT" ] || cp bench/results/decode_wide_"$backend".json "$OUT/"
        summary "$OUT/decode_wide_$backend.json"
    done
fi
if ((${TUNE_SECONDS:-0})); then
    python3 -m service.cli export --out /tmp/mha-default > "$OUT/tune_export.log" 2>&1
    # shellcheck disable=SC2086  # TUNE_ARGS is a list of flags
    step tune "$TUNE_SECONDS" python3 -m service.cli tune --model-dir /tmp/mha-default --out /tmp/tune \
        ${TUNE_ARGS:---shape 1,64,128 --p99-ms 5 --concurrency 1,32 --seconds 1 --budget-s 150}
    tar czf "$OUT/tune.tar.gz" -C /tmp tune
    tail -8 "$OUT/tune.log"
fi
if [ -f "$OUT/pytest_gpu.log" ]; then tail -3 "$OUT/pytest_gpu.log"; fi
if [ -f "$OUT/gpu_serve.log" ]; then tail -15 "$OUT/gpu_serve.log"; fi
