#!/usr/bin/env bash
# The same benchmark on several versions of the code, in one device call (kernel timings move a few percent
# between machines and calls: compare versions only within one call).
#
#   here:    bash tools/ab_trees.sh prepare main next/mask-int32      # exports each ref to .ab/<ref>
#   device:  (carry [".ab"])  bash tools/ab_trees.sh run -- python3 tools/forward_kernels.py --seqlens 4096
#
# "prepare" writes each git ref's tree (git archive) under .ab/ (git-ignored: name it in the device call's carry);
# "run" runs the command from each exported tree in turn, its output prefixed by the ref, and the working tree
# last as "worktree". Every tree compiles its own kernels (Triton's cache is keyed by source).
set -euo pipefail
cmd=${1:-}; shift || true
case $cmd in
  prepare)
    rm -rf .ab && mkdir -p .ab
    for ref in "$@"; do
      dir=.ab/${ref//\//_}
      mkdir -p "$dir" && git archive "$ref" | tar -x -C "$dir"
      echo "$ref" > "$dir/.ref"
      echo "exported $ref ($(git rev-parse --short "$ref")) to $dir"
    done ;;
  run)
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "usage: $0 run -- COMMAND..." >&2; exit 2; }
    root=$PWD
    for dir in .ab/*/ "$root/"; do
      [ -d "$dir" ] || continue
      name=$( [ -f "$dir/.ref" ] && cat "$dir/.ref" || echo worktree )
      echo "=== $name"
      (cd "$dir" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$@" 2>&1 | sed "s|^|[$name] |") || echo "[$name] exit $?"
    done ;;
  *) echo "usage: $0 prepare REF... | run -- COMMAND..." >&2; exit 2 ;;
esac
