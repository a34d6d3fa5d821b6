"""Bad input through the CLI: one line on stderr naming the file and the problem, exit code 1,
no traceback, and no output directory left behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln_testing import edit_config


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def _assert_one_line_error(code: int, stderr: str, *fragments: str) -> None:
    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_unknown_architecture(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architectures": ["BertModel"]}')
    code, _, err = _run("export", "--model", str(ckpt), "--out", str(tmp_path / "out"), "--json")
    _assert_one_line_error(
        code,
        err,
        str(ckpt),
        "unsupported Hugging Face architecture 'BertModel': kiln does not export a model without a "
        "text-generation head",
        "`kiln plugins` lists them all",
    )
    assert not (tmp_path / "out").exists()


def test_unknown_architecture_without_hf_keys(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architecture": "resnet"}')
    code, _, err = _run("export", "--model", str(ckpt), "--out", str(tmp_path / "out"), "--json")
    _assert_one_line_error(code, err, str(ckpt), "unknown architecture 'resnet'; supported families: hf, native")


def test_plugins_lists_the_families(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _run("plugins")
    assert code == 0
    assert "native" in out and "kiln-ple-decoder" in out
    assert "hf" in out and "LlamaForCausalLM" in out and "GPT2LMHeadModel" in out
    # the Hugging Face family's table: an architecture per row, what --target ort fuses under it (80 columns)
    lines = out.splitlines()
    rows = {
        m.group(1): i
        for i, line in enumerate(lines)
        if (m := re.fullmatch(r"      class: (\w+(ForCausalLM|LMHeadModel))", line))
    }  # not a class a note names
    assert (
        len(rows) == 97 and lines[rows["Qwen3ForCausalLM"] + 1] == "      --target ort: GQA"
    )  # 79 before issue 43's families (Llama 4, DeepSeek-V2/V3, the state, hybrid and shared-KV ones, Gemma 4)
    assert lines[rows["DeepseekV3ForCausalLM"] + 1].startswith(
        "      --target ort: portable attention (multi-head latent attention"
    )
    assert lines[rows["GptOssForCausalLM"] + 1].startswith("      --target ort: GQA (attention sinks as head_sink)")


def test_invalid_config_value(tiny_ckpt: Path, tmp_path: Path) -> None:
    edit_config(tiny_ckpt, norm_position="middle")
    code, _, err = _run("export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--json")
    _assert_one_line_error(code, err, "config.json", "norm_position must be one of pre, post, found 'middle'")
    assert not (tmp_path / "out").exists()


def test_missing_checkpoint(tmp_path: Path) -> None:
    code, _, err = _run("export", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out"), "--json")
    _assert_one_line_error(code, err, "nope: no such checkpoint file or directory")


def test_corrupted_weights(tiny_ckpt: Path, tmp_path: Path) -> None:
    (tiny_ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    code, _, err = _run("export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--json")
    _assert_one_line_error(code, err, "model.safetensors: not a readable safetensors file")
    assert not (tmp_path / "out").exists()


def test_corrupted_config(tiny_ckpt: Path, tmp_path: Path) -> None:
    (tiny_ckpt / "config.json").write_text("{not json")
    code, _, err = _run("export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--json")
    _assert_one_line_error(code, err, "config.json: not valid JSON")


def test_non_empty_output_directory(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = _run("export", "--model", str(tiny_ckpt), "--out", str(out), "--json")
    _assert_one_line_error(code, err, str(out), "not empty; pass --force")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # no temporary litter


def test_force_refuses_an_unrelated_directory(tiny_ckpt: Path, tmp_path: Path) -> None:
    """--force replaces only an earlier kiln export: a folder with notes.txt and sub/ is refused
    in one line naming what is there, before the checkpoint loads, and nothing is deleted."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "data.txt").write_text("also mine")
    code, _, err = _run("export", "--model", str(tiny_ckpt), "--out", str(out), "--force")
    _assert_one_line_error(
        code,
        err,
        f"error: artifacts: {out}: --force replaces only an empty directory or an earlier kiln export, and this "
        "holds notes.txt, sub/",
        "nothing was deleted",
    )
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "data.txt").read_text() == "also mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # no temporary litter


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-batch", "0", "0 is not in the range 1<=x<=65536"),
        ("--logits", "first", "'first' is not one of 'all', 'last'"),
    ],
)
def test_option_validation(tmp_path: Path, option: str, value: str, message: str) -> None:
    code, _, err = _run("export", "--model", "demo", "--out", str(tmp_path / "o"), option, value)
    assert code == 2 and message in err


def test_export_needs_model_named(tmp_path: Path) -> None:
    """No silent export of the bundled demo: --model is required (``--model demo`` names it)."""
    code, out, err = _run("export", "--out", str(tmp_path / "o"))
    assert code == 2 and "Error: Missing option '--model'." in err and not out
    assert not (tmp_path / "o").exists()


def test_opset_out_of_range(tiny_ckpt: Path, tmp_path: Path) -> None:
    code, _, err = _run("export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--opset", "12")
    _assert_one_line_error(code, err, "--opset must be between 18 and 23, found 12")


def test_check_without_manifest(tmp_path: Path) -> None:
    code, _, err = _run("check", str(tmp_path))
    _assert_one_line_error(code, err, "no manifest.json; is this a kiln export directory?")


def test_check_unknown_manifest_version(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"manifest_version": 99}')
    code, _, err = _run("check", str(tmp_path))
    _assert_one_line_error(code, err, "manifest_version 99 is not supported")


def test_every_option_has_help() -> None:
    import click

    missing = [
        f"kiln {name} {param.opts[0]}"
        for name, command in main.commands.items()  # type: ignore[attr-defined]
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert missing == []


def test_plugins_says_when_hf_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    monkeypatch.setenv("COLUMNS", "200")  # the family's line and this one unwrapped
    code, out, _ = _run("plugins")
    assert code == 0
    lines = out.splitlines()
    hf = next(i for i, line in enumerate(lines) if line.startswith("hf "))
    want = (
        "unavailable: transformers is not installed "
        """(pip install -e ".[hf]" in kiln's checkout, or pip install "kiln-*.whl[hf]" beside a wheel)"""
    )
    assert lines[hf + 1].strip() == want
    assert not any("unavailable" in line for line in lines[:hf] + lines[hf + 2 :])  # native needs nothing optional


def test_sizes_read_as_a_person_reads_them() -> None:
    from kiln.inputs import size_text as _size

    assert [_size(n) for n in (0, 999, 1000, 812_345, 12_345_678, 1_900_000_000, 16_060_000_000)] == [
        "0 B",
        "999 B",
        "1 KB",
        "812 KB",
        "12.3 MB",
        "1.9 GB",
        "16.1 GB",
    ]
