"""``write_triton_repo``: configs that Triton's own schema parses and that match the ONNX graphs.

Every ``config.pbtxt`` is parsed with ``tritonclient``'s ``model_config_pb2`` (Triton's
``model_config.proto``): unknown fields and oneof conflicts are rejected there. Each input,
output and state is then checked against the graph's own I/O (name, data type, dims without the
batch dim). No Triton server runs here; the implicit-state loop the server would drive is replayed
with ONNX Runtime on the repository's copy of ``model.onnx`` (zero-length initial state included)
and compared with PyTorch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from kiln_testing import tiny_config, write_checkpoint

model_config_pb2 = pytest.importorskip(
    "tritonclient.grpc.model_config_pb2", reason='tritonclient is a test dependency (pip install "tritonclient[grpc]")'
)
from click.testing import CliRunner  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from kiln.cli import main  # noqa: E402
from kiln.errors import ArtifactError  # noqa: E402
from kiln.exporter.artifacts import manifest as manifest_mod  # noqa: E402
from kiln.exporter.artifacts.hashing import hash_tree  # noqa: E402
from kiln.exporter.artifacts.manifest import Manifest  # noqa: E402
from kiln.exporter.artifacts.verify import verify_dir  # noqa: E402
from kiln.exporter.options import ExportOptions, LogitsMode, Precision  # noqa: E402
from kiln.exporter.parity import greedy, left_pad, make_prompts  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.exporter.runners import TorchRunner  # noqa: E402
from kiln.exporter.serving import write_triton_repo  # noqa: E402
from kiln.exporter.serving.triton import triton_models  # noqa: E402
from kiln.plugins import load_model  # noqa: E402

ONNX_TO_TRITON = {
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
}


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model exported with --triton demo (kiln triton then replaces that repository)."""
    out = tmp_path_factory.mktemp("triton32") / "out"
    export("demo", out, ExportOptions.from_flags(parity_tokens=8, triton="demo"))
    return out


@pytest.fixture(scope="module")
def fp16_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model (faster to export than the demo): fp16, --logits last, --max-batch 4."""
    root = tmp_path_factory.mktemp("triton16")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    export(
        ckpt,
        root / "out",
        ExportOptions.from_flags(precision=Precision.FP16, logits=LogitsMode.LAST, max_batch=4, parity_tokens=4),
    )
    return root / "out"


def _copy(export_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "export"
    shutil.copytree(export_dir, target)
    return target


def _parse(path: Path) -> Any:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _dtype(value: int) -> str:
    return model_config_pb2.DataType.Name(value)


def _graph_io(path: Path) -> tuple[dict[str, tuple[str, list[int | str]]], dict[str, tuple[str, list[int | str]]]]:
    graph = onnx.load(str(path), load_external_data=False).graph

    def io(values: Any) -> dict[str, tuple[str, list[int | str]]]:
        return {
            v.name: (
                ONNX_TO_TRITON[v.type.tensor_type.elem_type],
                [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
            )
            for v in values
        }

    return io(graph.input), io(graph.output)


def _debatched(dims: list[int | str]) -> list[int]:
    assert dims[0] == "batch"
    return [d if isinstance(d, int) else -1 for d in dims[1:]]


def _check_against_graph(config: Any, graph_path: Path) -> None:
    """Every config tensor is a graph tensor with its dtype and dims; the graph has no other inputs."""
    inputs, outputs = _graph_io(graph_path)
    seen_inputs, seen_outputs = set(), set()
    for tensor in config.input:
        dtype, dims = inputs[tensor.name]
        assert (_dtype(tensor.data_type), list(tensor.dims)) == (dtype, _debatched(dims)), tensor.name
        seen_inputs.add(tensor.name)
    for tensor in config.output:
        dtype, dims = outputs[tensor.name]
        assert (_dtype(tensor.data_type), list(tensor.dims)) == (dtype, _debatched(dims)), tensor.name
        seen_outputs.add(tensor.name)
    for state in config.sequence_batching.state:
        assert state.output_name == state.input_name.replace(
            "past_key_values.", "present.", 1
        )  # same layer, key to key
        in_dtype, in_dims = inputs[state.input_name]
        out_dtype, out_dims = outputs[state.output_name]
        assert _dtype(state.data_type) == in_dtype == out_dtype
        assert list(state.dims) == _debatched(in_dims) == _debatched(out_dims)
        assert in_dims[2] == "past_seq" and out_dims[2] == "total_seq"
        (initial,) = state.initial_state
        assert initial.WhichOneof("state_data") == "zero_data" and initial.zero_data
        assert _dtype(initial.data_type) == in_dtype
        assert list(initial.dims) == [in_dims[1], 0, in_dims[3]]  # past length 0
        seen_inputs.add(state.input_name)
        seen_outputs.add(state.output_name)
    assert seen_inputs == set(inputs)  # the ONNX Runtime backend counts them: config inputs + states == graph inputs
    assert seen_outputs <= set(outputs)


def _replay_implicit_state(config: Any, graph_path: Path, prompt: list[int], steps: int) -> list[int]:
    """What Triton does for one sequence, with ONNX Runtime: zero initial state, then each
    request's state outputs become the next request's state inputs, by the config's mapping."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph_path), providers=["CPUExecutionProvider"])
    np_types = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16}
    state = {
        s.input_name: np.zeros([1, *s.initial_state[0].dims], dtype=np_types[_dtype(s.initial_state[0].data_type)])
        for s in config.sequence_batching.state
    }
    ids, mask, pos = left_pad([prompt], pad_id=1)
    tokens: list[int] = []
    for _ in range(steps):
        outputs = session.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": pos, **state})
        named = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
        token = int(named["logits"][0, -1].argmax())
        tokens.append(token)
        state = {s.input_name: named[s.output_name] for s in config.sequence_batching.state}
        ids = np.array([[token]], dtype=np.int64)
        pos = pos[:, -1:] + 1
        mask = np.ones((1, mask.shape[1] + 1), dtype=np.int64)
    return tokens


def test_onnxruntime_model_fp32(fp32_export: Path, tmp_path: Path) -> None:
    directory = _copy(fp32_export, tmp_path)
    written = write_triton_repo(directory, "demo")
    repo = directory / "triton"
    assert {p.relative_to(repo).as_posix() for p in written} == {
        "README.md",
        "demo/config.pbtxt",
        "demo/1/model.onnx/model.onnx",
        "demo/1/model.onnx/weights.bin",
    }
    config = _parse(repo / "demo" / "config.pbtxt")
    assert (config.name, config.platform, config.max_batch_size) == ("demo", "onnxruntime_onnx", 8)
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"
    assert [t.name for t in config.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [(t.name, _dtype(t.data_type), list(t.dims)) for t in config.output] == [("logits", "TYPE_FP32", [-1, 1024])]
    states = config.sequence_batching.state
    assert [(s.input_name, s.output_name) for s in states] == [
        (f"past_key_values.{i}.{kv}", f"present.{i}.{kv}") for i in range(4) for kv in ("key", "value")
    ]
    assert all(_dtype(s.data_type) == "TYPE_FP32" and list(s.dims) == [2, -1, 32] for s in states)
    assert not config.sequence_batching.control_input  # a control input must name a graph input; there is none
    assert len(config.instance_group) == 1 and config.instance_group[0].count == 1
    graph = repo / "demo" / "1" / "model.onnx" / "model.onnx"
    _check_against_graph(config, graph)
    # the backend finds the external weights beside the graph: the same bytes, not a hard link
    copy = repo / "demo" / "1" / "model.onnx" / "weights.bin"
    assert copy.read_bytes() == (directory / "onnx" / "weights.bin").read_bytes()
    assert os.stat(copy).st_nlink == 1 and os.stat(directory / "onnx" / "weights.bin").st_nlink == 1
    loaded = load_model("demo")
    prompt = make_prompts(loaded.spec, [6], seed=5)[0]
    ref, _ = greedy(TorchRunner(loaded.module, loaded.spec.n_layers), loaded.spec, [prompt], 8)
    assert _replay_implicit_state(config, graph, prompt, 8) == ref[0].tolist()
    # the manifest lists the new files, so kiln verify still passes
    result = verify_dir(directory)
    assert result.ok, result.problems()
    files = json.loads((directory / "manifest.json").read_text())["files"]
    assert {"triton/README.md", "triton/demo/config.pbtxt", "triton/demo/1/model.onnx/weights.bin"} <= set(files)
    readme = (repo / "README.md").read_text()
    for name in [
        "input_ids",
        "attention_mask",
        "position_ids",
        "logits",
        "past_key_values.3.value",
        "present.3.value",
        "sequence_start",
    ]:
        assert f"`{name}" in readme, name
    assert "unverified" in readme.lower()


def _graphs(directory: Path) -> list[Path]:
    manifest = manifest_mod.read(directory)
    files = [g.file for g in manifest.graphs.values()] + [
        g.file for t in (manifest.targets or {}).values() for g in t.graphs.values()
    ]
    return [directory / f for f in files] + sorted((directory / "triton").glob("*/1/model.onnx/model.onnx"))


def test_onnx_loads_every_graph_after_triton(fp32_export: Path, tmp_path: Path) -> None:
    """onnx (1.23+) refuses external data whose file has several hard links: after export --triton
    and after kiln triton, every graph of the export and the repository's copy load with their weights."""
    directory = _copy(fp32_export, tmp_path)
    for stage in ("export --triton", "kiln triton"):
        graphs = _graphs(directory)
        assert len(graphs) == 4, stage  # prefill, decode, model and the repository's model.onnx
        for graph in graphs:
            proto = onnx.load(str(graph), load_external_data=True)
            assert (
                sum(
                    init.data_location == onnx.TensorProto.DEFAULT and len(init.raw_data) > 0
                    for init in proto.graph.initializer
                )
                > 0
            ), graph
        weights = {p: os.stat(p).st_nlink for p in directory.rglob("weights.bin")}
        assert len(weights) == 2 and set(weights.values()) == {1}, (stage, weights)
        write_triton_repo(directory, "demo")
    assert verify_dir(directory).ok


def test_triton_replaces_only_a_repository_kiln_wrote(fp32_export: Path, tmp_path: Path) -> None:
    """kiln triton rewrites triton/ when the manifest lists every file in it; a file kiln did not
    write there (or a folder of them) is named in one line and nothing is deleted."""
    directory = _copy(fp32_export, tmp_path)
    (directory / "triton" / "sub").mkdir()
    (directory / "triton" / "notes.txt").write_text("mine")
    (directory / "triton" / "sub" / "model.txt").write_text("also mine")
    before = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))
    with pytest.raises(ArtifactError) as err:
        write_triton_repo(directory, "other")
    assert str(err.value) == (
        f"artifacts: {directory / 'triton'}: kiln triton replaces only a triton/ folder kiln wrote, and "
        "manifest.json does not list"
        " triton/notes.txt, triton/sub/model.txt; nothing was deleted: move or remove it yourself"
    )
    assert sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")) == before
    (directory / "triton" / "notes.txt").unlink()
    shutil.rmtree(directory / "triton" / "sub")
    write_triton_repo(directory, "other")  # only kiln's files again: replaced
    assert sorted(p.name for p in (directory / "triton").iterdir()) == ["README.md", "other"]


def test_onnxruntime_model_fp16_states_and_rewrite(fp16_export: Path, tmp_path: Path) -> None:
    directory = _copy(fp16_export, tmp_path)
    write_triton_repo(directory, "first")
    write_triton_repo(directory, "demo16")  # replaces the whole repository
    repo = directory / "triton"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "demo16"]
    assert not [p for p in directory.iterdir() if p.name.startswith(".triton")]  # no temp folders left
    config = _parse(repo / "demo16" / "config.pbtxt")
    assert config.max_batch_size == 4
    assert {_dtype(s.data_type) for s in config.sequence_batching.state} == {"TYPE_FP16"}
    assert [(t.name, _dtype(t.data_type)) for t in config.output] == [("logits", "TYPE_FP32")]
    _check_against_graph(config, repo / "demo16" / "1" / "model.onnx" / "model.onnx")
    assert verify_dir(directory).ok
    assert not any(k.startswith("triton/first") for k in json.loads((directory / "manifest.json").read_text())["files"])


def test_tensorrt_models_from_placeholder_engines(fp16_export: Path, tmp_path: Path) -> None:
    """There is no TensorRT here: ``engines/*.plan`` are placeholder bytes, written into a copy of an
    export with matching manifest entries, only to test the config generation."""
    directory = _copy(fp16_export, tmp_path)
    (directory / "engines").mkdir()
    for kind in ("prefill", "decode"):
        (directory / "engines" / f"{kind}.plan").write_bytes(f"placeholder {kind} engine".encode())
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = hash_tree(directory, exclude=(manifest_mod.MANIFEST,))
    manifest_mod.write(directory, Manifest.from_json(manifest))

    write_triton_repo(directory, "demo")
    repo = directory / "triton"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "demo", "demo_decode", "demo_prefill"]
    for kind in ("prefill", "decode"):
        config = _parse(repo / f"demo_{kind}" / "config.pbtxt")
        assert (config.name, config.platform, config.max_batch_size) == (f"demo_{kind}", "tensorrt_plan", 4)
        assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
        (group,) = config.instance_group
        assert (model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind), group.count, list(group.profile)) == (
            "KIND_GPU",
            1,
            ["0"],
        )
        graph = manifest["graphs"][kind]
        assert [t.name for t in config.input] == [t["name"] for t in graph["inputs"]]
        assert [t.name for t in config.output] == [t["name"] for t in graph["outputs"]]
        _check_against_graph(config, directory / graph["file"])
        assert (repo / f"demo_{kind}" / "1" / "model.plan").read_bytes() == f"placeholder {kind} engine".encode()
    model = manifest["model"]
    kv, head_dim = model["n_kv_heads"], model["head_dim"]
    prefill = _parse(repo / "demo_prefill" / "config.pbtxt")
    assert list(prefill.output[0].dims) == [1, model["vocab_size"]]  # --logits last
    assert {(_dtype(t.data_type), tuple(t.dims)) for t in prefill.output[1:]} == {("TYPE_FP16", (kv, -1, head_dim))}
    decode = _parse(repo / "demo_decode" / "config.pbtxt")
    assert [list(t.dims) for t in decode.input[:3]] == [[1], [-1], [1]]
    assert {(_dtype(t.data_type), tuple(t.dims)) for t in decode.input[3:]} == {("TYPE_FP16", (kv, -1, head_dim))}
    assert len(decode.input) == 3 + 2 * model["n_layers"]
    readme = (repo / "README.md").read_text()
    assert "`demo_prefill`" in readme and "`demo_decode`" in readme
    assert verify_dir(directory).ok


def test_one_engine_without_the_other_is_an_error(fp32_export: Path, tmp_path: Path) -> None:
    directory = _copy(fp32_export, tmp_path)
    (directory / "engines").mkdir()
    (directory / "engines" / "prefill.plan").write_bytes(b"placeholder")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = hash_tree(directory, exclude=(manifest_mod.MANIFEST,))
    manifest_mod.write(directory, Manifest.from_json(manifest))
    before = hash_tree(directory / "triton")  # the repository export --triton wrote
    with pytest.raises(ArtifactError, match=r"has engines/prefill\.plan but not engines/decode\.plan; run kiln build"):
        write_triton_repo(directory, "other")
    assert hash_tree(directory / "triton") == before


def test_inputs_without_batch_dim_are_refused(fp32_export: Path, tmp_path: Path) -> None:
    """As with --ple-tables input: a table input has no batch dim, which Triton cannot batch.
    (The manifest is edited in memory and given to the model builder itself: kiln verify, which
    kiln triton runs first, refuses a manifest whose inputs are not the graph's.)"""
    directory = _copy(fp32_export, tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["graphs"]["model"]["inputs"].append({"name": "ple.0.scale", "dtype": "float32", "shape": [256, 128]})
    with pytest.raises(
        ArtifactError,
        match=r"ple\.0\.scale has shape \[256, 128\] without a leading 'batch' dim.*--ple-tables constant",
    ):
        triton_models(directory, Manifest.from_json(manifest), "demo")


def test_bad_directories_are_one_clear_error(fp32_export: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArtifactError, match=r"no manifest\.json; is this a kiln export directory\?"):
        write_triton_repo(empty, "demo")

    future = _copy(fp32_export, tmp_path / "future")
    manifest = json.loads((future / "manifest.json").read_text())
    manifest["manifest_version"] = 3
    manifest_mod.write(future, Manifest.from_json(manifest))
    with pytest.raises(
        ArtifactError, match=r"manifest_version 3 is not supported \(this kiln reads versions 1 and 2\)"
    ):
        write_triton_repo(future, "demo")

    tampered = _copy(fp32_export, tmp_path / "tampered")
    with open(tampered / "onnx" / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    before, repo = (tampered / "manifest.json").read_text(), hash_tree(tampered / "triton")
    with pytest.raises(
        ArtifactError,
        match=r"files differ from manifest\.json: changed \(sha256 differs\): onnx/weights\.bin; run kiln verify",
    ):
        write_triton_repo(tampered, "other")
    assert hash_tree(tampered / "triton") == repo and (tampered / "manifest.json").read_text() == before

    with pytest.raises(ArtifactError, match=r"model name '\.\./x' must start with a letter or digit"):
        write_triton_repo(_copy(fp32_export, tmp_path / "name"), "../x")


def test_kiln_triton_says_what_it_replaced_and_why_the_layout(fp32_export: Path, tmp_path: Path) -> None:
    directory = _copy(fp32_export, tmp_path)
    result = CliRunner().invoke(main, ["triton", str(directory), "--name", "other"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"wrote {directory / 'triton'}: 4 files, replacing the earlier repository's demo"
    assert (
        lines[-2]
        == "(other/1/model.onnx/ is a folder: Triton's ONNX Runtime backend loads a graph with external weights "
        "from a directory holding both)"
    )
    weights = (directory / "onnx" / "weights.bin").stat().st_size  # one model: one copy of the weights
    assert (
        lines[-1]
        == f"(its weights are a copy of the export's: {weights / 1e6:.3g} MB more on disk, unless the filesystem "
        "shares their blocks: btrfs, XFS)"
    )
    again = CliRunner().invoke(main, ["triton", str(directory), "--name", "other", "--json"])
    assert json.loads(again.stdout)["replaced_models"] == []  # the same name: nothing else was there
