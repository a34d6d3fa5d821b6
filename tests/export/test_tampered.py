"""Nothing outside an export is read, and a tampered export is one line (issue 25, items 3-6):
``kiln verify`` checks the paths a manifest names, every graph's external data, every graph's
I/O against the manifest and the model's dims against the graphs; the commands that run an
export (generate, bench, check, triton) refuse what verify refuses, in one line."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.exporter.artifacts.hashing import hash_tree
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tampered") / "demo"
    export("demo", out, ExportOptions(max_batch=2, parity_tokens=2))
    return out


@pytest.fixture
def export_dir(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "export"
    shutil.copytree(pristine, copy)
    return copy


def _edit_manifest(directory: Path, change: Callable[[dict[str, Any]], None], rehash: bool = True) -> None:
    """Change the manifest, then make every hash true again (as a careful tamperer would)."""
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    if rehash:
        data["files"] = hash_tree(directory, exclude=("manifest.json",))
    path.write_text(json.dumps(data))


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def _refused(*args: str) -> str:
    code, _, err = _run(*args)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _verify_problems(directory: Path) -> list[str]:
    code, out, _ = _run("verify", str(directory), "--json")
    assert code == 1, out
    problems: list[str] = json.loads(out)["problems"]
    return problems


def _set_tokenizer(path: str) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data["tokenizer"] = path

    return change


@pytest.mark.parametrize("where", ["../../outside.json", "/etc/outside.json", "onnx/../../outside.json"])
def test_tokenizer_outside_the_export(export_dir: Path, where: str) -> None:
    outside = export_dir.parent / "outside.json"
    shutil.copyfile(export_dir / "onnx" / "tokenizer.json", outside)
    _edit_manifest(export_dir, _set_tokenizer(where))
    assert _verify_problems(export_dir) == [
        f"outside the export: tokenizer is {where!r} (a relative path inside the directory, without '..', is expected)"
    ]
    line = _refused("generate", str(export_dir), "--prompt", "def ", "--max-new-tokens", "2")
    assert f"files differ from manifest.json: outside the export: tokenizer is {where!r}" in line


def test_tokenizer_not_hashed(export_dir: Path) -> None:
    shutil.copyfile(export_dir / "onnx" / "tokenizer.json", export_dir / "other.json")
    _edit_manifest(export_dir, _set_tokenizer("other.json"), rehash=False)
    problems = _verify_problems(export_dir)
    assert "unexpected: other.json" in problems and "unlisted: tokenizer names other.json, which manifest.files does not list (nor hash)" in problems


def _relocate_external_data(directory: Path, graph: str, location: str) -> None:
    model = onnx.load(str(directory / graph), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, str(directory / graph))


@pytest.mark.parametrize("location", ["../../../etc/passwd", "/etc/passwd", "sub/weights.bin"])
def test_external_data_outside_the_graph_folder(export_dir: Path, location: str) -> None:
    _relocate_external_data(export_dir, "onnx/decode.onnx", location)
    _edit_manifest(export_dir, lambda data: None)
    problems = _verify_problems(export_dir)
    assert len(problems) == 1 and problems[0].startswith("graph onnx/decode.onnx: tensor ")
    assert problems[0].endswith(f"reads external data from {location!r}, not from a file beside the graph")
    for command in (("generate", str(export_dir), "--ids", "1,2", "--max-new-tokens", "2"), ("bench", str(export_dir), "--runs", "3", "--no-torch"), ("check", str(export_dir))):
        assert "files differ from manifest.json: graph onnx/decode.onnx: tensor" in _refused(*command)


def test_external_data_from_an_unlisted_file(export_dir: Path) -> None:
    shutil.copyfile(export_dir / "onnx" / "weights.bin", export_dir / "onnx" / "copy.bin")
    _relocate_external_data(export_dir, "onnx/prefill.onnx", "copy.bin")
    _edit_manifest(export_dir, lambda data: None)
    os.remove(export_dir / "onnx" / "copy.bin")  # then listed nowhere: the manifest was hashed with it
    problems = _verify_problems(export_dir)
    assert "missing: onnx/copy.bin" in problems


def test_external_data_past_the_end_of_the_file(export_dir: Path) -> None:
    model = onnx.load(str(export_dir / "onnx" / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "offset":
            entry.value = str(10**12)
    onnx.save(model, str(export_dir / "onnx" / "model.onnx"))
    _edit_manifest(export_dir, lambda data: None)
    (problem,) = _verify_problems(export_dir)
    assert problem.startswith(f"graph onnx/model.onnx: tensor {tensor.name} reads bytes 1000000000000..") and "of weights.bin, which has" in problem


def test_a_linked_weights_file(export_dir: Path) -> None:
    """A weights.bin replaced by a link to an identical file outside: the hash alone would pass."""
    outside = export_dir.parent / "weights-outside.bin"
    shutil.move(export_dir / "onnx" / "weights.bin", outside)
    os.symlink(outside, export_dir / "onnx" / "weights.bin")
    problems = _verify_problems(export_dir)
    assert f"a symbolic link (kiln writes none, and reads none): onnx/weights.bin -> {outside}" in problems
    assert "missing: onnx/weights.bin" in problems
    line = _refused("triton", str(export_dir), "--name", "demo")
    assert "files differ from manifest.json: missing: onnx/weights.bin" in line
    assert not (export_dir / "triton").exists()


def test_a_swapped_graph(export_dir: Path) -> None:
    """decode.onnx replaced by prefill.onnx, hashes updated: its I/O are not the manifest's."""
    shutil.copyfile(export_dir / "onnx" / "prefill.onnx", export_dir / "onnx" / "decode.onnx")
    _edit_manifest(export_dir, lambda data: None)
    inputs, outputs = _verify_problems(export_dir)
    assert inputs == (
        "graph onnx/decode.onnx: its inputs are not the ones the manifest records"
        " (#0: the graph has ('input_ids', 'int64', ('batch', 'seq')), the manifest ('input_ids', 'int64', ('batch', 1)))"
    )
    assert outputs.startswith("graph onnx/decode.onnx: its outputs are not the ones the manifest records (#0: the graph has ('logits', 'float32', ('batch', 'seq', 1024))")
    for command in (("bench", str(export_dir), "--runs", "3", "--no-torch"), ("triton", str(export_dir), "--name", "demo")):
        assert "graph onnx/decode.onnx: its inputs are not the ones the manifest records" in _refused(*command)


def _set(section: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data[section][key] = value

    return change


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("model", "n_layers", 1_000_000_000, "model.n_layers is 1000000000, outside 1..4096"),
        ("model", "vocab_size", 10**12, "model.vocab_size is 1000000000000, outside 1..2147483648"),
        ("limits", "max_batch", -1, "limits.max_batch is -1, outside 1..65536"),
        ("limits", "max_context", 0, "limits.max_context is 0, outside 2..16777216"),
        ("limits", "max_context", 10**400, "limits.max_context is 1" + "0" * 400 + ", outside 2..16777216"),
        ("model", "eos_token_id", -5, "model.eos_token_id is -5, not a token id"),
    ],
)
def test_numbers_no_export_has(export_dir: Path, section: str, key: str, value: int, message: str) -> None:
    _edit_manifest(export_dir, _set(section, key, value))
    line = _refused("verify", str(export_dir))
    assert line == f"error: artifacts: {export_dir / 'manifest.json'}: {message}; the manifest is damaged or was edited: re-export"
    assert _refused("generate", str(export_dir), "--ids", "1", "--max-new-tokens", "2") == line


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("n_layers", 3, "model.n_layers is 3, but graph onnx/decode.onnx carries the KV cache of 4 layers"),
        ("vocab_size", 1000, "model.vocab_size is 1000, but graph onnx/decode.onnx has 1024 logits"),
        ("n_kv_heads", 8, "model.n_kv_heads is 8, but graph onnx/decode.onnx has 2 in present.0.key"),
    ],
)
def test_model_dims_the_graphs_do_not_have(export_dir: Path, key: str, value: int, message: str) -> None:
    _edit_manifest(export_dir, _set("model", key, value))
    assert message in _verify_problems(export_dir)
    assert message in _refused("generate", str(export_dir), "--ids", "1", "--max-new-tokens", "2")


def test_the_pristine_export_verifies(pristine: Path) -> None:
    code, out, _ = _run("verify", str(pristine))
    assert code == 0 and out.startswith(f"{pristine}: all ") and out.strip().endswith("files match manifest.json")


def test_a_version_1_export_still_runs(pristine: Path, tmp_path: Path) -> None:
    """An export directory the previous kiln wrote (manifest_version 1): verify, generate and
    check read it through the upgrade (manifest_v1), its files untouched."""
    from kiln_testing import downgrade

    directory = tmp_path / "v1"
    shutil.copytree(pristine, directory)
    data = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps(downgrade(data)))
    code, out, _ = _run("verify", str(directory))
    assert code == 0, out
    code, out, err = _run("generate", str(directory), "--ids", "1,2", "--max-new-tokens", "3", "--json")
    assert code == 0 and len(json.loads(out)["tokens"]) == 3, err
    code, out, err = _run("check", str(directory))
    assert code == 0 and "parity passed" in out, (out, err)
