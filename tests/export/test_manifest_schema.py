"""``exporter/artifacts/manifest.schema.json`` describes the manifests kiln writes, and rejects broken ones.

Manifests from real exports are validated: the demo in fp32 (with a tokenizer), and a tiny model
in fp16 with ``--logits last`` and ``--ple-tables input`` (no tokenizer); then the same after a
Triton repository was added, and with the ``engines`` entry ``kiln build`` adds.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from kiln.exporter.options import ExportOptions, LogitsMode, PLETables, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.serving import write_triton_repo
from kiln_testing import tiny_config, write_checkpoint

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.fixture(scope="module")
def demo_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("schema32") / "out"
    export("demo", out, ExportOptions.from_flags(parity_tokens=4))
    return out


@pytest.fixture(scope="module")
def tiny_fp16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("schema16")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    options = ExportOptions.from_flags(
        precision=Precision.FP16, logits=LogitsMode.LAST, ple_tables=PLETables.INPUT, parity_tokens=4
    )
    export(ckpt, root / "out", options)
    return root / "out"


def _manifest(directory: Path) -> Manifest:
    return json.loads((directory / "manifest.json").read_text())


def _errors(validator: Draft202012Validator, manifest: Manifest) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(manifest)]


def test_fp32_demo_manifest_is_valid(validator: Draft202012Validator, demo_fp32: Path) -> None:
    manifest = _manifest(demo_fp32)
    assert manifest["precision"] == "fp32" and manifest["tokenizer"] == "onnx/tokenizer.json"
    assert _errors(validator, manifest) == []
    # every key kiln writes is one the schema requires (nothing optional but "engines")
    assert set(manifest) == set(validator.schema["required"])


def test_fp16_logits_last_ple_input_manifest_is_valid(validator: Draft202012Validator, tiny_fp16: Path) -> None:
    manifest = _manifest(tiny_fp16)
    assert manifest["precision"] == "fp16" and manifest["export"]["logits"] == "last"
    assert manifest["export"]["ple"]["tables"] == "input" and manifest["tokenizer"] is None
    assert manifest["graphs"]["prefill"]["outputs"][0]["shape"][1] == 1
    assert any(t["name"] == "ple.0.scale" for t in manifest["graphs"]["decode"]["inputs"])
    assert all(g["passes"]["fp16"]["fp32_nodes"] for g in manifest["graphs"].values())
    assert _errors(validator, manifest) == []


def test_manifest_with_triton_files_and_engines_is_valid(
    validator: Draft202012Validator, demo_fp32: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "export"
    shutil.copytree(demo_fp32, directory)
    write_triton_repo(directory, "demo")
    manifest = _manifest(directory)
    assert "triton/demo/config.pbtxt" in manifest["files"]
    assert _errors(validator, manifest) == []
    manifest["engines"] = {  # as kiln.exporter.engine.records.update_manifest writes it
        "record": "engines/engines.json",
        "tensorrt": "10.13.0.35",
        "cuda": "12.9",
        "gpu": "NVIDIA H200",
        "compute_capability": "9.0",
        "files": {"prefill": "engines/prefill.plan", "decode": "engines/decode.plan"},
        "graphs": "portable",
        "graphs_reason": "the export has no --target onnx graphs (manifest targets.onnx)",
    }
    assert _errors(validator, manifest) == []


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[Manifest], None]:
    """A change to a copy of a manifest: set (or delete, with ``_DELETE``) the value at ``path``."""

    def change(manifest: Manifest) -> None:
        *parents, last = path
        node: Any = manifest
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return change


_DELETE = object()

BROKEN_FP32: dict[str, tuple[Callable[[Manifest], None], str]] = {
    "unknown top-level key": (_set(("extra",), 1), "Additional properties are not allowed ('extra' was unexpected)"),
    "missing files": (_set(("files",), _DELETE), "'files' is a required property"),
    "missing graph": (_set(("graphs", "decode"), _DELETE), "'decode' is a required property"),
    "manifest version": (_set(("manifest_version",), 1), "2 was expected"),
    "short sha256": (_set(("files", "onnx/model.onnx"), "abc123"), "does not match '^[0-9a-f]{64}$'"),
    "upper-case sha256": (_set(("files", "onnx/weights.bin"), "A" * 64), "does not match '^[0-9a-f]{64}$'"),
    "unknown precision": (
        _set(("precision",), "int2"),
        "'int2' is not one of ['fp32', 'fp16', 'int8', 'int8+fp16', 'int4', 'int4+fp16', 'fp8']",
    ),
    "unknown dtype": (_set(("graphs", "model", "inputs", 3, "dtype"), "float"), "'float' is not one of"),
    "unknown dim name": (
        _set(("graphs", "model", "inputs", 3, "shape", 2), "past"),
        "'past' is not valid under any of the given schemas",
    ),
    "negative dim": (
        _set(("graphs", "model", "outputs", 0, "shape", 2), -1),
        "-1 is not valid under any of the given schemas",
    ),
    "inputs out of order": (
        _set(("graphs", "prefill", "inputs", 0, "name"), "attention_mask"),
        "'input_ids' was expected",
    ),
    "unknown tensor name": (_set(("graphs", "decode", "outputs", 1, "name"), "present_0_key"), "does not match"),
    "fp16 nodes in fp32": (
        _set(("graphs", "model", "passes"), {"fp16": {"fp32_nodes": ["/embed/Gather"], "fp32_ple_tables": []}}),
        "should not be valid under",
    ),
    "fp16 kv in fp32": (_set(("kv_cache", "dtype"), "float16"), "'float32' was expected"),
    "escaping path": (_set(("files", "../outside"), "0" * 64), "does not match"),
    "kv layout": (_set(("kv_cache", "layout"), "BSNH"), "'BNSH' was expected"),
    "negative token id": (_set(("model", "pad_token_id"), -1), "-1 is less than the minimum of 0"),
    "opset": (_set(("export", "opset"), 17), "17 is less than the minimum of 18"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FP32))
def test_broken_fp32_manifest_is_rejected(validator: Draft202012Validator, demo_fp32: Path, case: str) -> None:
    change, message = BROKEN_FP32[case]
    manifest = copy.deepcopy(_manifest(demo_fp32))
    change(manifest)
    errors = _errors(validator, manifest)
    assert errors, f"{case}: accepted"
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set(("graphs", "decode", "passes", "fp16", "fp32_nodes"), _DELETE), "'fp32_nodes' is a required property"),
        (
            _set(("graphs", "prefill", "passes", "fp16", "fp32_ple_tables"), _DELETE),
            "'fp32_ple_tables' is a required property",
        ),
        (_set(("kv_cache", "dtype"), "float32"), "'float16' was expected"),
        (_set(("export", "ple", "tables"), "weights"), "is not valid under any of the given schemas"),
    ],
    ids=["no fp32_nodes", "no fp32_ple_tables", "fp32 kv", "ple tables mode"],
)
def test_broken_fp16_manifest_is_rejected(
    validator: Draft202012Validator, tiny_fp16: Path, change: Callable[[Manifest], None], message: str
) -> None:
    manifest = copy.deepcopy(_manifest(tiny_fp16))
    change(manifest)
    errors = _errors(validator, manifest)
    assert any(message in e for e in errors), errors
