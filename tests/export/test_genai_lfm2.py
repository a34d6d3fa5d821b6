"""ONNX Runtime GenAI and kiln's LFM2 (issue 43): why no genai_config.json is written for it.

onnxruntime-genai 0.18.0 has a model type of its own for LFM2 (``lfm2``: its C++ cache carries
each conv layer's window beside the attention layers' keys and values), so the question is whether
kiln's graph can be bound to it. The names can (``past_conv_names``/``present_conv_names`` are
templates), the shape cannot: GenAI takes the window's shape from the graph and refuses any input
not of rank 3 ``[batch, hidden, conv_L_cache - 1]``, while kiln's contract carries every cache
tensor as ``[batch, heads, length, width]`` (the window ``[batch, 1, conv_L_cache, hidden]``). The
export proves it on GenAI itself: given the config its own builder writes for LFM2, with kiln's
names, GenAI loads kiln's graph and refuses to generate for that rank. So kiln refuses by name,
LFM2-MoE too, and the Mamba-style caches (conv and SSM state) keep their own refusal.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

og = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is a test dependency (pip install onnxruntime-genai)"
)
pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])")

from kiln.errors import ArtifactError  # noqa: E402
from kiln.exporter.artifacts import manifest as manifest_mod  # noqa: E402
from kiln.exporter.artifacts.build import kv_cache_info  # noqa: E402
from kiln.exporter.artifacts.manifest import Manifest  # noqa: E402
from kiln.exporter.contract.io import GraphKind, graph_io  # noqa: E402
from kiln.exporter.options import ExportOptions  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.exporter.serving import write_genai_config  # noqa: E402
from kiln.exporter.serving.genai import GENAI_CONFIG, genai_config, genai_refusal  # noqa: E402
from kiln.plugins.hf import tiny_model  # noqa: E402
from kiln.plugins.hf.build import tiny_transformers  # noqa: E402
from kiln_testing import typed_manifest  # noqa: E402

# plugins/hf/tiny_lfm2.py's lfm2: layers 0 and 2 short convolutions (window 3 x hidden 64), layer 1 attention
LAYER_TYPES = ["conv", "full_attention", "conv"]
WINDOW = "[batch, 1, 3, 64]"
SHORT_CONV = "cache of short convolutions .*rank-3 \\[batch, hidden, conv_L_cache - 1\\].*kiln generate"


@pytest.fixture(scope="module")
def lfm2_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("genai-lfm2")
    tiny_transformers("lfm2", seed=1).save_pretrained(root / "ckpt", safe_serialization=True)
    result = export(root / "ckpt", root / "out", ExportOptions.from_flags(parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    return root / "out"


def _builder_config(manifest: Manifest) -> dict[str, object]:
    """What GenAI's own model builder writes for LFM2 (its LFM2Model.update_genai_config), with kiln's names."""
    model = manifest.model
    decoder = {
        "filename": "model.onnx",
        "head_size": model.head_dim,
        "hidden_size": manifest.config["hidden_size"],
        "num_attention_heads": manifest.config["num_attention_heads"],
        "num_key_value_heads": model.n_kv_heads,
        "num_hidden_layers": model.n_layers,
        "layer_types": manifest.config["layer_types"],
        "conv_cache_size": manifest.config["conv_L_cache"] - 1,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "position_ids": "position_ids",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
            "past_conv_names": "past_key_values.%d.conv",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
            "present_conv_names": "present.%d.conv",
        },
    }
    tokens = {"bos_token_id": model.bos_token_id, "eos_token_id": model.eos_token_id, "pad_token_id": 0}
    search = {"do_sample": False, "max_length": 32, "past_present_share_buffer": False}
    sizes = {"context_length": 32, "vocab_size": model.vocab_size}
    return {"model": {"type": "lfm2", **tokens, **sizes, "decoder": decoder}, "search": search}


def test_no_config_is_written_and_the_refusal_names_the_rank(lfm2_out: Path) -> None:
    manifest = manifest_mod.read(lfm2_out)
    assert manifest.kv_cache.kind == "hybrid", manifest.kv_cache
    assert not (lfm2_out / "onnx" / GENAI_CONFIG).exists(), "kiln export wrote a genai_config.json GenAI cannot run"
    why = genai_refusal(manifest)
    assert why is not None and f"kiln's graphs carry it as {WINDOW}" in why and "lfm2 model type" in why, why
    with pytest.raises(ArtifactError, match=SHORT_CONV):
        write_genai_config(lfm2_out / "onnx", manifest)
    assert not (lfm2_out / "onnx" / GENAI_CONFIG).exists(), "a refused config was written anyway"


def test_genai_binds_kiln_names_but_refuses_the_rank(lfm2_out: Path, tmp_path: Path) -> None:
    """The cause the refusal states, on GenAI itself: every name its lfm2 config binds is one of
    kiln's graph inputs or outputs, and the generator still refuses the rank-4 window."""
    manifest = manifest_mod.read(lfm2_out)
    config = _builder_config(manifest)
    assert config["model"]["decoder"]["layer_types"] == LAYER_TYPES  # type: ignore[index]
    graph = manifest.graph(GraphKind.UNIFIED)
    names = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
    bound = [f"{d}.{i}.{n}" for i in (0, 2) for d, n in (("past_key_values", "conv"), ("present", "conv"))]
    bound += [f"{d}.1.{n}" for d in ("past_key_values", "present") for n in ("key", "value")]
    assert set(bound) <= names, sorted(set(bound) - names)
    for name in ("model.onnx", "weights.bin"):
        shutil.copy(lfm2_out / "onnx" / name, tmp_path / name)
    (tmp_path / GENAI_CONFIG).write_text(json.dumps(config))
    model = og.Model(str(tmp_path))  # the config parses and the graph loads
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16, batch_size=1)
    with pytest.raises(RuntimeError, match="expected conv state input to be rank 3 .*got rank 4"):
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([[5, 17, 33]], dtype=np.int32))
        generator.generate_next_token()


def _manifest_of(case: str) -> Manifest:
    """The manifest an export of a tiny case would write, as far as genai_refusal reads it (no export)."""
    spec = tiny_model(case, seed=0).spec
    io = graph_io(spec, GraphKind.UNIFIED)
    keys = "n_layers n_kv_heads head_dim vocab_size bos_token_id eos_token_id pad_token_id encoder_dim".split()
    model = {k: getattr(spec, k) for k in keys}
    graph = {"file": "onnx/model.onnx", "inputs": [t.to_dict() for t in io.inputs], "outputs": []}
    manifest = typed_manifest(
        {"family": spec.family, "config": spec.config, "model": model, "graphs": {"model": graph}}
    )
    return dataclasses.replace(manifest, kv_cache=kv_cache_info(spec, "float32"))


def test_lfm2_moe_is_refused_for_the_same_rank() -> None:
    manifest = _manifest_of("lfm2-moe")
    with pytest.raises(ArtifactError, match=f"hybrid {SHORT_CONV}"):
        genai_config(manifest)
    assert WINDOW in (genai_refusal(manifest) or ""), genai_refusal(manifest)


@pytest.mark.parametrize("case", ["mamba2", "granitemoehybrid"])
def test_a_conv_and_ssm_state_keeps_its_own_refusal(case: str) -> None:
    """A Mamba2 state (alone, or in a hybrid) is not LFM2's window: GenAI has no SSM state for it at all."""
    manifest = _manifest_of(case)
    why = genai_refusal(manifest)
    assert why is not None and "conv and ssm of fixed sizes" in why and "keys and values only" in why, why
    assert "short convolutions" not in why, why
    with pytest.raises(ArtifactError, match=f"for a {manifest.kv_cache.kind} cache .*kiln generate"):
        genai_config(manifest)
