#!/usr/bin/env bash
# What bench/gpu_run.sh needs carried to an offline device machine (Python 3.12 there, at most
# 64 MiB a call; docs/gpu.md): onnxruntime-gpu without its TensorRT provider as an xz tar split in
# four parts (.gpu/xzparts/, one per call), and in .gpu/wheels/ the wheels the device image lacks
# and the tar's sha256. Run from the project root; add "/.gpu/" to .git/info/exclude.
# Then, call by call: part00 and .gpu/wheels (install the wheels into /tmp/site), part01, part02,
# each copied to /tmp/ortparts/; the last call carries part03 in .gpu/c/ and runs gpu_run.sh.
set -euo pipefail
dest=.gpu
mkdir -p "$dest/wheels" "$dest/xzparts" "$dest/c"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
pin() { grep -E "^$1==" constraints.txt | cut -d' ' -f1; }
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest/ortwheel" "$(pin onnxruntime-gpu)"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest/wheels" \
    "$(pin grpcio)" "$(pin grpcio-health-checking)" "$(pin grpcio-reflection)" "$(pin protobuf)" \
    "$(pin opentelemetry-api)" "$(pin opentelemetry-sdk)" "$(pin opentelemetry-semantic-conventions)"
unpacked=$(mktemp -d)
(cd "$unpacked" && python3 -m zipfile -e "$OLDPWD"/"$dest"/ortwheel/*.whl . \
    && rm -f onnxruntime/capi/libonnxruntime_providers_tensorrt.so \
    && tar cf - . | xz -9 -T0 > "$OLDPWD/$dest/ort.tar.xz")
rm -rf "$unpacked" "$dest"/xzparts/part*
split -n 4 -d "$dest/ort.tar.xz" "$dest/xzparts/part"
(cd "$dest" && sha256sum ort.tar.xz | cut -d' ' -f1) > "$dest/wheels/ORT_TAR_SHA256"
ls -la "$dest/xzparts" "$dest/wheels"
