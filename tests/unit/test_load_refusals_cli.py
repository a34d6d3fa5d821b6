"""What a checkpoint's files must be, refused through the CLI when it loads: exit code 1, one line
on stderr naming the file and the problem, no traceback, no output directory (issue 25: sizes
the weights do not have, impossible sizes, a tokenizer that is none, a link out of the
checkpoint, a context past the config's limit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln_testing import edit_config


def _refused(ckpt: Path, out: Path, *flags: str) -> str:
    """The one line ``kiln export --json`` says on stderr (asserted to be one line, exit code 1)."""
    result = CliRunner().invoke(
        main, ["export", "--model", str(ckpt), "--out", str(out), "--json", *flags]
    )  # --json: no progress rows
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not out.exists()
    return lines[0]


def _garble(ckpt: Path) -> None:
    """Weights no reader can read: a refusal that comes first read none of them."""
    for weights in ckpt.glob("*.safetensors"):
        weights.write_bytes(b"\x00" * 64)


def test_sizes_the_weights_do_not_have(tiny_ckpt: Path, tmp_path: Path) -> None:
    edit_config(tiny_ckpt, d_model=10**7)
    line = _refused(tiny_ckpt, tmp_path / "out")
    assert line == (
        f"error: checkpoint: {tiny_ckpt / 'model.safetensors'}: weights do not match the config: embed.weight "
        "has shape [101, 32],"
        " the config needs [vocab_size, d_model] = [101, 10000000]"
    )


def test_a_tokenizer_that_is_none(tiny_ckpt: Path, tmp_path: Path) -> None:
    (tiny_ckpt / "tokenizer.json").write_text('{"hello": 1}')
    line = _refused(tiny_ckpt, tmp_path / "out")
    assert line.startswith(
        f"error: checkpoint: {tiny_ckpt / 'tokenizer.json'}: not a tokenizer the tokenizers library loads ("
    )


def test_a_link_out_of_the_checkpoint(tiny_ckpt: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(
        json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}})
    )
    (tiny_ckpt / "tokenizer.json").symlink_to(secret)
    line = _refused(tiny_ckpt, tmp_path / "out")
    assert line.startswith(
        f"error: checkpoint: {tiny_ckpt / 'tokenizer.json'} links to {secret}, outside {tiny_ckpt}: "
    )


def test_a_context_past_the_configs_limit_before_the_weights(tiny_ckpt: Path, tmp_path: Path) -> None:
    _garble(tiny_ckpt)
    line = _refused(tiny_ckpt, tmp_path / "out", "--max-context", "8192")
    assert line == "error: export: --max-context 8192 exceeds the model's max_context 48"


def test_impossible_hugging_face_sizes(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])")
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("llama", seed=1).module.model.save_pretrained(ckpt, safe_serialization=True)
    edit_config(ckpt, num_hidden_layers=-2)
    _garble(ckpt)
    line = _refused(ckpt, tmp_path / "out")
    assert (
        line
        == "error: checkpoint: LlamaForCausalLM: num_hidden_layers must be a positive integer, found -2 in config.json"
    )


def test_an_output_another_export_holds_before_the_weights(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Issue 38: a second export into an --out whose lock another export holds loaded the whole
    checkpoint before the lock refused it; the preflight probes the lock first (the weights here
    are unreadable: a refusal after the load would name them)."""
    from kiln.exporter.artifacts.staging import staged_output

    _garble(tiny_ckpt)
    out = tmp_path / "out"
    with staged_output(out, force=False):  # this process writing out, as another export would
        line = _refused(tiny_ckpt, out)
        assert line == (
            f"error: artifacts: {out}: another kiln process is writing this directory (pid {os.getpid()},"
            f" lock {tmp_path / '.out.lock'}); wait for it or choose another --out"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"] and not any(
        out.iterdir()
    )  # the holder's (empty) output; the probe made nothing
    out.rmdir()
    assert "not a readable safetensors file" in _refused(
        tiny_ckpt, out
    )  # released: the same export goes on to the weights
