"""Hugging Face families: tiny random models saved locally, exported, checked against the
model's own forward pass (parity) and its own ``generate`` with its cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install 'kiln[hf]')")

import torch  # noqa: E402

from kiln.errors import CheckpointError  # noqa: E402
from kiln.exporter.check import check_dir  # noqa: E402
from kiln.exporter.contract.io import GraphKind  # noqa: E402
from kiln.exporter.options import ExportOptions  # noqa: E402
from kiln.exporter.parity import greedy, left_pad, make_prompts  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.exporter.runners import OrtRunner  # noqa: E402
from kiln.plugins import families, load_model  # noqa: E402
from kiln.plugins.hf import SUPPORTED, TINY_CONFIGS, tiny_model  # noqa: E402

STEPS = 40


def _save(arch: str, directory: Path) -> Path:
    loaded = tiny_model(arch, seed=1)
    loaded.module.model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_export_parity_and_generate(arch: str, tmp_path: Path) -> None:
    ckpt = _save(arch, tmp_path / "ckpt")
    result = export(ckpt, tmp_path / "out", ExportOptions(max_batch=4, parity_tokens=STEPS))
    assert result.parity.passed, result.parity.failures()
    assert result.manifest.family == "hf" and result.manifest.config["architecture"] == arch
    assert check_dir(tmp_path / "out").passed

    # the exported graphs generate what Hugging Face's own generate() does with its cache
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    spec = load_model(ckpt).spec
    onnx_dir = tmp_path / "out" / "onnx"
    graphs = {k: onnx_dir / f"{k.value}.onnx" for k in (GraphKind.PREFILL, GraphKind.DECODE)}
    for lengths in ([9], [9, 5]):  # batch 1, and a left-padded batch
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        ids, mask, _ = left_pad(prompts, 0)
        with torch.no_grad():
            want = hf.generate(
                input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=STEPS,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )[:, ids.shape[1] :].numpy()
        with OrtRunner(graphs) as runner:
            got, _ = greedy(runner, spec, prompts, STEPS)
        np.testing.assert_array_equal(got, want)


def test_every_registered_family_has_a_tiny_model(tmp_path: Path) -> None:
    from kiln.exporter.pipeline import export_loaded

    for family in families():
        loaded = family.tiny(0)
        result = export_loaded(loaded, tmp_path / family.name, ExportOptions(parity_tokens=4))
        assert result.parity.passed, family.name
    assert set(TINY_CONFIGS) == set(SUPPORTED)


def test_unsupported_architecture_lists_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"], "model_type": "bert"}')
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert str(err.value) == (
        f"checkpoint: {tmp_path}: unsupported Hugging Face architecture 'BertForMaskedLM'; "
        "supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    )


def test_int8_keeps_the_head_and_attention_scores_float(tmp_path: Path) -> None:
    """The default int8 rules are module suffixes that hold for Hugging Face names too
    (``model.lm_head``, ``model.layers.N.self_attn``, GPT-2's ``transformer.h.N.attn``), not
    only for the native family's: checked on the real traced graphs."""
    import onnx_ir as ir

    from kiln.exporter.pipeline import export_loaded
    from kiln.exporter.precision.int8 import Int8Policy, int8_targets

    for arch, quantized_names, kept_names in (
        ("LlamaForCausalLM", ["layers.0.self_attn.q_proj/MatMul", "layers.1.mlp.down_proj/MatMul"], ["layers.0.self_attn/MatMul", "layers.0.self_attn/MatMul_1"]),
        ("GPT2LMHeadModel", ["h.0.attn.c_attn/Gemm", "h.1.mlp.c_proj/Gemm"], ["h.0.attn/MatMul", "h.0.attn/MatMul_1"]),
    ):
        export_loaded(tiny_model(arch, seed=1), tmp_path / arch, ExportOptions(parity_tokens=4))
        graph = ir.load(tmp_path / arch / "onnx" / "decode.onnx").graph
        targets = int8_targets(graph, Int8Policy())
        matmuls = [n.name for n in graph if n.op_type in ("MatMul", "Gemm")]
        for suffix in quantized_names:
            assert sum(t.endswith(suffix) for t in targets) == 1, (arch, suffix, targets)
        for suffix in [*kept_names, "lm_head/MatMul"]:
            assert sum(m.endswith(suffix) for m in matmuls) == 1, (arch, suffix, matmuls)
            assert not any(t.endswith(suffix) for t in targets), (arch, suffix)
