"""kiln generate: the IOBinding loop gives exactly PyTorch's greedy tokens on the demo export,
serves as the candidate side of teacher-forced parity, and reports bad input in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from kiln.cli import main
from kiln.errors import GenerateError
from kiln.exporter.options import ExportOptions
from kiln.exporter.parity import greedy, make_prompts
from kiln.exporter.pipeline import export
from kiln.exporter.precision import TOLERANCES
from kiln.exporter.runners import TorchRunner
from kiln.plugins import load_model
from kiln.runtime.generate import Generator, parse_ids
from kiln_testing import tiny_config, write_checkpoint

STEPS = 24


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "demo"
    export("demo", out, ExportOptions.from_flags(max_batch=1, parity_tokens=2))
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gen-tiny")
    export(
        write_checkpoint(root / "ckpt", tiny_config()),
        root / "out",
        ExportOptions.from_flags(max_batch=1, parity_tokens=2),
    )
    return root / "out"


@pytest.fixture(scope="module")
def torch_runner() -> tuple[TorchRunner, object]:
    loaded = load_model("demo")
    return TorchRunner(loaded.module, loaded.spec.n_layers), loaded.spec


def test_greedy_tokens_equal_pytorch(demo_dir: Path, torch_runner: tuple[TorchRunner, object]) -> None:
    runner, spec = torch_runner
    tok = Tokenizer.from_file(str(demo_dir / "onnx" / "tokenizer.json"))
    generator = Generator(demo_dir, threads=1)
    prompts = make_prompts(spec, [1, 13], seed=3)  # type: ignore[arg-type]
    for prompt in (tok.encode("def read_config(path):\n").ids, *prompts):
        want, _ = greedy(runner, spec, [prompt], STEPS)  # type: ignore[arg-type]
        got = generator.run(prompt, STEPS, stop_at_eos=False)
        assert got.tokens == tuple(want[0].tolist()), prompt
        assert got.prompt == tuple(prompt) and got.prefill_s > 0 and got.decode_s > 0


def test_teacher_forced_logits_match_pytorch(demo_dir: Path, torch_runner: tuple[TorchRunner, object]) -> None:
    """The generate loop as the candidate of a generation-parity check (forced tokens, logits kept)."""
    runner, spec = torch_runner
    prompt = make_prompts(spec, [9], seed=7)[0]  # type: ignore[arg-type]
    forced = np.random.default_rng(0).integers(3, 1024, size=STEPS)
    want_tokens, want_logits = greedy(runner, spec, [prompt], STEPS, forced=forced[None, :])  # type: ignore[arg-type]
    got = Generator(demo_dir, threads=1).run(prompt, STEPS, stop_at_eos=False, forced=forced.tolist(), keep_logits=True)
    assert got.tokens == tuple(want_tokens[0].tolist()) == tuple(forced.tolist())
    assert got.logits is not None and got.logits.shape == (STEPS, 1024)
    assert TOLERANCES["fp32"].logits.holds(
        want_logits[:, 0], got.logits
    )  # every step's row within fp32's logits tolerance


def test_stops_at_eos(demo_dir: Path) -> None:
    generator = Generator(demo_dir, threads=1)
    eos = generator.eos
    got = generator.run([5, 6, 7], STEPS, forced=[9, eos] + [9] * STEPS)
    assert got.tokens == (9, eos)


def test_cli_text_in_text_out(demo_dir: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(demo_dir),
            "--prompt",
            "def read_config(path):\n",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    tok = Tokenizer.from_file(str(demo_dir / "onnx" / "tokenizer.json"))
    assert data["prompt_ids"] == tok.encode("def read_config(path):\n").ids
    assert len(data["tokens"]) == 8 and data["text"] == tok.decode(data["tokens"])
    assert data["prefill_tokens_per_s"] > 0 and data["decode_tokens_per_s"] > 0
    assert data["finish_reason"] == "length" and data["sampling"]["temperature"] == 0.0
    plain = CliRunner().invoke(
        main,
        ["generate", str(demo_dir), "--prompt", "def read_config(path):\n", "--max-new-tokens", "8", "--ignore-eos"],
    )
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout == "def read_config(path):\n" + data["text"] + "\n" and "tokens/s" in plain.stderr


def _json(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(main, ["generate", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def test_ids_are_decoded_when_the_export_has_a_tokenizer(demo_dir: Path, tiny_dir: Path) -> None:
    data = _json(str(demo_dir), "--ids", "12,40,7", "--max-new-tokens", "6", "--ignore-eos")
    tok = Tokenizer.from_file(str(demo_dir / "onnx" / "tokenizer.json"))
    decoded = tok.decode(data["tokens"])  # type: ignore[arg-type]
    assert isinstance(data["text"], str) and data["text"] == decoded and data["text"]
    assert (
        _json(str(tiny_dir), "--ids", "5,6", "--max-new-tokens", "3", "--ignore-eos")["text"] is None
    )  # no tokenizer.json
    plain = CliRunner().invoke(
        main, ["generate", str(tiny_dir), "--ids", "5,6", "--max-new-tokens", "3", "--ignore-eos"]
    )
    assert plain.exit_code == 0 and len(plain.stdout.split()) == 3 and all(t.isdigit() for t in plain.stdout.split())


def test_sampling_through_the_cli(demo_dir: Path) -> None:
    """The options reach the loop: a seed reproduces, top-k 1 is greedy, and sampling differs from greedy."""
    args = [str(demo_dir), "--prompt", "def main(", "--max-new-tokens", "16", "--ignore-eos"]
    greedy_tokens = _json(*args)["tokens"]
    sampled = _json(*args, "--temperature", "1.5", "--seed", "3")
    assert sampled["tokens"] == _json(*args, "--temperature", "1.5", "--seed", "3")["tokens"]
    assert sampled["tokens"] != greedy_tokens and sampled["sampling"] == {
        "temperature": 1.5,
        "top_k": 0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "seed": 3,
    }
    assert _json(*args, "--temperature", "1.5", "--top-k", "1", "--seed", "4")["tokens"] == greedy_tokens
    assert _json(*args, "--repetition-penalty", "1.5")["tokens"] != greedy_tokens  # greedy, penalised repeats


def test_stop_string_ends_the_text_and_the_stream(demo_dir: Path) -> None:
    from kiln.runtime.generate import GenerateOptions, generate_command

    args = [str(demo_dir), "--prompt", "def read_config(path):\n", "--max-new-tokens", "24", "--ignore-eos"]
    full = _json(*args)
    text, tokens = str(full["text"]), list(full["tokens"])  # type: ignore[call-overload]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string the greedy text reaches halfway
    stopped = _json(*args, "--stop", stop)
    assert stopped["text"] == text[: text.index(stop)] and stopped["finish_reason"] == "stop"
    count = len(stopped["tokens"])  # type: ignore[arg-type]
    assert stopped["tokens"] == tokens[:count] and count < len(tokens)
    pieces: list[str] = []
    summary = generate_command(
        demo_dir, "def read_config(path):\n", None, GenerateOptions(24, False, (stop,)), on_text=pieces.append
    )
    assert "".join(pieces) == stopped["text"] and len(pieces) > 3 and summary["text"] == stopped["text"]
    assert (
        "\n" in text and _json(*args, "--stop", "\\n")["text"] == text.split("\n")[0]
    )  # as typed in a shell: backslash n
    plain = CliRunner().invoke(main, ["generate", *args, "--stop", stop])
    assert plain.stdout == "def read_config(path):\n" + str(stopped["text"]) + "\n" and "; stop)" in plain.stderr


def test_prompt_reads_escapes_as_stop_does(demo_dir: Path) -> None:
    """``--prompt 'def f():\\n'`` as typed in a shell is the newline, as ``--stop`` reads it (the prompt
    was taken literally while --stop was unescaped); ``\\\\`` is one backslash."""
    args = ["--max-new-tokens", "4", "--ignore-eos"]
    typed, real = (_json(str(demo_dir), "--prompt", p, *args) for p in ("def f(x):\\n\\t", "def f(x):\n\t"))
    assert [typed[k] for k in ("prompt_ids", "tokens", "text")] == [real[k] for k in ("prompt_ids", "tokens", "text")]
    tok = Tokenizer.from_file(str(demo_dir / "onnx" / "tokenizer.json"))
    assert (
        _json(str(demo_dir), "--prompt", "a\\\\n", *args)["prompt_ids"] == tok.encode("a\\n").ids
    )  # a backslash, then n
    assert real["prompt_ids"] == tok.encode("def f(x):\n\t").ids


def _error(*args: str) -> str:
    result = CliRunner().invoke(main, ["generate", *args])
    assert result.exit_code == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr
    return lines[0]


def test_cli_errors(demo_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert (
        _error(str(tmp_path / "empty"), "--ids", "1")
        == f"error: artifacts: {tmp_path / 'empty'}: no manifest.json; is this a kiln export directory?"
    )
    assert _error(str(tiny_dir), "--prompt", "hello") == (
        f"error: generate: {tiny_dir}: the export has no tokenizer.json (its checkpoint had none); pass token "
        "ids with --ids"
    )
    assert _error(str(demo_dir), "--prompt", "   ") == "error: generate: the prompt is empty: give some text"
    assert _error(str(demo_dir)) == "error: generate: give exactly one of --prompt TEXT or --ids 1,2,3"
    assert (
        _error(str(demo_dir), "--ids", "1", "--prompt", "x")
        == "error: generate: give exactly one of --prompt TEXT or --ids 1,2,3"
    )
    assert (
        _error(str(demo_dir), "--ids", "1,x")
        == "error: generate: --ids: expected comma-separated integers, found '1,x'"
    )
    assert _error(str(demo_dir), "--ids", "5,99999") == "error: generate: token ids must be in [0, 1024); found [99999]"
    assert (
        _error(str(demo_dir), "--ids", "5", "--max-new-tokens", "0")
        == "error: generate: --max-new-tokens must be at least 1, found 0"
    )
    assert _error(str(demo_dir), "--ids", "5", "--max-new-tokens", "300") == (
        "error: generate: prompt (1 tokens) + 300 new tokens exceed the export's context limit 256"
    )
    changed = Path(shutil.copytree(tiny_dir, tmp_path / "changed"))
    (changed / "onnx" / "decode.onnx").write_bytes(b"changed")
    assert "files differ from manifest.json: changed (sha256 differs): onnx/decode.onnx" in _error(
        str(changed), "--ids", "1"
    )
    assert (
        _error(str(demo_dir), "--ids", "5", "--temperature", "-1")
        == "error: generate: --temperature must be at least 0 (0 is greedy), found -1.0"
    )
    assert (
        _error(str(demo_dir), "--ids", "5", "--temperature", "1", "--top-p", "0")
        == "error: generate: --top-p must be in (0, 1] (1 keeps every token), found 0.0"
    )
    assert (
        _error(str(demo_dir), "--ids", "5", "--temperature", "1", "--top-k", "-2")
        == "error: generate: --top-k must be at least 0 (0 keeps every token), found -2"
    )
    assert (
        _error(str(demo_dir), "--ids", "5", "--temperature", "1", "--seed", "-1")
        == "error: generate: --seed must be at least 0, found -1"
    )
    assert (
        _error(str(demo_dir), "--ids", "5", "--stop", "")
        == "error: generate: --stop is empty: give the text that ends the generation"
    )
    assert _error(str(tiny_dir), "--ids", "5", "--stop", "x") == (
        f"error: generate: {tiny_dir}: --stop needs the export's tokenizer.json to find the text, and the export "
        "has none"
    )
    with pytest.raises(GenerateError, match="--ids is empty"):
        parse_ids(" , ")
