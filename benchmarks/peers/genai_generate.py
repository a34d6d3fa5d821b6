"""Tokens/s of ONNX Runtime GenAI's own generation loop on a builder output, for comparison with
``kiln generate`` (same prompt ids, greedy, batch 1). Run in the GenAI peers venv:

    python genai_generate.py /work/peers/genai-fp32 --prompt-len 128 --new 256
"""

import argparse
import time

import numpy as np
import onnxruntime_genai as og

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--prompt-len", type=int, default=128)
parser.add_argument("--new", type=int, default=256)
args = parser.parse_args()

model = og.Model(args.model)
ids = np.arange(10, 10 + args.prompt_len, dtype=np.int32)  # the ids kiln generate is given in docs/benchmarks.md
params = og.GeneratorParams(model)
params.set_search_options(max_length=args.prompt_len + args.new, do_sample=False)
gen = og.Generator(model, params)
start = time.perf_counter()
gen.append_tokens(ids)
prefill = time.perf_counter() - start
start = time.perf_counter()
steps = 0
while not gen.is_done() and steps < args.new - 1:
    gen.generate_next_token()
    steps += 1
decode = time.perf_counter() - start
print(
    f"prefill: {args.prompt_len} tokens at {args.prompt_len / prefill:.1f} tokens/s; decode: {steps} tokens at "
    f"{steps / decode:.1f} tokens/s"
)
