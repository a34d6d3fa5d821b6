"""What the command line and a config let through is what the manifest's schema accepts (issue 38,
item 7: exports written with --max-batch 100000, --max-context 16777217, a config's
max_position_embeddings of 1 or 2**31 - 1 or an eos_token_id of -5 were refused afterwards as
"damaged or edited"; --lora-slots 9223372036854775808 was accepted)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.exporter.contract.limits import MAX_BATCH, MAX_CONTEXT, MAX_LORA_RANK, MIN_CONTEXT
from kiln_testing import tiny_config, write_checkpoint


def _schema() -> dict:
    return json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())


def test_the_schema_holds_the_same_bounds() -> None:
    props = _schema()["properties"]
    batch, context = props["limits"]["properties"]["max_batch"], props["limits"]["properties"]["max_context"]
    assert (batch["minimum"], batch["maximum"]) == (1, MAX_BATCH)
    assert (context["minimum"], context["maximum"]) == (MIN_CONTEXT, MAX_CONTEXT)
    rank = props["lora"]["properties"]["max_rank"]
    assert (rank["minimum"], rank["maximum"]) == (1, MAX_LORA_RANK)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-batch", "100000", "Invalid value for '--max-batch': 100000 is not in the range 1<=x<=65536."),
        (
            "--max-context",
            "16777217",
            "Invalid value for '--max-context': 16777217 is not in the range 2<=x<=16777216.",
        ),
        (
            "--lora-slots",
            "9223372036854775808",
            "Invalid value for '--lora-slots': 9223372036854775808 is not in the range 1<=x<=65536.",
        ),
    ],
)
def test_the_command_line_refuses_what_the_schema_would(option: str, value: str, message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["export", "--model", "demo", "--out", str(tmp_path / "out"), option, value])
    assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "out").exists()


def _error(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (1, "error: export: the model's max_context 1 is outside what an export can declare (2 to 16777216)"),
        (
            2147483647,
            "error: export: the model's max_context 2147483647 is outside what an export can declare (2 to "
            "16777216); pass --max-context N",
        ),
    ],
)
def test_a_config_s_context_outside_the_bounds_is_refused_before_the_export(
    limit: int, message: str, tmp_path: Path
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    config = json.loads((ckpt / "config.json").read_text())
    config["max_context"] = limit
    if "ple" in config:
        config["ple"]["max_positions"] = max(limit, 2)
    (ckpt / "config.json").write_text(json.dumps(config))
    assert _error("export", "--model", str(ckpt), "--out", str(tmp_path / "out")) == message
    assert not (tmp_path / "out").exists()


def test_a_negative_token_id_is_refused_before_the_export(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])")
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("LlamaForCausalLM", seed=0).module.model.save_pretrained(ckpt, safe_serialization=True)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"eos_token_id": -5}))
    assert (
        _error("export", "--model", str(ckpt), "--out", str(tmp_path / "out"))
        == "error: checkpoint: eos_token_id must be a token id (0 or more), found -5"
    )
    assert not (tmp_path / "out").exists()
