#!/usr/bin/env bash
# Everything a GPU check needs, in one device call: versions, the GPU test suite, the accuracy table and
# the speed table. Full logs go under $OUT; short tables are printed last. The GPU tests are compile-bound:
# pytest-xdist runs them in 8 processes.
#   bash benchmarks/device_run.sh [tests] [accuracy] [speed]      (default: all three)
set -uo pipefail
OUT=${OUT:-/tmp/sagebwd_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=${*:-tests accuracy speed}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
status=0
for stage in $stages; do
  case $stage in
    tests)    python3 -m pytest tests -m gpu -q -rf -p no:cacheprovider -n 8 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25 || status=1 ;;
    accuracy) python3 benchmarks/accuracy.py --check --csv "$OUT/accuracy.csv" 2>&1 | tee "$OUT/accuracy.log" || status=1 ;;
    speed)    python3 benchmarks/speed.py --csv "$OUT/speed.csv" 2>&1 | tee "$OUT/speed.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
