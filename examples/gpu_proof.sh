#!/usr/bin/env bash
# GPU proof of the examples: pre-train the 60m preset (~60M parameters, Llama shape, head dim 64) at sequence
# length 1024 in bf16 with SDPA and then with SageBwd, from the same initial weights on the same batches,
# and draw the comparison (examples/compare_runs.py: loss curves, their difference, final losses, tokens/s).
# The headline is the held-out eval loss: the data is the code corpus (examples/code_corpus.py: the Python
# sources installed on the machine, ~100M tokens with 2% of the files held out), so no run repeats data and
# the eval loss still falls at the end (CORPUS=book: the embedded book instead, ~75K tokens, which a 60M model
# memorises within a few hundred steps: its eval loss rises while the train loss falls).
#
#   bash examples/gpu_proof.sh            # one GPU (default)
#   bash examples/gpu_proof.sh ddp        # 2 GPUs, DDP   (accelerate launch --multi_gpu)
#   bash examples/gpu_proof.sh fsdp       # 2 GPUs, FSDP2 (accelerate launch --use_fsdp --fsdp_version 2)
#   bash examples/gpu_proof.sh all        # single, then ddp and fsdp if 2 GPUs are visible
#   bash examples/gpu_proof.sh --help     # this text
#
# The runs go to $WORK (default /tmp/gpu_proof_work: the shared initial weights alone are ~225 MB); $OUT
# (default runs/gpu_proof) gets a few small files: log.txt (everything printed, versions and the summary
# tables included), MODE_comparison.png for each mode, and metrics.tar.gz (every run's metrics.csv and
# run_summary.json, each mode's summary.md/json) to redraw or re-summarise anywhere with
# `python examples/compare_runs.py --metrics`. Knobs: STEPS (300), SEEDS ("0 1": one sdpa and one sagebwd run
# per seed; the verdict needs two or more), BATCH (global sequences per step, 8),
# SEQ (1024); PRETRAIN_ARGS: more pretrain.py options, appended (they win). Wheels in .whl/ (e.g. datasets and its
# dependencies, for a machine without a package index) are installed into /tmp/site first.
# Every mode trains on the same global batch (BATCH x SEQ = 8,192 tokens per step): 2 GPUs take BATCH/2 each.
# Needs torch, transformers and accelerate (and datasets with CORPUS=book); matplotlib is optional (without it the PNG is skipped
# and can be drawn later from the CSVs: python examples/compare_runs.py --metrics A/metrics.csv B/metrics.csv).
#
# Expected time on one H100/H200 (60m, 8K tokens per step): tens of steps per second for SDPA, a few times
# slower for SageBwd's first steps (Triton compilation and autotuning), so about 2-4 minutes per seed for "single"
# including start-up, and about as much again for each 2-GPU mode.
set -euo pipefail
usage() {   # a usage line, then the comment block above without its "# "
  echo "usage: $0 [single|ddp|fsdp|all]   (settings in the environment: OUT, WORK, STEPS, SEEDS, BATCH, SEQ, CORPUS, PRETRAIN_ARGS, PYTHON)"
  echo
  sed -n '2,/^set -euo pipefail/{/^#/{s/^# \{0,1\}//;p;}}' "$0"
}
case "${1:-}" in -h|--help) usage; exit 0;; esac
cd "$(dirname "$0")/.."

MODE="${1:-single}"
OUT="${OUT:-runs/gpu_proof}"
WORK="${WORK:-/tmp/gpu_proof_work}"
STEPS="${STEPS:-300}"
SEEDS="${SEEDS:-0 1}"
BATCH="${BATCH:-8}"
SEQ="${SEQ:-1024}"
PY="${PYTHON:-python3}"
CORPUS="${CORPUS:-code}"
case "$CORPUS" in code|book) ;; *) echo "CORPUS must be code or book (got '$CORPUS')" >&2; exit 2;; esac
case "$MODE" in single|ddp|fsdp|all) ;; *) echo "usage: $0 [single|ddp|fsdp|all|--help] (got '$MODE')" >&2; exit 2;; esac
mkdir -p "$OUT" "$WORK"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
: > "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && echo "installed wheels from .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')" | tee -a "$LOG"
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"

CORPUS="$CORPUS" "$PY" - <<'EOF' || { echo "gpu_proof.sh: install the missing package first (pip install datasets)" >&2; exit 1; }
import importlib, os
for name in ("torch", "transformers", "accelerate", "sagebwd_hf") + (("datasets",) if os.environ["CORPUS"] == "book" else ()):
    importlib.import_module(name)
EOF

NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  "$PY" -c 'import torch, transformers, accelerate, triton; print("torch", torch.__version__, "| transformers", transformers.__version__, "| accelerate", accelerate.__version__, "| triton", triton.__version__)'
} 2>&1 | tee -a "$LOG"

# pretrain.py options shared by every mode; --per_device_batch_size is added per mode.
COMMON=(--size 60m --seq_len "$SEQ" --max_steps "$STEPS" --mixed_precision bf16 --no_save_model
        --eval_steps 100 --max_eval_batches 8 --log_every 50)
DATA=()
if [[ "$CORPUS" == code ]]; then
  [ -f "$WORK/corpus/manifest.json" ] || "$PY" examples/code_corpus.py --output_dir "$WORK/corpus" 2>&1 | tee -a "$LOG"
  DATA=(--train_file "$WORK/corpus/train.npy" --validation_file "$WORK/corpus/eval.npy"
        --tokenizer_name "$WORK/corpus/tokenizer")
fi
read -r -a EXTRA <<< "${PRETRAIN_ARGS:-}"
# No ACCELERATE config file is read: everything the launcher needs is on its command line.
ACC=("$PY" -m accelerate.commands.launch --num_machines 1 --mixed_precision bf16 --dynamo_backend no)

run_mode() {
  local mode="$1" launcher per_device
  case "$mode" in
    single) launcher="$PY"; per_device="$BATCH" ;;
    ddp)    launcher="${ACC[*]} --multi_gpu --num_processes 2"; per_device=$((BATCH / 2)) ;;
    fsdp)   launcher="${ACC[*]} --num_processes 2 --use_fsdp --fsdp_version 2
                      --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer
                      --fsdp_state_dict_type FULL_STATE_DICT --fsdp_reshard_after_forward true"
            per_device=$((BATCH / 2)) ;;
  esac
  if [[ "$mode" != single && "$NGPU" -lt 2 ]]; then
    echo "gpu_proof.sh: $mode needs 2 GPUs, $NGPU visible: skipped" | tee -a "$LOG"
    return 0
  fi
  rm -rf "${WORK:?}/$mode"
  echo "=== $mode: $STEPS steps, $BATCH x $SEQ tokens per step ($per_device sequences per GPU)" | tee -a "$LOG"
  local start=$SECONDS
  # shellcheck disable=SC2086
  if ! "$PY" examples/compare_runs.py --output_dir "$WORK/$mode" --launcher "$(echo $launcher)" --seeds $SEEDS \
      --title "60m Llama, seq $SEQ, bf16, $mode, $CORPUS corpus: sdpa vs sagebwd (same init, same batches)" \
      -- "${COMMON[@]}" "${DATA[@]}" --per_device_batch_size "$per_device" "${EXTRA[@]}" 2>&1 | tee -a "$LOG"; then
    echo "=== $mode FAILED" | tee -a "$LOG"
    status=1
  fi
  echo "=== $mode took $((SECONDS - start)) s" | tee -a "$LOG"
  [ -f "$WORK/$mode/comparison.png" ] && cp "$WORK/$mode/comparison.png" "$OUT/${mode}_comparison.png"
  # A few small files in $OUT: the CSVs and summaries of every mode in one archive.
  (cd "$WORK" && tar czf "$OUT/metrics.tar.gz" */summary.* */*/*/metrics.csv */*/*/run_summary.json 2>/dev/null || true)
}

status=0
if [[ "$MODE" == all ]]; then
  run_mode single; run_mode ddp; run_mode fsdp
else
  run_mode "$MODE"
fi
ls -la "$OUT" | tee -a "$LOG"
exit $status
