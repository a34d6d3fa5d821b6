#!/usr/bin/env bash
# Issue 8's memory target: export wall time and peak RSS of kiln, Optimum and the GenAI builder
# (fp32) on a 351M-parameter Llama (1.40 GB safetensors), each under /usr/bin/time -v.
# Usage: benchmarks/peers/memory_350m.sh [OPTIMUM_VENV] [GENAI_VENV] [WORK]
#   run with kiln's venv active (and PYTHONPATH at the kiln to measure)
set -euo pipefail
VENV=${1:-/work/peers-venv}
GENAI_VENV=${2:-/work/peers-genai-venv}
WORK=${3:-/work/peers}
HERE=$(cd "$(dirname "$0")" && pwd)
LOG=$WORK/times
MODEL=$WORK/llama350m
mkdir -p "$LOG"
[ -f "$MODEL/model.safetensors" ] || python "$HERE/../anchor_llama.py" "$MODEL" --preset 350m

timed() {
  local name=$1; shift
  /usr/bin/time -v "$@" > "$LOG/$name.log" 2> "$LOG/$name.time" || { grep -v "^\s" "$LOG/$name.time" | tail -3; }
  grep -E "Elapsed|Maximum resident|Exit status" "$LOG/$name.time" | sed "s/^/$name: /"
}

rm -rf "$WORK/350m-kiln" "$WORK/350m-optimum" "$WORK/350m-genai"
timed 350m-kiln python -m kiln.cli export --model "$MODEL" --out "$WORK/350m-kiln" --max-batch 1 --json
timed 350m-optimum "$VENV/bin/optimum-cli" export onnx --model "$MODEL" --task text-generation-with-past "$WORK/350m-optimum"
timed 350m-genai "$GENAI_VENV/bin/python" -m onnxruntime_genai.models.builder -i "$MODEL" -o "$WORK/350m-genai" -p fp32 -e cpu -c "$WORK/cache-genai"
