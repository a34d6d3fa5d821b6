"""The plan stage (``exporter.plan``, issue 42): every refusal asked in one loop through one
signature, every reason of a round reported in one ``ConfigError``; the options alone first, the
model's structure once they are taken; ``ExportOptions`` refuses only values wrong on their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln.errors import ConfigError, ExportError
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.plan import SEPARATOR, of_model, plan, reasons
from kiln.exporter.precision.kinds import Fp16, Int8
from kiln.exporter.targets import target
from kiln.plugins.base import DecoderSpec, PLETables

ROOT = Path(__file__).resolve().parents[2]
CROSS = DecoderSpec(family="toy", n_layers=2, n_kv_heads=2, head_dim=8, vocab_size=32, max_context=64, encoder_dim=16)
PLAIN = DecoderSpec(family="toy", n_layers=2, n_kv_heads=2, head_dim=8, vocab_size=32, max_context=64)


def test_every_reason_of_the_options_is_one_error_in_the_loops_order() -> None:
    options = ExportOptions.from_flags(
        precision=Precision.of(Fp16(auto_keep_fp32=True)),
        ple_tables=PLETables.INPUT,
        target="onnx",
        lora_slots=4,
        parity_agreement="record",
    )
    with pytest.raises(ConfigError) as err:
        plan(options)
    assert str(err.value).removeprefix("config: ").split(SEPARATOR) == [
        "--auto-keep-fp32 cannot be combined with --ple-tables input",  # the kind
        "--target onnx takes the PLE tables as constants; drop --ple-tables input",  # the target
        "--lora-slots with --target onnx: slots are built on the portable graphs and --target ort only",  # LoRA
        "--parity-agreement record only applies to --int8, --fp8 or --int4 exports, whose graphs are also "
        "checked against PyTorch on their own quantized numbers; "
        "a fp16 export's only proof is its agreement with the checkpoint's model",  # parity
    ]


def test_the_model_is_asked_only_once_the_options_are_taken() -> None:
    refused = ExportOptions(target="ort", precision=Precision.FP16, triton="m")
    with pytest.raises(ConfigError) as err:
        plan(refused, CROSS)
    assert "cross-attention" not in str(err.value) and str(err.value).startswith(
        "config: --target ort rewrites fp32 graphs"
    )
    with pytest.raises(ConfigError) as err:
        plan(ExportOptions(target="ort", triton="m"), CROSS)
    assert str(err.value).removeprefix("config: ").split(SEPARATOR) == [
        "triton: cross-attention decoders are not supported yet (the ensemble would need encoder_hidden_states"
        " and a cross cache that is written once); serve prefill.onnx and decode.onnx from your own host",
    ]


def test_a_taken_export_is_planned_with_the_targets_it_writes() -> None:
    options = ExportOptions(target="onnx", precision=Precision.FP16)
    planned = plan(options, PLAIN)
    assert planned.options is options and planned.spec is PLAIN and planned.targets == (target("onnx"),)
    assert plan(ExportOptions()).targets == () and reasons(options, PLAIN) == []


def test_options_refuse_only_what_is_wrong_on_its_own() -> None:
    taken = ExportOptions(
        target="onnx", precision=Precision.of(Int8(all_matmuls=True))
    )  # a kind and a target judge it: the plan
    assert (
        reasons(taken)[0]
        == "--int8 needs --calib-data: a text file, .jsonl (field 'text'), .npy/.npz token ids, or 'synthetic'"
    )
    with pytest.raises(
        ConfigError,
        match=r"^config: --max-batch must be at least 1, found 0 \| --opset must be between 18 and 23, found 99$",
    ):
        ExportOptions.from_flags(max_batch=0, opset=99)
    with pytest.raises(ConfigError, match=r"^config: --target 'tpu' is not a target; choose portable, ort, onnx$"):
        plan(ExportOptions(target="tpu"))


def test_options_import_no_target_and_no_kind_but_the_precision_type() -> None:
    tree = ast.parse((ROOT / "exporter" / "options.py").read_text())
    imported = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("kiln.")
    }
    assert not {m for m in imported if m.startswith("kiln.exporter.targets")}
    assert {m for m in imported if m.startswith("kiln.exporter.precision")} == {"kiln.exporter.precision.kinds.plan"}


def test_a_model_s_round_reports_its_sizes_with_every_other_reason() -> None:
    """The exported context and the static cache are refusals of the model's round (``of_model``):
    reported with the structure's in one ``ConfigError``, alone in the export stage's error as before."""
    options = ExportOptions.from_flags(target="ort", triton="m", max_context=128)
    with pytest.raises(ConfigError) as err:
        of_model(plan(options), CROSS)
    assert str(err.value).removeprefix("config: ").split(SEPARATOR) == [
        "triton: cross-attention decoders are not supported yet (the ensemble would need encoder_hidden_states"
        " and a cross cache that is written once); serve prefill.onnx and decode.onnx from your own host",
        "--max-context 128 exceeds the model's max_context 64",
    ]
    with pytest.raises(ExportError, match=r"^export: --max-context 128 exceeds the model's max_context 64$"):
        plan(ExportOptions.from_flags(max_context=128), PLAIN, sized=True)
    big = DecoderSpec(family="toy", n_layers=32, n_kv_heads=8, head_dim=128, vocab_size=32, max_context=2**24)
    found = reasons(ExportOptions(target="onnx"), big, sized=True)
    assert len(found) == 1 and found[0].startswith("--max-context 16777216: the static KV cache of --target onnx"), (
        found
    )
    assert reasons(ExportOptions(), big, sized=True) == []  # the portable graphs' cache grows: nothing to size
    assert (
        plan(ExportOptions.from_flags(max_context=128), PLAIN).max_context is None
    )  # unsized: what the structure supports
    planned = of_model(plan(ExportOptions.from_flags(target="onnx", max_context=32)), PLAIN)
    assert (planned.spec, planned.max_context, planned.targets) == (PLAIN, 32, (target("onnx"),))
    assert of_model(plan(ExportOptions()), PLAIN).max_context == 64  # the model's own limit


def test_a_kind_s_flags_without_the_kind_are_reported_with_the_options_reasons(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kiln.cli import main

    flags = ["--fp16", "--int4-block", "64", "--target", "onnx", "--lora-slots", "4", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(main, ["export", "--model", "demo", *flags])
    assert result.exit_code == 1 and not (tmp_path / "o").exists(), result.output
    assert result.output.strip().removeprefix("error: config: ").split(SEPARATOR) == [
        "--int4-method and --int4-block only apply to --int4 exports",  # Precision.chosen's, given to the plan
        "--lora-slots with --target onnx: slots are built on the portable graphs and --target ort only",
    ], result.output
    stray = ["--fp8-float only applies to --fp8 exports"]
    with pytest.raises(ConfigError, match=r"^config: --fp8-float only applies to --fp8 exports \| --lora-slots with"):
        plan(ExportOptions.from_flags(target="onnx", lora_slots=4), given=stray)
    assert plan(ExportOptions(), given=[]).options == ExportOptions()


def test_two_kinds_of_one_role_are_reported_with_the_other_reasons(tmp_path: Path) -> None:
    """``--int8 --fp8``: the clash is one reason among the options' (it was raised alone, hiding the rest)."""
    from click.testing import CliRunner

    from kiln.cli import main

    flags = ["--int8", "--fp8", "--triton", "bad name", "--quality-gate", "7", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(main, ["export", "--model", "demo", *flags])
    assert result.exit_code == 1 and not (tmp_path / "o").exists(), result.output
    assert result.output.strip().removeprefix("error: config: ").split(SEPARATOR) == [
        "--int8 and --fp8 are different precisions of the same MatMuls; choose one",
        "triton: model name 'bad name' must start with a letter or digit and hold only letters, digits, '_', '.' "
        "and '-'",
        "--quality-gate must be auto, off or a top-1 agreement in (0, 1], found '7'",
    ], result.output
    with pytest.raises(ConfigError, match=r"^config: --int8 and --fp8 are different precisions"):
        Precision.of(Precision.INT8.kinds[0], Precision.FP8.kinds[0])  # the API's own composition still refuses
