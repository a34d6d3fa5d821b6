"""A Hugging Face checkpoint's export is a directory its usual consumers load as written:
``onnx/`` holds the checkpoint's ``config.json`` and ``generation_config.json`` beside
``model.onnx`` (listed in the manifest, verified like every file), and ONNX Runtime GenAI's
``og.Model("OUT/onnx")`` generates what transformers' own ``generate()`` does (greedy).

Optimum's ``ORTModelForCausalLM.from_pretrained("OUT/onnx")`` is checked by
``benchmarks/peers/optimum_loads_kiln.py`` in the peers' venv instead: optimum-onnx 0.1.0 pins
transformers < 4.58, which would hold kiln's tests to 4.57 (where torch.export refuses the GPT-2
family's past length), so it is not a test dependency."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install 'kiln[hf]')"
)
og = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is a test dependency (pip install onnxruntime-genai)"
)

import torch  # noqa: E402

from kiln.exporter.artifacts import manifest as manifest_mod  # noqa: E402
from kiln.exporter.artifacts.verify import verify_dir  # noqa: E402
from kiln.exporter.options import ExportOptions  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.plugins.hf import tiny_model  # noqa: E402

STEPS = 24
PROMPTS = ([5, 17, 33, 8, 90, 4, 61, 22, 11], [7, 8, 9, 10, 11])


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random Llama saved by transformers (config.json, generation_config.json, safetensors) and its export."""
    root = tmp_path_factory.mktemp("hf-consumers")
    tiny_model("LlamaForCausalLM", seed=1).module.model.save_pretrained(root / "ckpt", safe_serialization=True)
    assert (
        json.loads((root / "ckpt" / "generation_config.json").read_text())["eos_token_id"] == 2
    )  # transformers wrote one
    export(root / "ckpt", root / "out", ExportOptions.from_flags(max_batch=1, parity_tokens=8))
    return root / "ckpt", root / "out"


def _hf_greedy(ckpt: Path, prompts: tuple[list[int], ...]) -> list[list[int]]:
    """transformers' own greedy generate() of each prompt, with no end token (every step compared)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=STEPS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def test_hugging_face_files_are_beside_the_graphs_and_verified(llama: tuple[Path, Path]) -> None:
    ckpt, out = llama
    for name in ("config.json", "generation_config.json"):
        assert (out / "onnx" / name).read_bytes() == (ckpt / name).read_bytes()
        assert f"onnx/{name}" in manifest_mod.read(out).files
    assert verify_dir(out).ok
    (out / "onnx" / "generation_config.json").write_text("{}")  # a changed copy is caught like any file
    try:
        assert verify_dir(out).changed == ("onnx/generation_config.json",)
    finally:
        (out / "onnx" / "generation_config.json").write_bytes((ckpt / "generation_config.json").read_bytes())


def test_onnxruntime_genai_generates_what_transformers_does(llama: tuple[Path, Path]) -> None:
    ckpt, out = llama
    want = _hf_greedy(ckpt, PROMPTS)
    model = og.Model(str(out / "onnx"))
    for prompt, expected in zip(PROMPTS, want, strict=True):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + STEPS, min_length=len(prompt) + STEPS)  # no early end token
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        assert generator.get_sequence(0)[len(prompt) :].tolist() == expected
