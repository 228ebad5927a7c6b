#!/usr/bin/env bash
# Everything a GPU check needs, in one device call. Stages, in the order given:
#   tests     GPU test suite (pytest -m gpu, 8 processes; compile-bound)
#   accuracy  accuracy table          -> $OUT/accuracy.csv
#   speed     quick speed table       -> $OUT/speed.csv   (speed.py --quick: 8 shapes)
#   sweep     full kernel sweep       -> $OUT/sweep.csv   (speed.py: 22 shapes, + sageattention if carried)
#   e2e       Llama-3.2-1B training tokens/s -> $OUT/e2e.csv
#   plot      $OUT/bench.png from sweep.csv (else speed.csv) and e2e.csv, if matplotlib imports there
#   bench     = sweep e2e plot
#   breakdown per-kernel times, registers/spills and SASS opcode counts at N=4096, D=128 and D=64
#   kernels   forward and dK/dV kernels alone, portable against Gluon (forward_kernels.py, backward_kernels.py)
#   profile   each kernel's time and the wall time of one fwd+bwd step (tools/profile_op.py PROFILE_ARGS)
#   study     the tokens-per-step study (examples/scale_study.py): builds the code corpus, then runs the
#             study's next cells for STUDY_S seconds (default 540) -> $OUT/study.tgz (docs/fidelity/study,
#             to unpack into the repository: the next call resumes from it)
#             on a machine of several GPUs, STUDY_ARGS="--devices 0 1 2 3" runs a cell on each at once
#   bash tools/device_run.sh [stage ...]       (default: tests accuracy speed)
# Extra arguments per script: SPEED_ARGS, SWEEP_ARGS, E2E_ARGS, ACCURACY_ARGS (e.g. E2E_ARGS="--seqlens 8192");
# TESTS_ARGS: the tests to run instead of the whole GPU suite (pytest's paths and -k).
# A time limit per stage in seconds: TIMEOUT_<stage> (e.g. TIMEOUT_tests=330), so one stage cannot eat the call.
# Carried wheels: every .whl/*.whl is installed with --no-deps into /tmp/site first. sageattention 1.0.6 is
# pure Python (20 KB): `pip download sageattention==1.0.6 --no-deps -d .whl` here (.whl/ is git-ignored),
# then name .whl in the device call's carry list.
# Output: $OUT/run.log (everything), the CSVs, bench.png: at most 6 files, under the 8 a GPU machine run returns. Each script's short table is printed again at the very end.
set -uo pipefail
OUT=${OUT:-/tmp/sagebwd_out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
TMP=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=${*:-tests accuracy speed}
stages=${stages//bench/sweep e2e plot}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && echo "installed carried wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
  fi
} 2>&1 | tee -a "$LOG"
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"

status=0
declare -A took
run() {  # run STAGE CMD...: output to run.log and $TMP/STAGE.log; a failure marks the run failed
  local stage=$1 t0=$SECONDS rc; shift
  echo "=== stage $stage: $*" | tee -a "$LOG"
  local limit_var="TIMEOUT_$stage"
  timeout "${!limit_var:-3000}" "$@" 2>&1 | tee "$TMP/$stage.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  took[$stage]="$((SECONDS - t0)) s, exit $rc"
  echo "=== stage $stage: ${took[$stage]}" | tee -a "$LOG"
}
for stage in $stages; do
  case $stage in
    tests)    # test_large.py needs ~25 GB at once: alone, after the rest. With several GPUs the workers are
              # spread over them (tests/conftest.py), 4 a GPU; -v names each failure as it happens, so a
              # stage cut off by its time limit still says which tests failed.
              # (SAGEBWD_TEST_GPUS set by the caller: those GPUs only, the others left free for another job)
              ngpu=$(nvidia-smi -L | wc -l)
              [ "$ngpu" -gt 1 ] && [ -z "${SAGEBWD_TEST_GPUS:-}" ] && export SAGEBWD_TEST_GPUS="$(seq -s ' ' 0 $((ngpu - 1)))"
              [ -n "${SAGEBWD_TEST_GPUS:-}" ] && ngpu=$(wc -w <<< "$SAGEBWD_TEST_GPUS")
              workers=$(( ngpu > 1 ? 4 * ngpu : 8 ))
              # (TESTS_ARGS: pytest's selection instead of the whole suite, e.g. "tests/test_ds_bound.py -k row_max")
              if [ -n "${TESTS_ARGS:-}" ]; then
                run tests bash -c "python3 -m pytest -m gpu -v -rf -p no:cacheprovider -n $workers $TESTS_ARGS"
              else
                run tests bash -c "python3 -m pytest tests -m gpu -v -rf -p no:cacheprovider -n $workers \
                   --ignore=tests/test_large.py && python3 -m pytest tests/test_large.py -v -rf -p no:cacheprovider"
              fi ;;
    accuracy) run accuracy python3 benchmarks/accuracy.py --check --csv "$OUT/accuracy.csv" ${ACCURACY_ARGS:-} ;;
    speed)    run speed python3 benchmarks/speed.py --quick --csv "$OUT/speed.csv" ${SPEED_ARGS:-} ;;
    sweep)    run sweep python3 benchmarks/speed.py --csv "$OUT/sweep.csv" ${SWEEP_ARGS:-} ;;
    e2e)      run e2e python3 benchmarks/e2e.py --csv "$OUT/e2e.csv" ${E2E_ARGS:-} ;;
    breakdown) run breakdown bash -c "python3 tools/breakdown.py --head-dim 128 --sass $TMP/sass \
                 && python3 tools/breakdown.py --head-dim 64 --sass $TMP/sass" ;;
    kernels)  run kernels bash -c "python3 tools/forward_kernels.py --varlen first --seqlens 4096 16384 \
                 && python3 tools/backward_kernels.py" ;;
    profile)  run profile python3 tools/profile_op.py ${PROFILE_ARGS:-} ;;
    study)    run study bash -c "t0=\$SECONDS; [ -f /tmp/code_corpus/manifest.json ] \
                 || python3 examples/code_corpus.py --output_dir /tmp/code_corpus \
                 && cp /tmp/code_corpus/manifest.json docs/fidelity/corpus_manifest.json \
                 && python3 examples/scale_study.py --corpus /tmp/code_corpus \
                    --deadline_s \$(( ${STUDY_S:-540} - (SECONDS - t0) )) ${STUDY_ARGS:-}; \
                 tar czf $OUT/study.tgz docs/fidelity/study docs/fidelity/corpus_manifest.json" ;;
    plot)
      src="$OUT/sweep.csv"; [ -f "$src" ] || src="$OUT/speed.csv"
      if ! python3 -c "import matplotlib" 2>/dev/null; then
        echo "plot: no matplotlib here; plot locally: python benchmarks/plot.py sweep.csv --e2e e2e.csv" | tee -a "$LOG"
      elif [ -f "$src" ]; then
        e2e_csv=(); [ -f "$OUT/e2e.csv" ] && e2e_csv=(--e2e "$OUT/e2e.csv")
        run plot python3 benchmarks/plot.py "$src" "${e2e_csv[@]}" -o "$OUT/bench.png"
      else
        echo "plot: no speed CSV in $OUT (run the sweep or speed stage first)" | tee -a "$LOG"
      fi ;;
    *) echo "unknown stage $stage" | tee -a "$LOG"; status=1 ;;
  esac
done

# The short tables again, last, so that the end of the output holds all of them.
echo; echo "################ summaries ################"
for stage in $stages; do
  [ -f "$TMP/$stage.log" ] || continue
  echo "---- $stage (${took[$stage]:-})"
  case $stage in
    tests)    grep -E "(FAILED|ERROR) tests/" "$TMP/$stage.log" | sort -u | head -40; tail -2 "$TMP/$stage.log" ;;
    breakdown) grep -E "^(# |fwd|bwd|SASS)" "$TMP/$stage.log" | cut -c1-400 ;;
    kernels)  grep -E "^(# |d[0-9]|varlen| )" "$TMP/$stage.log" | cut -c1-200 ;;
    profile)  sed -n '/^# precision/,$p' "$TMP/$stage.log" ;;
    accuracy) sed -n '/^# backward kernels/,$p' "$TMP/$stage.log" ;;
    speed|sweep|e2e) sed -n '/^== /,$p' "$TMP/$stage.log" ;;
    plot)     tail -1 "$TMP/$stage.log" ;;
    study)    grep -E "^(train|eval|vocabulary|\[scale_study\] (ran|not now|note)|.*seed[0-9]+: (done|to run))" "$TMP/$stage.log" ;;
  esac
done
rm -rf "$TMP"
exit $status
