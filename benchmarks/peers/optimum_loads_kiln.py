"""Optimum's ORTModelForCausalLM on a kiln export's onnx/ as written (kiln copies the Hugging Face
checkpoint's config.json and generation_config.json there): it must generate exactly what
transformers' own generate() does, greedy, for batch 1 and a left-padded batch of 2. Exit code 1
when a token differs. Run in the Optimum peers venv (optimum-onnx pins transformers < 4.58, so it
is not one of kiln's test dependencies; README.md of this folder):

    python optimum_loads_kiln.py /work/peers/anchor /work/peers/kiln-fp32/onnx --new 32
"""

import argparse
import sys

import torch
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint", help="the Hugging Face checkpoint directory kiln exported")
parser.add_argument("onnx_dir", help="the export's onnx/ directory")
parser.add_argument("--new", type=int, default=32, help="greedy tokens to generate")
args = parser.parse_args()

hf = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
ort = ORTModelForCausalLM.from_pretrained(args.onnx_dir)  # model.onnx with its external weights, config.json beside it
vocab = hf.config.vocab_size
prompts = [[(7 * i + 3) % vocab for i in range(11)], [(5 * i + 1) % vocab for i in range(6)]]
greedy = {
    "max_new_tokens": args.new,
    "do_sample": False,
    "pad_token_id": 0,
    "eos_token_id": None,
}  # no end token: every step compared


def generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **greedy)[:, ids.shape[1] :].tolist()


cases = [
    (f"batch 1, prompt of {len(p)}", torch.tensor([p]), torch.ones((1, len(p)), dtype=torch.int64)) for p in prompts
]
length = max(map(len, prompts))
ids = torch.zeros((2, length), dtype=torch.int64)
mask = torch.zeros_like(ids)
for row, prompt in enumerate(prompts):  # left-padded, as transformers pads a decoder's batch
    ids[row, length - len(prompt) :] = torch.tensor(prompt)
    mask[row, length - len(prompt) :] = 1
cases.append(("left-padded batch of 2", ids, mask))

failed = False
for name, ids, mask in cases:
    want, got = generate(hf, ids, mask), generate(ort, ids, mask)
    same = want == got
    failed |= not same
    print(
        f"{name}: {'same' if same else 'DIFFERENT'} {args.new} "
        f"tokens{'' if same else f' (transformers {want}, Optimum {got})'}"
    )
sys.exit(1 if failed else 0)
