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
    export("demo", out, ExportOptions.from_flags(max_batch=2, parity_tokens=2))
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
    assert (
        "unexpected: other.json" in problems
        and "unlisted: tokenizer names other.json, which manifest.files does not list (nor hash)" in problems
    )


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
    for command in (
        ("generate", str(export_dir), "--ids", "1,2", "--max-new-tokens", "2"),
        ("bench", str(export_dir), "--runs", "3", "--no-torch"),
        ("check", str(export_dir)),
    ):
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
    assert (
        problem.startswith(f"graph onnx/model.onnx: tensor {tensor.name} reads bytes 1000000000000..")
        and "of weights.bin, which has" in problem
    )


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
        " (#0: the graph has ('input_ids', 'int64', ('batch', 'seq')), the manifest ('input_ids', 'int64', "
        "('batch', 1)))"
    )
    assert outputs.startswith(
        "graph onnx/decode.onnx: its outputs are not the ones the manifest records (#0: the graph has ('logits', "
        "'float32', ('batch', 'seq', 1024))"
    )
    for command in (
        ("bench", str(export_dir), "--runs", "3", "--no-torch"),
        ("triton", str(export_dir), "--name", "demo"),
    ):
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
    assert (
        line == f"error: artifacts: {export_dir / 'manifest.json'}: {message}; the manifest is damaged or was edited: "
        "re-export"
    )
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


# --- issue 38, items 2, 5 and 8: the manifest is a claim, not a key. Every field that changes how
# an export is run or judged is held to what its graphs are (``artifacts.facts``, ``claims``).


@pytest.fixture(scope="module")
def std_pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo exported with --target onnx: portable graphs and static-cache graphs (256 slots)."""
    out = tmp_path_factory.mktemp("tampered-std") / "demo"
    export("demo", out, ExportOptions.from_flags(max_batch=2, parity_tokens=2, target="onnx"))
    return out


@pytest.fixture
def std_dir(std_pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "export"
    shutil.copytree(std_pristine, copy)
    return copy


_IDS = ("--ids", "1,2", "--max-new-tokens", "2")


def _refused_by_verify(directory: Path, problem: str, command: str) -> None:
    """``kiln verify`` lists exactly ``problem``; ``command`` (generate, check) is one line naming it."""
    assert _verify_problems(directory) == [problem]
    line = _refused(command, str(directory), *(_IDS if command == "generate" else ()))
    assert (
        line
        == f"error: artifacts: {directory}: files differ from manifest.json: {problem}; run kiln verify {directory}"
    )


def _noise(path: Path, scale: float = 0.02) -> None:
    """Every float32 of a weights file times (1 + ``scale`` x a standard normal)."""
    import numpy as np

    weights = np.fromfile(path, dtype=np.float32)
    noise = np.random.default_rng(0).standard_normal(weights.shape).astype(np.float32)
    (weights * (1 + scale * noise)).tofile(path)


def _path_set(*changes: tuple[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A manifest change setting each dotted path (``export.ple.rows``) to its value."""

    def change(data: dict[str, Any]) -> None:
        for path, value in changes:
            *parents, last = path.split(".")
            node = data
            for key in parents:
                node = node[key]
            node[last] = value

    return change


_PRECISION = "their QuantizeLinear, DequantizeLinear and MatMulNBits, and their float type"
_CACHE = "their decode step's cache inputs and attention"
_LOGITS = "the positions of their prefill logits"
_SLOTS = "the slots of their static KV cache"
_PORTABLE, _STD = "but the portable graphs say", "but the --target onnx graphs say"


@pytest.mark.parametrize(
    ("weights", "field", "value", "problem"),
    [
        ("onnx/weights.bin", "precision", "int8", f"precision is 'int8', {_PORTABLE} 'fp32' ({_PRECISION})"),
        (
            "onnx/weights.std.bin", "targets.onnx.precision", "int4",
            f"targets.onnx.precision is 'int4', {_STD} 'fp32' ({_PRECISION})",
        ),
    ],
)  # fmt: skip
def test_a_claimed_precision_does_not_loosen_check(
    std_dir: Path, weights: str, field: str, value: str, problem: str
) -> None:
    """Item 2: noisy fp32 weights fail check; claiming a looser precision (hashes recomputed) no
    longer buys that precision's tolerances: the graphs have no Q/DQ, verify and check refuse."""
    _noise(std_dir / weights)
    _edit_manifest(std_dir, _path_set((field, value)))
    _refused_by_verify(std_dir, problem, "check")


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("targets.onnx.kv_cache", "shared", f"targets.onnx.kv_cache is 'shared', {_STD} 'static' ({_CACHE})"),
        ("targets.onnx.kv_cache", "concat", f"targets.onnx.kv_cache is 'concat', {_STD} 'static' ({_CACHE})"),
        ("targets.onnx.kv_cache", "bogus", f"targets.onnx.kv_cache is 'bogus', {_STD} 'static' ({_CACHE})"),
        (
            "tokenizer", "onnx/weights.bin",
            "tokenizer is 'onnx/weights.bin', which weights.file names: a tokenizer.json is expected",
        ),
        (
            "tokenizer", "onnx/genai_config.json",
            "tokenizer is 'onnx/genai_config.json', not a tokenizer.json (a JSON object with its model and "
                "added_tokens)",
        ),
        ("export.logits", "bogus", f"export.logits is 'bogus', {_PORTABLE} 'all' ({_LOGITS})"),
        ("export.logits", "last", f"export.logits is 'last', {_PORTABLE} 'all' ({_LOGITS})"),
        (
            "export.ple.extend_mode", "bogus",
            "export.ple.extend_mode is 'bogus', not one of clamp, interpolate (or null: the trained table)",
        ),
        (
            "export.ple.tables", "input",
            f"export.ple.tables is 'input', {_PORTABLE} 'constant' (their ple.{{i}}.scale/.shift inputs, or none)",
        ),
        ("precision", "fp16", f"precision is 'fp16', {_PORTABLE} 'fp32' ({_PRECISION})"),
        ("targets.onnx.precision", "fp16", f"targets.onnx.precision is 'fp16', {_STD} 'fp32' ({_PRECISION})"),
        (
            "kv_cache.dtype", "float16",
            f"kv_cache.dtype is 'float16', {_PORTABLE} 'float32' (the dtype of their past and present tensors)",
        ),
        ("limits.max_context", 128, f"limits.max_context is 128, {_STD} 256 ({_SLOTS})"),
        ("parity.agreement", "bogus", "parity.agreement is 'bogus', not one of gate, record (or absent)"),
    ],
)  # fmt: skip
def test_a_tampered_field_is_refused_by_verify(std_dir: Path, field: str, value: Any, problem: str) -> None:
    """Item 8: each field (hashes recomputed) passed verify, then generate or check raised a traceback."""
    _edit_manifest(std_dir, _path_set((field, value)))
    _refused_by_verify(std_dir, problem, "generate")


def test_a_target_entry_copied_under_another_target(std_dir: Path) -> None:
    """``targets.ort`` copied from ``targets.onnx``: the ort runner would be handed static-cache graphs."""
    _edit_manifest(std_dir, lambda data: data["targets"].__setitem__("ort", data["targets"]["onnx"]))
    problem = (
        "targets.ort.kv_cache is 'static', but --target ort writes only 'shared' or 'grown' caches, and the "
        "--target ort"
        " graphs (onnx/prefill.std.onnx, onnx/decode.std.onnx, onnx/model.std.onnx) say 'static':"
        " they are another target's graphs"
    )
    _refused_by_verify(std_dir, problem, "check")
    assert _refused("generate", str(std_dir), "--target", "ort", *_IDS).endswith(
        f"{problem}; run kiln verify {std_dir}"
    )


def test_a_longer_context_than_the_static_cache(std_dir: Path) -> None:
    """Item 5: ``limits.max_context`` x4 (and the PLE rows with it, which read refuses alone) passed
    verify; generate then died in TensorScatter. The buffers' capacity is the graphs' cache dim."""
    _edit_manifest(std_dir, _path_set(("limits.max_context", 1024), ("export.ple.rows", 1024)))
    problem = f"limits.max_context is 1024, {_STD} 256 ({_SLOTS})"
    _refused_by_verify(std_dir, problem, "generate")
    assert problem in _refused("generate", str(std_dir), "--target", "onnx", *_IDS)


def test_a_longer_context_than_the_position_tables(export_dir: Path) -> None:
    """The portable graphs gather their PLE tables by position: no context may pass their 256 rows."""
    _edit_manifest(export_dir, _path_set(("limits.max_context", 1024), ("export.ple.rows", 1024)))
    problem = f"limits.max_context is 1024, {_PORTABLE} at most 256 (the rows of the tables they index by position)"
    _refused_by_verify(export_dir, problem, "generate")


def test_version_1_over_version_2_data(std_dir: Path) -> None:
    """``manifest_version: 1`` on a v2 export was upgraded into nonsense (its static graphs run as a grown cache)."""
    _edit_manifest(std_dir, _path_set(("manifest_version", 1)))
    line = _refused("verify", str(std_dir))
    assert line == (
        f"error: artifacts: {std_dir / 'manifest.json'}: manifest_version is 1, but targets.onnx is a version 2 field"
        " (its data is version 2's); the manifest is damaged or was edited: re-export"
    )
    assert _refused("generate", str(std_dir), *_IDS) == line
    assert _refused("check", str(std_dir)) == line


def test_the_pristine_std_export_verifies_and_runs(std_pristine: Path) -> None:
    """Every fact of an untouched --target onnx export agrees with its manifest."""
    from kiln.exporter.artifacts.facts import facts_of

    code, out, _ = _run("verify", str(std_pristine))
    assert code == 0, out
    kinds = ("prefill", "decode", "model")
    suffixes = {"portable": ".onnx", "onnx": ".std.onnx"}
    sets = {name: {k: Path(f"onnx/{k}{suffix}") for k in kinds} for name, suffix in suffixes.items()}
    portable, std = facts_of(sets, std_pristine).values()
    assert (portable.precision, portable.kv_dtype, portable.kv_cache, portable.capacity, portable.positions) == (
        "fp32", "float32", "grown", None, 256,
    )  # fmt: skip
    assert (std.precision, std.kv_dtype, std.kv_cache, std.capacity, std.logits, std.ple_tables) == (
        "fp32", "float32", "static", 256, "all", "constant",
    )  # fmt: skip
    code, out, err = _run("generate", str(std_pristine), "--target", "onnx", *_IDS, "--json")
    assert code == 0 and json.loads(out)["kv_cache"] == "static-buffer", err


def test_a_static_cache_past_the_machine_is_refused_before_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5: ``--max-context 1000000 --target onnx`` on a small model grew to 7 GB, then a BFCArena
    traceback. The buffers' bytes are the config's, and so is parity's measured peak over them:
    refused before any weight is read (the checkpoint's weights here are not even a safetensors
    file), naming the bytes, the limit and the longest context that fits."""
    from kiln.exporter.contract import static_cache
    from kiln_testing import tiny_config, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(max_context=1_000_000, ple={"enabled": False}))
    (ckpt / "model.safetensors").write_bytes(b"not read")
    out = tmp_path / "out"
    args = ("export", "--model", str(ckpt), "--out", str(out), "--max-context", "1000000", "--target", "onnx")
    monkeypatch.setattr(
        static_cache, "machine_memory", lambda: 24 * 2**30
    )  # the machine: the buffers at --max-batch fit
    assert _refused(
        *args
    ) == (  # parity's peak does not: 17x the buffers of its 4 rows (exporter/contract/static_cache.py)
        "error: export: --max-context 1000000: the export's parity runs the static KV cache of --target onnx at "
        "4 rows of"
        " 2 layers x 2 (key, value) x 2 KV heads x 1000000 slots x 8 x 4 bytes (float32) = 256000000 bytes each, "
        "and needs"
        " about 17x those buffers (ONNX Runtime's copies of them and its attention over every slot, measured) = "
        "17408000000"
        " bytes (16.2 GiB), more than half this machine's memory (12884901888 bytes, 12.0 GiB); pass "
        "--max-context 740171 or less"
    )
    monkeypatch.setattr(static_cache, "machine_memory", lambda: 2**31)
    assert _refused(*args, "--max-batch", "1").endswith(  # parity's rows are those it runs: 1 at --max-batch 1
        " at 1 row of 2 layers x 2 (key, value) x 2 KV heads x 1000000 slots x 8 x 4 bytes (float32) = 256000000 "
        "bytes each, and needs"
        " about 17x those buffers (ONNX Runtime's copies of them and its attention over every slot, measured) = "
        "4352000000"
        " bytes (4.1 GiB), more than half this machine's memory (1073741824 bytes, 1.0 GiB); pass --max-context "
        "246723 or less"
    )
    assert _refused(*args, "--max-batch", "64") == (  # the buffers a runtime serving 64 rows allocates
        "error: export: --max-context 1000000: the static KV cache of --target onnx takes 64 rows (--max-batch) "
        "x 2 layers x 2"
        " (key, value) x 2 KV heads x 1000000 slots x 8 x 4 bytes (float32) = 16384000000 bytes (15.3 GiB), more "
        "than half this"
        " machine's memory (1073741824 bytes, 1.0 GiB); pass --max-context 61680 or less, or a smaller --max-batch"
    )
    assert not out.exists() and list(tmp_path.iterdir()) == [ckpt]
    assert "not a readable safetensors file" in _refused(
        *args[:-3], "61680", "--target", "onnx", "--max-batch", "64"
    )  # fits both: on to the weights
    # the portable graphs have nothing static to size: the same export goes on to read the weights
    line = _refused("export", "--model", str(ckpt), "--out", str(out), "--max-context", "1000000")
    assert line.startswith("error: checkpoint: ") and "not a readable safetensors file" in line
