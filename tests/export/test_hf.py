"""The Hugging Face family: loading, refusals, int8 rules (every architecture's generation parity
is ``test_hf_archs.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

from kiln.errors import CheckpointError, ExportError
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln.plugins import families, load_model
from kiln.plugins.hf import SUPPORTED, tiny_model


def test_every_registered_family_has_a_tiny_model(tmp_path: Path) -> None:
    from kiln.exporter.pipeline import export_loaded

    for family in families():
        loaded = family.tiny(0)
        result = export_loaded(loaded, tmp_path / family.name, ExportOptions.from_flags(parity_tokens=4))
        assert result.parity.passed, family.name


def test_unsupported_architecture_says_why_in_one_line(tmp_path: Path) -> None:
    """The mechanism kiln lacks and the nearest architecture it exports, not the list (``kiln plugins``
    has it; every architecture transformers ships: test_hf_unsupported.py)."""
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"], "model_type": "bert"}')
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert str(err.value) == (
        f"checkpoint: {tmp_path}: unsupported Hugging Face architecture 'BertForMaskedLM': kiln does not export "
        "a model without a text-generation head"
        " (kiln exports *ForCausalLM and *ForConditionalGeneration classes) yet (`kiln plugins` lists them all)"
    )
    (tmp_path / "config.json").write_text(
        '{"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", '
        '"text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 256}}'
    )
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert str(err.value) == (
        f"checkpoint: {tmp_path}: unsupported Hugging Face architecture 'Gemma4ForConditionalGeneration': kiln does "
        "not export per-layer embeddings outside the Gemma 3n and Gemma 4 text decoders"
        " (hidden_size_per_layer_input) yet (the nearest kiln exports is Gemma4ForCausalLM; `kiln plugins` lists "
        "them all)"
    )
    assert sorted(SUPPORTED)[0] not in str(err.value)


def test_int8_keeps_the_head_and_attention_scores_float(tmp_path: Path) -> None:
    """The default int8 rules are module suffixes that hold for Hugging Face names too
    (``model.lm_head``, ``model.layers.N.self_attn``, GPT-2's ``transformer.h.N.attn``), not
    only for the native family's: checked on the real traced graphs."""
    import onnx_ir as ir

    from kiln.exporter.pipeline import export_loaded
    from kiln.exporter.precision.int8 import Int8Policy, int8_targets

    for arch, quantized_names, kept_names in (
        (
            "LlamaForCausalLM",
            ["layers.0.self_attn.q_proj/MatMul", "layers.1.mlp.down_proj/MatMul"],
            ["layers.0.self_attn/MatMul", "layers.0.self_attn/MatMul_1"],
        ),
        ("GPT2LMHeadModel", ["h.0.attn.c_attn/Gemm", "h.1.mlp.c_proj/Gemm"], ["h.0.attn/MatMul", "h.0.attn/MatMul_1"]),
    ):
        export_loaded(tiny_model(arch, seed=1), tmp_path / arch, ExportOptions.from_flags(parity_tokens=4))
        graph = ir.load(tmp_path / arch / "onnx" / "decode.onnx").graph
        targets = int8_targets(graph, Int8Policy())
        matmuls = [n.name for n in graph if n.op_type in ("MatMul", "Gemm")]
        for suffix in quantized_names:
            assert sum(t.endswith(suffix) for t in targets) == 1, (arch, suffix, targets)
        for suffix in [*kept_names, "lm_head/MatMul"]:
            assert sum(m.endswith(suffix) for m in matmuls) == 1, (arch, suffix, matmuls)
            assert not any(t.endswith(suffix) for t in targets), (arch, suffix)


def _edited(case: str, directory: Path, **changes: object) -> Path:
    """A tiny checkpoint of ``case`` whose config.json is then edited (``None`` removes a key)."""
    import json

    tiny_model(case, seed=1).module.model.save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


ROPE = {"rope_theta": 10000.0}


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        (
            "llama",
            {"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}},
            (
                "LlamaForCausalLM: rope_type 'dynamic' is not supported: dynamic NTK recomputes its frequencies "
                "from the sequence length at run time and keeps them"
                " on the module between calls (a data-dependent, stateful branch a traced graph cannot reproduce)"
            ),
        ),
        (
            "llama",
            {"rope_parameters": {**ROPE, "rope_type": "proportional", "partial_rotary_factor": 1.0}},
            "LlamaForCausalLM: rope_type 'proportional' is not supported: kiln proves default, linear, yarn, "
            "llama3, longrope",
        ),
        (
            "llama",
            {"rope_parameters": {**ROPE, "rope_type": "default", "partial_rotary_factor": 0.5}},
            (
                "LlamaForCausalLM: partial_rotary_factor=0.5 is not supported: this architecture's rotary "
                "ignores it (transformers rotates the whole head),"
                " so the checkpoint would not run as trained"
            ),
        ),
        (
            "llama",
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "LlamaForCausalLM: quantization_config (gptq) is not supported: kiln exports float checkpoints (its "
            "--int8/--fp16 quantize them)",
        ),
        (
            "gemma",
            {"use_bidirectional_attention": True},
            "GemmaForCausalLM: use_bidirectional_attention=True is not supported: non-causal attention is not a "
            "decoder",
        ),
        (
            "gpt2",
            {"add_cross_attention": True},
            "GPT2LMHeadModel: add_cross_attention=True is not supported: GPT-2 with cross-attention needs "
            "encoder states kiln's Hugging Face decoders do not take",
        ),
        (
            "apertus1p5",
            {"output_vocab_size": 100},
            (
                "Apertus1p5TextForCausalLM: output_vocab_size=100 is not supported: a pruned head (logits over "
                "fewer ids than vocab_size)"
                " that kiln's graphs and tokenizer do not size"
            ),
        ),
        (
            "gpt-bigcode",
            {"add_cross_attention": True},
            "GPTBigCodeForCausalLM: add_cross_attention=True is not supported: GPTBigCode with cross-attention "
            "needs encoder states kiln's Hugging Face decoders do not take",
        ),
        (
            "phimoe-window",  # Phi-3.5-MoE's rope
            {
                "rope_parameters": {
                    **ROPE,
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "short_mscale": 1.0,
                    "long_mscale": 1.2,
                }
            },
            (
                "PhimoeForCausalLM: rope_type='longrope' is not supported: PhiMoE's rotary picks its scale "
                "(short_mscale or long_mscale) by a Python branch"
                " on the longest position, which torch.export cannot trace"
            ),
        ),
        (
            "falcon-7b",
            {"alibi": True},
            "FalconForCausalLM: alibi=True is not supported: Falcon's ALiBi computes its biases in bfloat16, "
            "which ONNX Runtime's CPU cannot run for parity",
        ),
    ],
)
def test_what_changes_the_math_and_is_not_proved_is_refused_by_name(
    case: str, changes: dict[str, object], message: str, tmp_path: Path
) -> None:
    ckpt = _edited(case, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert str(err.value) == f"checkpoint: {message}"


def test_bloom_without_a_context_length_needs_max_context(tmp_path: Path) -> None:
    """Bloom's ALiBi has no context limit of its own and its config names none: the export says
    so in one line (no AttributeError), and runs with --max-context."""
    from kiln.errors import ExportError

    ckpt = _edited("bloom", tmp_path / "ckpt", seq_length=None)
    assert load_model(ckpt).spec.max_context is None
    with pytest.raises(ExportError) as err:
        export(ckpt, tmp_path / "out", ExportOptions.from_flags(parity_tokens=4))
    assert (
        str(err.value)
        == "export: BloomForCausalLM has no context length of its own (its config has no seq_length): pass "
        "--max-context N"
    )
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_context=32, max_batch=2, parity_tokens=4))
    assert result.parity.passed and result.manifest.limits.max_context == 32


def test_phi3_longrope_is_exported_up_to_its_original_context(tmp_path: Path) -> None:
    from kiln.errors import ExportError

    ckpt = _edited("phi3-longrope", tmp_path / "ckpt")
    assert load_model(ckpt).spec.max_context == 16
    with pytest.raises(ExportError) as err:
        export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_context=64, parity_tokens=4))
    assert str(err.value) == (
        "export: --max-context 64 exceeds the model's max_context 16 (Phi-3's generate() recomputes the whole "
        "sequence with longrope's long factors"
        " once it passes original_max_position_embeddings (16), which a KV cache cannot do, so kiln exports it "
        "up to there)"
    )


@pytest.mark.parametrize(("case", "traced"), [("llama", 2), ("gemma2-window", 3), ("smollm3", 3), ("gpt2-upcast", 4)])
def test_deeper_models_are_stamped_from_their_distinct_layers(case: str, traced: int, tmp_path: Path) -> None:
    """4 layers: a template of the first layers holding every distinct layer after the first
    (Gemma 2's alternating sliding/global layers, SmolLM3's NoPE layers), stamped to depth; GPT-2
    with a scale per layer index has no two equal layers and is traced whole. Parity proves the
    stamped graphs."""
    from kiln.exporter.passes.stamp import StampPlan
    from kiln.exporter.pipeline import export_loaded
    from kiln.exporter.progress import NullProgress

    notes: list[str] = []

    class Notes(NullProgress):
        def note(self, message: str) -> None:
            notes.append(message)

    loaded = tiny_model(case, seed=1, num_hidden_layers=4)
    assert loaded.layers is not None and StampPlan.of(loaded.layers).traced == traced
    result = export_loaded(loaded, tmp_path / "out", ExportOptions.from_flags(max_batch=2, parity_tokens=8), Notes())
    assert result.parity.passed and not notes, notes


def _garbled(directory: Path) -> Path:
    """``directory`` with weights no reader can read: a refusal that comes first read none."""
    for weights in directory.glob("*.safetensors"):
        weights.write_bytes(b"\x00" * 64)
    return directory


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        (
            "llama",
            {"num_attention_heads": 3},
            "{config}: transformers refuses this config (The hidden size (64) is not a multiple of the number of "
            "attention heads (3).)",
        ),
        (
            "gpt2",
            {"n_head": 3},
            "GPT2LMHeadModel: num_attention_heads (3) does not divide hidden_size (64), and config.json gives no "
            "head_dim",
        ),
        (
            "qwen3",
            {"num_attention_heads": 3},
            "Qwen3ForCausalLM: num_attention_heads (3) is not a multiple of the key/value heads (2)",
        ),
        (
            "llama",
            {"hidden_size": "64"},
            "{config}: transformers refuses this config (Field 'hidden_size' expected int, got str (value: '64'))",
        ),
        (
            "llama",
            {"num_hidden_layers": -2},
            "LlamaForCausalLM: num_hidden_layers must be a positive integer, found -2 in config.json",
        ),
        (
            "gpt2",
            {"n_layer": 0},
            "GPT2LMHeadModel: num_hidden_layers must be a positive integer, found 0 in config.json",
        ),
        (
            "llama",
            {"hidden_size": 10**400},
            "LlamaForCausalLM: hidden_size must be at most 2**31 - 1 (TensorRT's and ONNX Runtime GenAI's "
            "dimensions are 32-bit), found an integer of about 401 digits in config.json",
        ),
    ],
)
def test_impossible_sizes_are_refused_at_load_before_any_weight_is_read(
    case: str, changes: dict[str, object], message: str, tmp_path: Path
) -> None:
    """Heads that do not divide, a size that is no positive 32-bit integer: one line from the
    config alone (the weights are garbled: reading them would fail with another message)."""
    ckpt = _garbled(_edited(case, tmp_path / "ckpt", **changes))
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert str(err.value) == "checkpoint: " + message.format(config=ckpt / "config.json")


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            {"hidden_size": 10**7},
            "model.embed_tokens.weight has shape [128, 64] in model.safetensors, the config needs [128, 10000000]; ",
        ),
        (
            {"vocab_size": 10**9},
            "model.embed_tokens.weight has shape [128, 64] in model.safetensors, the config needs [1000000000, 64];"
            " lm_head.weight has shape [128, 64] in model.safetensors, the config needs [1000000000, 64]",
        ),
        (
            {"num_hidden_layers": 10**6},
            "config.json says num_hidden_layers=1000000, but the weights hold 21 tensors in all",
        ),
    ],
    ids=["hidden_size", "vocab_size", "num_hidden_layers"],
)
def test_sizes_the_weights_do_not_have_are_refused_from_their_headers(
    changes: dict[str, object], problem: str, tmp_path: Path
) -> None:
    """The safetensors header against the model built from the config on the meta device, before
    transformers builds it: one line at once, not an allocation of the config's sizes."""
    import time

    ckpt = _edited("llama", tmp_path / "ckpt")
    load_model(ckpt)  # imports done
    _edited("llama", ckpt, **changes)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert time.perf_counter() - start < 0.5
    assert str(err.value).startswith(f"checkpoint: {ckpt}: weights do not match the config: {problem}")


def test_a_weights_file_of_no_tensors_is_checked_too(tmp_path: Path) -> None:
    """Found by the fuzz (test_fuzz.py): an empty safetensors file once skipped the header check,
    and transformers then built a million layers."""
    import struct

    ckpt = _edited("llama", tmp_path / "ckpt", num_hidden_layers=10**6)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert (
        str(err.value)
        == f"checkpoint: {ckpt}: weights do not match the config: config.json says num_hidden_layers=1000000, but "
        "the weights hold 0 tensors in all"
    )


def test_sharded_checkpoints_are_checked_shard_by_shard(tmp_path: Path) -> None:
    import json

    ckpt = tmp_path / "ckpt"
    tiny_model("llama", seed=1).module.model.save_pretrained(ckpt, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").is_file()
    assert load_model(ckpt).spec.n_layers == 2
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    head = index["weight_map"]["lm_head.weight"]
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "vocab_size": 10**9}))
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"lm_head.weight has shape [128, 64] in {head}, the config needs [1000000000, 64]"),
    ):
        load_model(ckpt)
    (ckpt / "config.json").write_text(json.dumps(config))
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert (
        str(err.value)
        == f"checkpoint: {ckpt / 'model.safetensors.index.json'}: names the shard '../elsewhere.safetensors', which "
        f"is not a file of {ckpt}"
    )


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ("drop", "missing keys model.norm.weight (transformers would initialise them at random)"),
        ("add", "unexpected keys model.extra.weight (transformers would drop them)"),
    ],
)
def test_what_transformers_would_invent_or_drop_is_one_line(
    edit: str, problem: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """transformers' load report (10-20 lines, then an export of random weights) becomes one line."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = _edited("llama", tmp_path / "ckpt")
    state = load_file(ckpt / "model.safetensors")
    if edit == "drop":
        del state["model.norm.weight"]
    else:
        state["model.extra.weight"] = torch.zeros(3)
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert str(err.value) == f"checkpoint: {ckpt}: weights do not match the config: {problem}"
    out, errors = capfd.readouterr()
    assert out == "" and errors == ""  # no load report, no progress bar


def test_max_context_past_the_config_is_refused_before_the_weights_load(tmp_path: Path) -> None:
    ckpt = _garbled(_edited("llama", tmp_path / "ckpt"))
    with pytest.raises(ExportError) as err:
        export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_context=8192))
    assert str(err.value) == "export: --max-context 8192 exceeds the model's max_context 64"
    assert not (tmp_path / "out").exists()


def test_loading_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """No "Loading weights" bar, and no transformers note on the config (longrope's rope_parameters draw one)."""
    ckpt = _edited("llama-rope-longrope", tmp_path / "ckpt")
    capfd.readouterr()
    assert load_model(ckpt).spec.n_layers == 2
    assert capfd.readouterr() == ("", "")


def test_an_export_prints_only_kilns_rows(tmp_path: Path) -> None:
    """A real checkpoint written by save_pretrained, exported by the CLI: stderr holds kiln's
    progress rows only (no transformers load report, "Loading weights" bar, config notes or
    past_key_values deprecation warning)."""
    import subprocess
    import sys

    ckpt = _edited("llama", tmp_path / "ckpt")
    code = "import sys; from kiln.cli import main; main(sys.argv[1:])"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "export",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / "out"),
            "--parity-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stderr.splitlines() if line.strip()]
    row = re.compile(
        r"[\w. -]+(: [\w .'()-]+)?: (\d+/\d+ in \d+\.\d s|\d+/\d+, \d+ s, eta \d+:\d\d:\d\d) \(run \d+:\d\d:\d\d\)"
    )
    assert rows and all(row.fullmatch(line) for line in rows), (
        done.stderr
    )  # stderr is not a terminal: LineProgress's plain rows
    assert rows[0].startswith("load checkpoint")
    assert done.stdout.startswith(f"wrote {tmp_path / 'out'}:")


@pytest.mark.parametrize(
    ("text", "reason"),
    [("not json", "expected ident at line 1 column 2"), ('{"hello": 1}', "expected `,` or `}` at line 1 column 9")],
)
def test_a_tokenizer_that_is_none_is_refused_at_load(text: str, reason: str, tmp_path: Path) -> None:
    ckpt = _garbled(_edited("llama", tmp_path / "ckpt"))
    (ckpt / "tokenizer.json").write_text(text)
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert str(err.value) == (
        f"checkpoint: {ckpt / 'tokenizer.json'}: not a tokenizer the tokenizers library loads ({reason}); "
        "replace it with the model's own"
        " tokenizer.json, or remove it to export without one"
    )
