#!/usr/bin/env bash
# Peer exports of the anchor model, each under /usr/bin/time -v (wall time, peak RSS).
# Usage: benchmarks/peers/export_peers.sh [OPTIMUM_VENV] [GENAI_VENV] [WORK]
#   defaults /work/peers-venv /work/peers-genai-venv /work/peers; two venvs because optimum-onnx
#   0.1.0 needs transformers < 4.58 and the GenAI 0.18 builder imports transformers 5 classes.
# The anchor must exist: python benchmarks/anchor_llama.py WORK/anchor
set -euo pipefail
VENV=${1:-/work/peers-venv}
GENAI_VENV=${2:-/work/peers-genai-venv}
WORK=${3:-/work/peers}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=$VENV/bin/python
ANCHOR=$WORK/anchor
LOG=$WORK/times
mkdir -p "$LOG"

timed() {  # timed NAME COMMAND...: run, keep time -v's report in $LOG/NAME.time
  local name=$1; shift
  /usr/bin/time -v "$@" > "$LOG/$name.log" 2> "$LOG/$name.time" || { tail -20 "$LOG/$name.time"; exit 1; }
  grep -E "Elapsed|Maximum resident" "$LOG/$name.time" | sed "s/^/$name: /"
}

rm -rf "$WORK/optimum-fp32" "$WORK/optimum-int8" "$WORK/genai-fp32" "$WORK/genai-int8"
timed optimum-fp32 "$VENV/bin/optimum-cli" export onnx --model "$ANCHOR" --task text-generation-with-past "$WORK/optimum-fp32"
timed optimum-int8 "$PY" "$HERE/quantize_optimum.py" "$WORK/optimum-fp32" "$WORK/optimum-int8"
timed genai-fp32 "$GENAI_VENV/bin/python" -m onnxruntime_genai.models.builder -i "$ANCHOR" -o "$WORK/genai-fp32" -p fp32 -e cpu -c "$WORK/cache-genai"
timed genai-int8 "$GENAI_VENV/bin/python" -m onnxruntime_genai.models.builder -i "$ANCHOR" -o "$WORK/genai-int8" -p int8 -e cpu -c "$WORK/cache-genai"
