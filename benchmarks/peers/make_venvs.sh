#!/usr/bin/env bash
# Recreate the peers' virtual environments (never kiln dependencies), as benchmarks/peers/README.md says.
# Usage: benchmarks/peers/make_venvs.sh [OPTIMUM_VENV] [GENAI_VENV]   (defaults /work/peers-venv /work/peers-genai-venv)
# torch is pinned by a constraints file: any other torch request pulls a multi-GB CUDA build.
set -euo pipefail
VENV=${1:-/work/peers-venv}
GENAI_VENV=${2:-/work/peers-genai-venv}
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" "optimum-onnx[onnxruntime]" psutil

python3 -m venv "$GENAI_VENV"
"$GENAI_VENV/bin/pip" install -q torch==2.13.0
# the builder imports onnx_ir but does not declare it
"$GENAI_VENV/bin/pip" install -q -c "$CONSTRAINTS" onnxruntime-genai==0.18.0 onnxruntime==1.32.0 "transformers>=5" onnx-ir onnx psutil
"$VENV/bin/python" -c "import optimum.version, transformers; print('optimum', optimum.version.__version__, 'transformers', transformers.__version__)"
"$GENAI_VENV/bin/python" -c "import onnxruntime_genai, transformers; print('onnxruntime-genai', onnxruntime_genai.__version__, 'transformers', transformers.__version__)"
