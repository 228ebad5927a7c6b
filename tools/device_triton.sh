#!/usr/bin/env bash
# The Gluon kernels under another Triton release than the GPU machine's own, in one device call. The release
# travels slimmed (tools/slim_triton.sh VERSION -> .triton/, git-ignored: name .triton in carry):
#   bash tools/device_triton.sh VERSION [stage ...]        (default: tests time)
#   tests  the GPU tests of the kernels (Gluon and portable, padded and packed, sinks and caps, dispatch)
#          under VERSION, with SAGEBWD_CHECK_LAUNCH=1 (kernels/launch.py's direct re-launch checked against
#          Triton's own lookup on every call)
#   time   the op (speed.py --quick at 4K, sagebwd and cuDNN) under the machine's Triton, then under VERSION:
#          same call, same GPU, so the two can be compared
# TIMEOUT_<stage> caps a stage (seconds). Logs: $OUT/triton-VERSION.log, $OUT/speed-*.csv.
set -uo pipefail
version=${1:?usage: device_triton.sh VERSION [stage ...]}; shift
stages=${*:-tests time}
OUT=${OUT:-/tmp/sagebwd_out}
mkdir -p "$OUT"
LOG="$OUT/triton-$version.log"
site=/tmp/triton-$version
mkdir -p "$site"
tar xJf ".triton/triton-$version.tar.xz" -C "$site" || { echo "no .triton/triton-$version.tar.xz" | tee -a "$LOG"; exit 1; }
export PYTHONUNBUFFERED=1
repo=$PWD
mine() { PYTHONPATH="$repo" "$@"; }                  # the machine's Triton
# the carried one, first on the path; its backends found in its own tree (the machine's Triton's entry points
# name the AMD backend, which the slim copy leaves out)
theirs() { PYTHONPATH="$site:$repo" TRITON_BACKENDS_IN_TREE=1 "$@"; }
theirs python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, triton.__file__)" \
  2>&1 | tee -a "$LOG"
status=0
for stage in $stages; do
  limit_var="TIMEOUT_$stage"
  echo "=== stage $stage" | tee -a "$LOG"
  case $stage in
    tests)
      SAGEBWD_CHECK_LAUNCH=1 theirs timeout "${!limit_var:-480}" python3 -m pytest tests/test_backward_hopper.py \
        tests/test_dispatch.py tests/test_sinks_softcap.py tests/test_segments.py tests/test_kernels.py -m gpu -q -rf \
        -p no:cacheprovider -n 14 2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    time)
      for who in mine theirs; do
        $who timeout "${!limit_var:-240}" python3 benchmarks/speed.py --quick --seqlens 4096 --methods sagebwd cudnn \
          --csv "$OUT/speed-$who.csv" 2>&1 | tee -a "$LOG" | sed -n '/^== /,$p'
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    *) echo "unknown stage $stage" | tee -a "$LOG"; status=1 ;;
  esac
done
exit $status
