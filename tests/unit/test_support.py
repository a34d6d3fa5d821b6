"""What ``kiln plugins`` says each model structure exports, per precision and target
(``exporter.support``), is what the export refuses and takes, and it fits the terminal (issue 39:
the table listed "fp32, fp16" for every architecture and was 309 columns wide)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.options import ExportOptions
from kiln.exporter.support import Cell, alternatives, precisions, support, target_names
from kiln.listing import MIN_WIDTH, entry, fit
from kiln.plugins import families
from kiln.plugins.base import DecoderSpec
from kiln_testing import config_error, tiny_config, write_checkpoint

# fp32, fp16, int8, fp8, int4: --target ort takes fp32 and int4 (and --ort-int8)
TAKES_ALL = ["pox", "p-x", "pOx", "p-x", "pox"]
UNPROVED_WINDOW = ["poX", "p-X", "pOX", "p-X", "poX"]  # --target onnx refuses a window no test proves
# fp32, fp16 and int4 by RTN on the portable graphs; fp32 and int4 by RTN on --target ort's
ENCODER_DECODER = ["po-", "p--", "---", "---", "PO-"]
MARKS = {
    **dict.fromkeys(["Qwen3", "Phi-3", "SmolLM3", "Qwen3-MoE", "gpt-oss"], UNPROVED_WINDOW),
    **dict.fromkeys(
        ["Qwen2-MoE", "PhiMoE", "OLMo 3", "Cohere2", "Exaone 4", "Ministral", "Ministral 3"], UNPROVED_WINDOW
    ),
    **dict.fromkeys(
        [
            "AFMoE",
            "Cohere Compass",
            "Cohere2-MoE",
            "CWM",
            "dots.llm1",
            "Ergo",
            "EXAONE-MoE",
            "Flint",
            "Granite-SWA",
            "GraniteMoe-SWA",
            "Kolibri 1",
        ],
        UNPROVED_WINDOW,
    ),
    **dict.fromkeys(["Laguna", "Mellum", "ModernBERT", "VaultGemma"], UNPROVED_WINDOW),
    **dict.fromkeys(
        ["Llama 4 (text)", "Llama 4 VLM"], UNPROVED_WINDOW
    ),  # --target onnx refuses chunked attention (the same marks)
    **dict.fromkeys(
        ["DeepSeek-V2", "DeepSeek-V3"], ["po-", "p--", "pO-", "p--", "po-"]
    ),  # --target onnx refuses a latent cache
    # onnx: Mamba2's and Bamba's state at fp32 and fp16 (tests/export/test_onnx_target_state.py), the others' none
    # int8: --ort-int8 alone, --int8 refuses an SSM state (tests/export/test_state_calibrated.py)
    **dict.fromkeys(["Mamba2", "Bamba"], ["pox", "p-x", "-O-", "p--", "po-"]),
    **dict.fromkeys(["GraniteMoeHybrid", "Nemotron-H", "Falcon-H1"], ["po-", "p--", "-O-", "p--", "po-"]),
    **dict.fromkeys(["Mamba", "FalconMamba", "Jamba"], ["po-", "p--", "-O-", "p--", "po-"]),  # onnx: no v1 state
    "LFM2": ["pox", "p-x", "pO-", "p--", "po-"],  # onnx: its conv window at fp32 and fp16
    "LFM2-MoE": ["po-", "p--", "pO-", "p--", "po-"],  # onnx: not proved
    **dict.fromkeys(
        ["Qwen3.5 (text)", "Qwen3-Next", "Qwen3.5-MoE (text)"], ["po-", "p--", "-O-", "p--", "po-"]
    ),  # onnx: no DeltaNet state (issue 43)
    "Gemma 4 (text)": ["po-", "p--", "pO-", "p--", "po-"],
    "Gemma 3n (text)": UNPROVED_WINDOW,  # and a checkpoint with shared layers (the table's has none) on --target onnx
    # the table asks by the wrapper's name: Gemma 3's and Mistral 3's are proved windowed (test_hf_multimodal)
    **dict.fromkeys(["BART", "mBART", "Marian", "T5", "Whisper"], ENCODER_DECODER),
    "PLE decoder": TAKES_ALL,
    "cross-attention": ENCODER_DECODER,  # no --int8/--fp8, int4 by RTN only, no --target onnx
}


def _plugins(*args: str, columns: int = 80) -> str:
    result = CliRunner().invoke(main, ["plugins", *args], env={"COLUMNS": str(columns)}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _rows() -> list[tuple[str, DecoderSpec]]:
    """Every row's first cell and spec, of every family that has specs."""
    with_specs = [f for f in families() if hasattr(f, "specs")]
    return [(row[0], spec) for f in with_specs for row, spec in zip(f.table()[1:], f.specs(), strict=True)]


def _refused_by_the_export(spec: DecoderSpec, fields: dict[str, Any]) -> str | None:
    """The export's own answer (``ExportOptions``, then the plan stage with the model's spec), without its stage
    prefix."""
    from kiln.exporter.plan import plan

    try:
        plan(ExportOptions.from_flags(**fields), spec)
    except ConfigError as exc:
        return str(exc).removeprefix("config: ")
    return None


def test_the_columns_are_the_precisions_and_targets_kiln_has() -> None:
    assert precisions() == ("fp32", "fp16", "int8", "fp8", "int4")
    assert target_names() == ("portable", "ort", "onnx")


def test_every_row_says_what_it_takes() -> None:
    """Every decoder architecture takes every precision; what a row refuses is named here."""
    marks = {name: support(spec).marks() for name, spec in _rows()}
    # 81 before issue 43; since: Llama 4 (+ wrapper), DeepSeek-V2/V3, Whisper, Mamba2, Gemma 3n, GraniteMoeHybrid,
    # Bamba, LFM2(-MoE), Mamba, FalconMamba, Jamba, Nemotron-H, Falcon-H1, Qwen3.5, Qwen3-Next, Qwen3.5-MoE, Gemma 4
    assert len(marks) == 107
    assert marks == {name: MARKS.get(name, TAKES_ALL) for name in marks}


@pytest.mark.parametrize(("name", "spec"), _rows(), ids=[name for name, _ in _rows()])
def test_the_export_refuses_what_the_table_refuses_and_takes_the_rest(name: str, spec: DecoderSpec) -> None:
    """Each cell against the export's own checks, asked with the same flags: a refused cell's
    message is the export's; a taken cell is taken (by its alternative's flags where it says so)."""
    for precision, row in support(spec).cells.items():
        for target, cell in row.items():
            fields = _fields(precision, target, cell)
            refused = _refused_by_the_export(spec, fields)
            if cell.taken:
                assert refused is None, (name, precision, target, refused)
            else:
                assert refused is not None and (cell.refusal or "").startswith(refused), (name, precision, target)


def _fields(precision: str, target: str, cell: Cell) -> dict[str, Any]:
    """The flags the cell is taken with: the precision's defaults, or its alternative's; calibration
    data where they read some (int8, fp8, int4 by GPTQ)."""
    from kiln.exporter.options import Precision

    calib = "synthetic" if precision in ("int8", "fp8", "int4") else None
    fields: dict[str, Any] = {"precision": Precision.parse(precision), "target": target, "calib_data": calib}
    for alternative in alternatives():
        if alternative.precision == precision and (cell.condition or "").startswith(alternative.condition):
            fields.update({**alternative.fields, "calib_data": None})  # --ort-int8 and --int4-method rtn read none
    return fields


def test_a_cross_attention_decoder_is_refused_by_kiln_export_as_the_table_says(tmp_path: Path) -> None:
    """Through the CLI, on a checkpoint: each refused cell of the cross-attention row is refused
    with its message before anything is exported (--fp8 among them: it failed in calibration)."""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(cross_attention=True))
    ((_, spec),) = [(n, s) for n, s in _rows() if n == "cross-attention"]
    refused = [(p, t, c) for p, row in support(spec).cells.items() for t, c in row.items() if not c.taken]
    assert len(refused) == 10  # --target onnx at each precision, --target ort at fp16, int8 and fp8, portable int8, fp8
    for precision, target, cell in refused:
        line = _kiln_export(ckpt, tmp_path / "out", precision, target)
        assert (cell.refusal or "").startswith(line), (precision, target, line)


def test_the_structures_are_those_the_configs_give() -> None:
    """The hf family's specs (no config read) against the specs of its tiny models' configs: the
    same cross-attention and encoder, a sliding_window field where the config class has one, and
    the same cells wherever no window (nor chunk) decides."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face configs need transformers")
    from kiln.plugins.hf import HF
    from kiln.plugins.hf.multimodal import read_any_spec
    from kiln.plugins.hf.seq2seq import SEQ2SEQ, SEQ2SEQ_TINY, read_seq2seq_spec
    from kiln.plugins.hf.tiny import TINY

    listed = {spec.config["architecture"]: spec for spec in HF.specs()}
    for arch, make in [*TINY.values(), *SEQ2SEQ_TINY.values()]:
        config = make(transformers)
        real = (
            read_seq2seq_spec(config, arch, "hf") if arch in SEQ2SEQ else read_any_spec(config, arch, "hf")
        )  # a wrapper's: its text decoder's
        spec = listed[arch]
        assert (real.encoder_dim is None, real.has_encoder) == (spec.encoder_dim is None, spec.has_encoder), arch
        assert ("sliding_window" in real.config) == ("sliding_window" in spec.config), arch
        assert ("attention_chunk_size" in real.config) == ("attention_chunk_size" in spec.config), arch
        mine, theirs = support(spec).cells, support(real).cells
        # a family whose tiny cases differ in cache kind (Gemma 4 with and without shared layers): a
        # refused cell is refused by its own kind's reason
        same_kind = real.cache_layout.kind == spec.cache_layout.kind
        for precision, row in mine.items():
            for target, cell in row.items():
                if cell.condition is not None and any(
                    f in cell.condition for f in ("sliding window", "chunked attention")
                ):
                    continue
                got = theirs[precision][target]
                assert (got if same_kind else got.taken) == (cell if same_kind else cell.taken), (
                    arch,
                    precision,
                    target,
                )


def test_no_line_is_wider_than_the_terminal() -> None:
    for columns in (80, 60, 132):
        out = _plugins(columns=columns)
        assert max(map(len, out.splitlines())) <= columns, columns
    assert max(map(len, _plugins(columns=20).splitlines())) <= MIN_WIDTH  # no layout below 40 columns


def test_at_80_columns_the_marks_stay_on_the_row_and_the_rest_goes_under_it() -> None:
    lines = _plugins(columns=80).splitlines()
    llama = lines.index("  Llama               pox   p-x   pOx   p-x  pox")  # as wide as Qwen3.5-MoE (text)
    assert (
        lines[llama - 1] == "  architecture        fp32  fp16  int8  fp8  int4"
    )  # Mistral3ForConditionalGeneration's class does not fit beside
    assert lines[llama + 1 : llama + 5] == [
        "      class: LlamaForCausalLM",
        "      --target ort: GQA",
        "      notes: rope linear, yarn, llama3, longrope; tied and untied; bias;",
        "        head_dim != hidden/heads",
    ]
    qwen3, bart = (
        lines.index("  Qwen3               poX   p-X   pOX   p-X  poX"),
        lines.index("  BART                po-   p--   ---   ---  PO-"),
    )
    assert (lines[qwen3 + 1], lines[bart + 1]) == (
        "      class: Qwen3ForCausalLM",
        "      class: BartForConditionalGeneration",
    )
    assert "  cross-attention  po-   p--   ---   ---  PO-" in lines
    assert "  P in int4, O in int4: only with --int4-method rtn (GPTQ is refused)" in lines
    window = "  X: not with a sliding window: only the windows a test proves are applied"
    assert lines.count(window) == 1  # hf's: native configs have no window


def test_int8_int4_and_fp8_are_shown_for_a_decoder_and_refusals_as_refused() -> None:
    """Read back from the printed table: a Llama writes every precision's portable graphs, int4
    for --target ort (and int8 there as --ort-int8); an encoder-decoder int4 by RTN only."""
    lines = _plugins(columns=200).splitlines()
    header = next(line.split() for line in lines if line.startswith("  architecture"))
    rows = [line.split() for line in lines if line.startswith(("  Llama  ", "  BART  "))]  # not "Llama 4 (text)"
    cells = {row[0]: dict(zip(header, row, strict=False)) for row in rows}
    assert {p: cells["Llama"][p] for p in ("int8", "fp8", "int4")} == {"int8": "pOx", "fp8": "p-x", "int4": "pox"}
    assert [cells["BART"][p] for p in ("fp32", "fp16", "int8", "fp8", "int4")] == ENCODER_DECODER


def test_a_wide_terminal_gets_one_line_a_row() -> None:
    lines = _plugins(columns=400).splitlines()
    gpt_oss = next(line for line in lines if line.startswith("  gpt-oss "))
    assert gpt_oss.split("GptOssForCausalLM")[1].split()[:3] == ["GQA", "(attention", "sinks"]
    assert gpt_oss.endswith("alternating sliding layers, yarn")
    assert not any(line.startswith("      notes:") for line in lines)


def test_json_keeps_everything() -> None:
    found = {f["name"]: f for f in json.loads(_plugins("--json"))}
    hf = found["hf"]
    assert hf["table"][0] == ["architecture", "fp32", "fp16", "int8", "fp8", "int4", "class", "--target ort", "notes"]
    assert (
        len(hf["table"]) == len(hf["support"]) + 1 == 106
    )  # 86 before issue 43's families (each a row of kiln plugins; test_every_row_says_what_it_takes names them)
    bart = hf["support"][hf["table"].index(next(r for r in hf["table"] if r[0] == "BART")) - 1]
    assert bart["int8"]["portable"]["taken"] is False
    why = "int8 exports are not supported for encoder-decoders yet: calibration runs decoder-only"
    assert bart["int8"]["portable"]["refusal"].startswith(why)
    assert hf["support"][0]["int4"]["ort"] == {"taken": True, "condition": None, "refusal": None}
    assert hf["support"][0]["int8"]["ort"]["condition"] == alternatives()[0].condition
    assert alternatives()[0].condition == "only as --ort-int8 (weight-only int8 MatMulNBits; --int8 is refused)"
    assert hf["legend"][0] == "p portable graphs, o --target ort, x --target onnx, - refused; a capital: only as below"


def test_fit_wraps_the_columns_that_do_not_fit() -> None:
    table = [["name", "kind", "notes"], ["a", "xy", "one two three four"], ["bb", "z", ""]]
    assert fit(table, 40) == ["  name  kind  notes", "  a     xy    one two three four", "  bb    z"]
    notes = ["      notes:", "        one", "        two", "        three", "        four"]
    assert fit(table, 14) == ["  name  kind", "  a     xy", *notes, "  bb    z"]


def test_a_family_without_specs_keeps_its_table() -> None:
    class Plain:
        name, description = "plain", "a family with a table only"

        def table(self) -> list[list[str]]:
            return [["model", "notes"], ["m", "n"]]

    found = entry(Plain())
    assert (found["table"], found["support"], found["legend"]) == ([["model", "notes"], ["m", "n"]], [], [])


def test_an_encoder_decoder_and_a_window_are_refused_by_kiln_export_as_the_table_says(tmp_path: Path) -> None:
    """Through the CLI, on tiny Hugging Face checkpoints: every refused cell of BART, and Phi-3's
    conditional --target onnx once its config sets a sliding window."""
    pytest.importorskip("transformers", reason="the Hugging Face checkpoints need transformers")
    from kiln.plugins.hf import tiny_model

    bart = tmp_path / "bart"
    tiny_model("bart", seed=1).module.model.save_pretrained(bart, safe_serialization=True)
    ((_, spec),) = [(n, s) for n, s in _rows() if n == "BART"]
    refused = [(p, t, c) for p, row in support(spec).cells.items() for t, c in row.items() if not c.taken]
    assert len(refused) == 10  # all but fp32, fp16 and int4's portable graphs and fp32 and int4's --target ort
    int4 = support(spec).cells["int4"]["portable"]  # taken with --int4-method rtn; GPTQ (the default) is refused
    assert int4.taken and int4.condition == "only with --int4-method rtn (GPTQ is refused)"
    for precision, target, cell in [*refused, ("int4", "portable", int4)]:
        line = _kiln_export(bart, tmp_path / "out", precision, target)
        assert (cell.refusal or "").startswith(line), (precision, target, line)
    phi3 = tmp_path / "phi3"
    tiny_model("phi3-partial", seed=1, sliding_window=4).module.model.save_pretrained(phi3, safe_serialization=True)
    ((_, spec),) = [(n, s) for n, s in _rows() if n == "Phi-3"]
    cell = support(spec).cells["fp32"]["onnx"]
    assert cell.taken and cell.condition == "not with a sliding window: only the windows a test proves are applied"
    assert cell.refusal == _kiln_export(phi3, tmp_path / "out", "fp32", "onnx")  # the probe's window is 4 tokens too


def _kiln_export(ckpt: Path, out: Path, precision: str, target: str) -> str:
    """The one-line refusal of ``kiln export`` at this precision (its defaults) and target; nothing written."""
    flags = {"fp32": [], "fp16": ["--fp16"]}.get(precision, [f"--{precision}", "--calib-data", "synthetic"])
    line = config_error("export", "--model", str(ckpt), "--out", str(out), *flags, "--target", target)
    assert not out.exists()
    return line
