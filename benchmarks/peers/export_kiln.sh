#!/usr/bin/env bash
# kiln's exports of the anchor model under /usr/bin/time -v, beside the peers' (export_peers.sh).
# Usage: benchmarks/peers/export_kiln.sh [WORK]   (default /work/peers; kiln's venv active,
#   PYTHONPATH pointing at the kiln to measure if it is not the installed one)
set -euo pipefail
WORK=${1:-/work/peers}
LOG=$WORK/times
mkdir -p "$LOG"

timed() {
  local name=$1; shift
  /usr/bin/time -v "$@" > "$LOG/$name.log" 2> "$LOG/$name.time" || { grep -v "^\s" "$LOG/$name.time" | tail -5; return 1; }
  grep -E "Elapsed|Maximum resident" "$LOG/$name.time" | sed "s/^/$name: /"
}

rm -rf "$WORK/kiln-fp32" "$WORK/kiln-int8"
# --max-batch 1: the peers' graphs are batch-generic too, but kiln's limit only sizes profiles
timed kiln-fp32 python -m kiln.cli export --model "$WORK/anchor" --out "$WORK/kiln-fp32" --max-batch 1 --json
# int8 Q/DQ: calibrated on the anchor's tokenizer over the demo's held-out text (the anchor is
# random-initialised, so no text is "in distribution"); MLP down-projections kept in float as
# the README's accuracy table recommends
timed kiln-int8 python -m kiln.cli export --model "$WORK/anchor" --out "$WORK/kiln-int8" --max-batch 1 --json \
  --int8 --calib-data "$(dirname "$0")/../../demo/checkpoint/heldout.txt" --calib-samples 16 --calib-method percentile \
  --int8-float '*.down_proj' --calib-cache "$WORK/calib-cache" || echo "kiln-int8: export failed (see $LOG/kiln-int8.time)"
