"""The typed manifest: ``Manifest.from_json``'s errors name the key path, ``to_json`` leaves out
the keys only some exports have, and options -> manifest -> options round-trips."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import ArtifactError, ConfigError
from kiln.exporter.artifacts import manifest as manifest_module
from kiln.exporter.artifacts.manifest import (
    MANIFEST,
    CheckpointRef,
    EnginesEntry,
    GraphEntry,
    KvCacheInfo,
    Limits,
    Manifest,
    ModelInfo,
    ParityInfo,
    PleInfo,
    TargetEntry,
    TargetGraph,
    TargetWeights,
    WeightsInfo,
    export_settings,
    graph_options,
)
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind, graph_io
from kiln.exporter.options import FLAGS, ExportOptions, LogitsMode, PLEExtendMode, PLETables, Precision
from kiln.exporter.precision.kinds import Fp16
from kiln.plugins.native import spec_of
from kiln_testing import tiny_config, typed_manifest

SPEC = spec_of(tiny_config())
TRAINED_ROWS = 48


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def manifest_for(
    options: ExportOptions, *, max_context: int = 48, trained_rows: int | None = TRAINED_ROWS, **extra: Any
) -> Manifest:
    """The manifest an export with ``options`` writes (as ``artifacts.build`` fills it)."""
    precision = options.precision
    tables = ((options.ple.extend or TRAINED_ROWS, 32),) * 2 if options.ple.tables is PLETables.INPUT else ()
    graphs = {
        kind.value: GraphEntry.of(
            f"onnx/{kind.value}.onnx",
            graph_io(
                SPEC,
                kind,
                last_logits_only=options.graphs.last_logits_only,
                kv_dtype=precision.kv_dtype,
                ple_tables=tables,
            ),
            {
                **(
                    {"fp16": {"fp32_nodes": ["/layers.0.attn/Softmax"], "fp32_ple_tables": []}}
                    if "fp16" in precision
                    else {}
                ),
                **({"int8": {"nodes": ["/layers.0.mlp.fc1/MatMul"]}} if "int8" in precision else {}),
            },
        )
        for kind in DECODER_KINDS
    }
    return Manifest(
        manifest_version=manifest_module.MANIFEST_VERSION,
        family="native",
        checkpoint=CheckpointRef("demo", {"model.safetensors": "0" * 64}),
        config={"d_model": 32, "ple": {"max_positions": 48}},
        model=ModelInfo(SPEC.n_layers, SPEC.n_kv_heads, SPEC.head_dim, SPEC.vocab_size, 1, 2, None, None),
        precision=precision.value,
        kv_cache=KvCacheInfo("BNSH", ("batch", "n_kv_heads", "seq", "head_dim"), precision.kv_dtype),
        limits=Limits(options.graphs.max_batch, options.graphs.max_context or max_context),
        export=export_settings(
            options,
            trained_rows=trained_rows,
            keep_fp32=("Softmax", "/layers.0.mlp/") if "fp16" in precision else (),
            calibration=None,
        ),
        graphs=graphs,
        weights=WeightsInfo("onnx/weights.bin", 12, 34567),
        tokenizer="onnx/tokenizer.json",
        parity=ParityInfo(True, "reports/parity.json"),
        tools={"kiln": "0.1.0"},
        files={"onnx/weights.bin": "1" * 64},
        **extra,
    )


def through_json(manifest: Manifest) -> Manifest:
    """What a reader gets back from the file."""
    return Manifest.from_json(json.loads(json.dumps(manifest.to_json())))


GRAPH_FIELDS = ("max_batch", "max_context", "logits", "opset", "ple_extend", "ple_extend_mode", "ple_tables")


def graph_fields(options: ExportOptions) -> dict[str, Any]:
    """The graph-shaping options by flag, each read from its group (``option_groups.FLAGS``)."""
    return {f: getattr(getattr(options, FLAGS[f][0]), FLAGS[f][1]) for f in GRAPH_FIELDS}


OPTIONS = [
    ExportOptions.from_flags(max_context=48),
    ExportOptions.from_flags(max_batch=1, max_context=2),
    ExportOptions.from_flags(max_batch=4, max_context=40, logits=LogitsMode.LAST),
    ExportOptions.from_flags(max_context=96, ple_extend=96, ple_extend_mode=PLEExtendMode.INTERPOLATE),
    ExportOptions.from_flags(
        max_context=64, ple_extend=64, ple_extend_mode=PLEExtendMode.CLAMP, ple_tables=PLETables.INPUT
    ),
    ExportOptions.from_flags(max_context=48, ple_tables=PLETables.INPUT, opset=23),
    ExportOptions.from_flags(
        max_context=48, opset=18, logits=LogitsMode.LAST, precision=Precision.of(Fp16(keep_fp32=("/layers.0.mlp/",)))
    ),
    ExportOptions.from_flags(max_context=48, precision=Precision.INT8_FP16, calib_data="synthetic", opset=21),
]


@pytest.mark.parametrize("options", OPTIONS, ids=[f"options{i}" for i in range(len(OPTIONS))])
def test_options_manifest_options_round_trip(options: ExportOptions) -> None:
    manifest = manifest_for(options)
    back = through_json(manifest)
    assert back == manifest
    assert graph_fields(graph_options(back)) == graph_fields(options)
    assert (
        graph_options(back).precision is Precision.FP32
    )  # the graphs carry their precision: not an option of the re-run
    assert manifest_module.precision_of(back) is Precision.parse(
        options.precision.value
    )  # the name; a kind's options are recorded apart (export.keep_fp32...)


def test_round_trip_resolves_the_default_context() -> None:
    """``--max-context`` left out: the manifest records the limit the export used."""
    options = ExportOptions()
    back = graph_options(through_json(manifest_for(options, max_context=48)))
    assert back.graphs.max_context == 48 and graph_fields(back) == {**graph_fields(options), "max_context": 48}


def test_ple_extend_mode_only_with_an_extension() -> None:
    """Without --ple-extend the mode shaped nothing: the manifest records none and reads back the default."""
    settings = export_settings(
        ExportOptions.from_flags(ple_extend_mode=PLEExtendMode.INTERPOLATE),
        trained_rows=48,
        keep_fp32=(),
        calibration=None,
    )
    assert settings.ple == PleInfo(folded=True, trained_rows=48, rows=48, extend_mode=None, tables="constant")
    assert (
        graph_options(
            through_json(
                manifest_for(ExportOptions.from_flags(max_context=48, ple_extend_mode=PLEExtendMode.INTERPOLATE))
            )
        ).ple.extend_mode
        is PLEExtendMode.CLAMP
    )
    extended = export_settings(
        ExportOptions.from_flags(ple_extend=96, ple_extend_mode=PLEExtendMode.INTERPOLATE, ple_tables=PLETables.INPUT),
        trained_rows=48,
        keep_fp32=(),
        calibration=None,
    )
    assert extended.ple == PleInfo(True, 48, 96, "interpolate", "input")
    assert (
        export_settings(ExportOptions(), trained_rows=None, keep_fp32=(), calibration=None).ple is None
    )  # a family without PLE
    assert graph_fields(
        graph_options(through_json(manifest_for(ExportOptions.from_flags(max_context=48), trained_rows=None)))
    ) == graph_fields(ExportOptions.from_flags(max_context=48))


def test_keep_fp32_recorded_only_for_fp16() -> None:
    rules = ("Softmax",)
    assert (
        export_settings(
            ExportOptions(precision=Precision.of(Fp16(keep_fp32=rules))),
            trained_rows=None,
            keep_fp32=rules,
            calibration=None,
        ).keep_fp32
        == rules
    )
    assert export_settings(ExportOptions(), trained_rows=None, keep_fp32=rules, calibration=None).keep_fp32 == ()


# ---------------------------------------------------------------- to_json


def test_to_json_omits_the_keys_only_some_exports_have() -> None:
    data = manifest_for(ExportOptions.from_flags(max_context=48)).to_json()
    assert "targets" not in data and "engines" not in data and "lora" not in data
    assert "text_decoder_of" not in data["model"]  # a multimodal checkpoint's text decoder only
    for graph in data["graphs"].values():
        assert graph.keys() == {"file", "inputs", "outputs"}
    # keys every manifest has stay, even when null
    assert data["model"]["pad_token_id"] is None and data["export"]["calibration"] is None
    assert "tokenizer" in data and data["export"]["ple"] == {
        "folded": True,
        "trained_rows": 48,
        "rows": 48,
        "extend_mode": None,
        "tables": "constant",
    }
    assert data["graphs"]["decode"]["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["batch", 1]}
    assert list(data) == [f.name for f in dataclasses.fields(Manifest) if f.name not in ("targets", "engines", "lora")]
    json.dumps(data)  # plain JSON: lists, not tuples or records


def test_to_json_writes_the_optional_keys_when_set() -> None:
    passes = {
        "attention": {"layers": [0, 1]},
        "pack": {"matmuls": ["/layers.0.attn/ort/packed/MatMul"]},
        "nbits_int8": {"nodes": ["/layers.0.mlp.fc1/MatMulNBits"]},
    }
    ort = TargetEntry(
        "int8",
        "shared",
        {"decode": TargetGraph("onnx/decode.ort.onnx", passes)},
        TargetWeights("onnx/weights.ort.bin", 100),
        {"int8": {"op": "MatMulNBits", "bits": 8}},
    )
    engines = EnginesEntry(
        "engines/record.json", "10.13.0", None, "NVIDIA H200", "9.0", {"engines/decode.plan": "2" * 64}
    )
    manifest = manifest_for(
        ExportOptions.from_flags(max_context=48, precision=Precision.INT8_FP16, calib_data="synthetic"),
        targets={"ort": ort},
        engines=engines,
    )
    data = manifest.to_json()
    assert data["targets"]["ort"]["graphs"]["decode"]["passes"]["attention"]["layers"] == [0, 1]
    assert data["engines"]["cuda"] is None and data["engines"]["gpu"] == "NVIDIA H200"
    assert data["graphs"]["prefill"]["passes"]["fp16"]["fp32_nodes"] == ["/layers.0.attn/Softmax"]
    assert data["graphs"]["prefill"]["passes"]["int8"]["nodes"] == ["/layers.0.mlp.fc1/MatMul"]
    assert "fp8" not in data["graphs"]["prefill"]["passes"]
    back = through_json(manifest)
    assert (
        back == manifest
        and back.targets is not None
        and back.targets["ort"].graphs["decode"].report("pack")["matmuls"] == ["/layers.0.attn/ort/packed/MatMul"]
    )


def test_typed_manifest_helper_round_trips() -> None:
    manifest = typed_manifest(
        {
            "graphs": {
                "decode": {
                    "file": "onnx/decode.onnx",
                    "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 1]}],
                }
            }
        }
    )
    assert manifest.graph(GraphKind.DECODE).input_names == ["input_ids"]
    assert through_json(manifest) == manifest


# ---------------------------------------------------------------- from_json errors


def base_json() -> dict[str, Any]:
    return manifest_for(ExportOptions.from_flags(max_context=48, precision=Precision.FP16)).to_json()


def edited(path: str, value: Any = ..., *, delete: bool = False) -> dict[str, Any]:
    """``base_json()`` with the value at ``path`` (dots, [i] for list items) replaced or deleted."""
    data = copy.deepcopy(base_json())
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    node: Any = data
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    last = parts[-1]
    key: Any = int(last[1:-1]) if last.startswith("[") else last
    if delete:
        del node[key]
    else:
        node[key] = value
    return data


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("limits", "manifest.json: missing key 'limits'"),
        ("limits.max_context", "manifest.json.limits: missing key 'max_context'"),
        ("export.ple.tables", "manifest.json.export.ple: missing key 'tables'"),
        ("graphs.prefill.outputs[2].dtype", "manifest.json.graphs.prefill.outputs[2]: missing key 'dtype'"),
        ("model.encoder_dim", "manifest.json.model: missing key 'encoder_dim'"),  # nullable, but required
        ("tokenizer", "manifest.json: missing key 'tokenizer'"),
    ],
)
def test_from_json_names_a_missing_key(path: str, message: str) -> None:
    with pytest.raises(ArtifactError, match=exact(f"artifacts: {message}")):
        Manifest.from_json(edited(path, delete=True))


def test_from_json_optional_keys_may_be_missing() -> None:
    data = edited("graphs.decode.passes", delete=True)
    manifest = Manifest.from_json(data)
    assert manifest.graphs["decode"].passes is None and manifest.targets is None and manifest.engines is None


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("limits.max_batch", "8", "manifest.json.limits.max_batch: expected int, found '8'"),
        ("limits.max_batch", True, "manifest.json.limits.max_batch: expected int, found True"),
        ("limits.max_context", 48.0, "manifest.json.limits.max_context: expected int, found 48.0"),
        ("graphs", [], "manifest.json.graphs: expected an object, found list"),
        ("graphs.decode.inputs", {}, "manifest.json.graphs.decode.inputs: expected a list, found dict"),
        (
            "graphs.decode.inputs[1].shape[0]",
            None,
            "manifest.json.graphs.decode.inputs[1].shape[0]: expected str, found None",
        ),
        ("tokenizer", 5, "manifest.json.tokenizer: expected str, found 5"),
        ("export.ple", "constant", "manifest.json.export.ple: expected an object, found str"),
        ("engines", [1], "manifest.json.engines: expected an object, found list"),
        ("parity.passed", "yes", "manifest.json.parity.passed: expected bool, found 'yes'"),
        ("files.onnx/weights.bin", 7, "manifest.json.files.onnx/weights.bin: expected str, found 7"),
        ("kv_cache.dims[1]", 2, "manifest.json.kv_cache.dims[1]: expected str, found 2"),
    ],
)
def test_from_json_names_a_wrong_type(path: str, value: Any, message: str) -> None:
    data = edited(path, value) if "/" not in path else {**base_json(), "files": {"onnx/weights.bin": value}}
    with pytest.raises(ArtifactError, match=exact(f"artifacts: {message}")):
        Manifest.from_json(data)


def test_from_json_where_names_the_file() -> None:
    with pytest.raises(ArtifactError, match=exact("artifacts: build/m/manifest.json.limits: missing key 'max_batch'")):
        Manifest.from_json(edited("limits.max_batch", delete=True), "build/m/manifest.json")
    with pytest.raises(ArtifactError, match=exact("artifacts: manifest.json: expected an object, found list")):
        Manifest.from_json([])


# ---------------------------------------------------------------- the file


def test_write_and_read(tmp_path: Path) -> None:
    manifest = manifest_for(ExportOptions.from_flags(max_context=48, logits=LogitsMode.LAST))
    path = manifest_module.write(tmp_path, manifest)
    assert path == tmp_path / MANIFEST and path.read_text().endswith("}\n")
    assert manifest_module.read(tmp_path) == manifest
    data = json.loads(path.read_text())
    data["manifest_version"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(
        ArtifactError,
        match=exact(
            f"artifacts: {path}: manifest_version 3 is not supported (this kiln reads versions 1 and 2); "
            "re-export with this kiln"
        ),
    ):
        manifest_module.read(tmp_path)
    data["manifest_version"] = 2
    del data["weights"]["bytes"]
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=exact(f"artifacts: {path}.weights: missing key 'bytes'")):
        manifest_module.read(tmp_path)
    with pytest.raises(ArtifactError, match=exact(f"artifacts: {tmp_path / 'nope'}: not a directory")):
        manifest_module.read(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ArtifactError,
        match=exact(f"artifacts: {tmp_path / 'empty'}: no manifest.json; is this a kiln export directory?"),
    ):
        manifest_module.read(tmp_path / "empty")


def test_options_that_cannot_be_recorded_are_refused_first() -> None:
    """The round trip starts from valid options only: invalid ones never reach a manifest."""
    with pytest.raises(ConfigError, match=exact("config: --opset must be between 18 and 23, found 17")):
        ExportOptions.from_flags(opset=17)
