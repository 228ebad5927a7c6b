#!/usr/bin/env bash
# Where the one-launch Hopper backward's warps wait, in one device call: Nsight Compute on its second launch
# (fused_backward.py --once), then the report's details page and per-instruction (SASS) stall samples.
#   bash tools/ncu_one_launch.sh [SHAPE] [CAUSAL yes|no] [VARIANT]     (default: d64_n4k no block_q=64)
# Output under $OUT: details.txt, source_sass.csv (columns stall_*: samples per reason and instruction).
set -uo pipefail
OUT=${OUT:-/tmp/sagebwd_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
cd tools
timeout 400 "$NCU" --clock-control none --kernel-name regex:dkdv --launch-skip 1 --launch-count 1 \
  --section SchedulerStats --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SpeedOfLight -o "$OUT/one_launch" \
  python3 fused_backward.py --once --shapes "${1:-d64_n4k}" --causal "${2:-no}" --variants "${3:-block_q=64}"
"$NCU" --import "$OUT/one_launch.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" --import "$OUT/one_launch.ncu-rep" --page source --print-source sass --csv > "$OUT/source_sass.csv" 2>&1
rm -f "$OUT/one_launch.ncu-rep"
grep -E "Duration|Issued Warp|No Eligible|Eligible Warps|Warp Cycles Per Issued|L2 Cache Throughput|Compute \(SM\)" \
  "$OUT/details.txt"
