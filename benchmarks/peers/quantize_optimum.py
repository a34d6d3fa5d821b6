"""Optimum's dynamic int8 of an Optimum ONNX export (ORTQuantizer), as the issue's anchor row.

Run in the peers' venv: python quantize_optimum.py OPTIMUM_FP32_DIR OUT_DIR
Weights int8 per tensor, activations quantized at run time (dynamic), MatMul -> MatMulInteger;
AVX-512 VNNI config (this machine has it). Writes OUT_DIR/model_quantized.onnx + config files.
"""

import sys

from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig

src, out = sys.argv[1], sys.argv[2]
quantizer = ORTQuantizer.from_pretrained(src, file_name="model.onnx")
config = AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=False)
quantizer.quantize(save_dir=out, quantization_config=config)
