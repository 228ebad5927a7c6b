#!/usr/bin/env bash
# A Triton release small enough to travel to the GPU machine (a run carries 64 MiB to it; a wheel is
# 200-290 MB), for running the Gluon kernels there under another Triton than the machine's own (3.6):
#   bash tools/slim_triton.sh 3.9.0        -> .triton/triton-3.9.0.tar.xz (40-57 MB)
# It drops what the kernels do not use (the profiler, the AMD backend, CUPTI, cuobjdump, the ptxas sm_90 does not
# use), strips libtriton.so's symbols (470 MB -> 180 MB for 3.7) and packs the rest with xz. The wheel is for the GPU
# machine's Python (3.12). tools/device_triton.sh unpacks it there.
set -euo pipefail
version=${1:?usage: slim_triton.sh VERSION}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
rm -rf "$work"/triton/backends/amd "$work"/triton/backends/nvidia/lib/cupti "$work"/triton/backends/nvidia/lib/cupti-blackwell \
  "$work"/triton/profiler "$work"/triton/instrumentation "$work"/triton/_C/libproton.so \
  "$work"/triton/backends/nvidia/bin/cuobjdump
# one ptxas: the one the release runs for sm_90 (3.9 on: "ptxas-blackwell", CUDA 13; before: "ptxas", 12.x)
if grep -q "if arch < 90" "$work"/triton/backends/nvidia/compiler.py; then
  rm "$work"/triton/backends/nvidia/bin/ptxas
else
  rm -f "$work"/triton/backends/nvidia/bin/ptxas-blackwell
fi
strip --strip-unneeded "$work"/triton/_C/libtriton.so
find "$work" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$root/.triton"
(cd "$work" && tar cf - triton triton-*.dist-info) | xz -T0 -9 > "$root/.triton/triton-$version.tar.xz"
ls -l "$root/.triton/triton-$version.tar.xz"
