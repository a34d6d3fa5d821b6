"""GPU tier: build both TensorRT engines of a tiny export and check them against PyTorch.

Skipped with the reason where ``tensorrt`` is not importable (a ``tensorrt`` of type stubs only
counts as not importable) or no CUDA device is visible. Parity is driven as
``kiln.exporter.parity.check_parity`` drives ONNX Runtime: tensor parity of every engine, then
the engines' greedy generation through prefill + decode for batch 1 and a left-padded batch,
scored by PyTorch teacher-forced (there is no engine for model.onnx, so the unified path is not run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.errors import EngineError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.engine import BuildOptions, TrtRunner, build_command
from kiln.exporter.engine.build import build_engine, load_tensorrt
from kiln.exporter.engine.device import current_runtime
from kiln.exporter.engine.gpus import min_compute_capability
from kiln.exporter.engine.profiles import EngineProfile, InputShape, engine_profiles
from kiln.exporter.engine.records import RuntimeInfo, check_engine_compat
from kiln.exporter.load import prepare_reference
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import generation_parity, make_prompts, tensor_parity
from kiln.exporter.parity.driver import parity_plan
from kiln.exporter.pipeline import export
from kiln.exporter.precision import TOLERANCES
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.base import Needs
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners import TorchRunner
from kiln.plugins import load_model
from kiln_testing import tiny_config, write_checkpoint


def _unavailable() -> str | None:
    try:
        trt = load_tensorrt()
    except EngineError as exc:
        return f"tensorrt is not importable: {exc}"
    try:
        current_runtime(trt)
    except Exception as exc:  # no libcudart, no driver or no device
        return f"no CUDA device: {exc}"
    return None


REASON = _unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

PRECISIONS = ["fp32", "fp16", "int8+fp16", "int4+fp16", "fp8"]
MAX_BATCH = 4
TOKENS = 8


def _export_options(precision: str) -> ExportOptions:
    """fp32, or the precision variant where the exporter has one (and a parity tolerance for it)."""
    if precision == "fp32":
        return ExportOptions.from_flags(parity_tokens=TOKENS, max_batch=MAX_BATCH)
    if precision not in TOLERANCES:
        pytest.skip(f"kiln writes no {precision} graphs")
    value = Precision.parse(precision)
    variant: dict[str, Any] = {"precision": value}
    if value.needs(
        Needs.RANGES
    ):  # the tiny model has no tokenizer and no text: random tokens (ranges are poor, parity is loose)
        variant["calib_data"] = "synthetic"
    if "int4" in value:  # GPTQ's numbers are tested on the CPU; the engine sees int4 either way
        variant["precision"] = Precision.of(
            *(Int4(method=Int4Method.RTN) if k.name == "int4" else k for k in value.kinds)
        )
    need = min_compute_capability(precision)
    if need is not None:
        runtime = current_runtime(load_tensorrt())
        major, minor = (int(p) for p in runtime.compute_capability.split("."))
        if (major, minor) < need[:2]:
            pytest.skip(
                f"{precision} engines need compute capability {need[0]}.{need[1]}; this {runtime.gpu} is "
                f"{runtime.compute_capability}"
            )
    return ExportOptions.from_flags(parity_tokens=TOKENS, max_batch=MAX_BATCH, **variant)


@pytest.fixture(scope="module", params=PRECISIONS)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    precision: str = request.param
    options = _export_options(precision)
    root = tmp_path_factory.mktemp(f"engines-{precision}")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    directory = export(ckpt, root / "export", options).out
    summary = build_command(directory, BuildOptions(workspace=1 << 30, opt_batch=2))
    return {"precision": precision, "ckpt": ckpt, "dir": directory, "options": options, "summary": summary}


def test_engines_and_records(built: dict[str, Any]) -> None:
    import tensorrt as trt

    directory: Path = built["dir"]
    here = current_runtime(trt)
    record = json.loads((directory / "engines" / "engines.json").read_text())
    manifest = json.loads((directory / "manifest.json").read_text())
    profiles = {p.kind.value: p for p in engine_profiles(Manifest.from_json(manifest), BuildOptions(opt_batch=2))}
    for kind in ("prefill", "decode"):
        entry = record["engines"][kind]
        assert (directory / entry["file"]).is_file() and entry["file"] == f"engines/{kind}.plan"
        assert entry["tensorrt"] == trt.__version__ and entry["compute_capability"] == here.compute_capability
        assert entry["gpu"] == here.gpu and entry["strongly_typed"] is True and entry["tf32"] is False
        assert entry["profiles"] == [profiles[kind].shapes()]
        check_engine_compat(entry, here)
        with pytest.raises(EngineError, match="needs a GPU of that compute capability"):
            check_engine_compat(entry, dataclasses.replace(here, compute_capability="1.0"))
    assert (directory / "engines" / "trtexec.sh").is_file()
    assert manifest["engines"]["compute_capability"] == here.compute_capability
    assert verify_dir(directory).ok, verify_dir(directory).problems()


def test_tensor_and_generation_parity(built: dict[str, Any]) -> None:
    options: ExportOptions = built["options"]
    loaded = load_model(str(built["ckpt"]))
    spec = loaded.spec
    reference = prepare_reference(loaded, options)
    tolerance = TOLERANCES[built["precision"]]
    torch_runner = TorchRunner(reference, spec.n_layers, options.last_logits_only)
    manifest = json.loads((built["dir"] / "manifest.json").read_text())
    limits, kv_dtype = manifest["limits"], np.dtype(manifest["kv_cache"]["dtype"])
    single, padded, steps = parity_plan(limits["max_context"], limits["max_batch"], TOKENS)
    with TrtRunner.from_directory(built["dir"]) as trt_runner:
        assert trt_runner.graphs() == (GraphKind.PREFILL, GraphKind.DECODE)
        checks = tensor_parity(torch_runner, trt_runner, spec, tolerance, kv_dtype=kv_dtype)
        assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]
        for seed, lengths in enumerate((single, padded)):
            prompts = make_prompts(spec, lengths, seed)
            # the engines generate; PyTorch scores their tokens (its prefill returning every position's logits)
            scorer = TorchRunner(reference, spec.n_layers)
            result = generation_parity(
                scorer, trt_runner, spec, prompts, steps, tolerance, unified=False, kv_dtype=kv_dtype
            )
            assert result.passed, result


def test_runner_outside_with_block(built: dict[str, Any]) -> None:
    runner = TrtRunner.from_directory(built["dir"])
    with pytest.raises(EngineError, match="inside a with block"):
        runner.run(GraphKind.PREFILL, {})


def test_parser_error_names_the_node(tmp_path: Path) -> None:
    import onnx
    import tensorrt as trt
    from onnx import TensorProto, helper

    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery_node")
    graph = helper.make_graph(
        [node],
        "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), tmp_path / "bad.onnx")
    profile = EngineProfile(
        GraphKind.PREFILL, "bad.onnx", "engines/bad.plan", (InputShape("x", "float32", (1, 4), (1, 4), (1, 4)),)
    )
    here: RuntimeInfo = current_runtime(trt)
    with pytest.raises(EngineError) as info:
        build_engine(tmp_path, profile, BuildOptions(), here)
    message = str(info.value)
    assert "bad.onnx: TensorRT's ONNX parser failed: node 'mystery_node' (NoSuchOp):" in message
    assert "\n" not in message


# --- engines of the --target onnx graphs (TensorRT 10.15+: Attention, RotaryEmbedding, RMSNormalization, TensorScatter
# in place)


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def built_std(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kiln.exporter.engine import GraphSet, compat
    from kiln.exporter.engine.graphs import ONNX_MIN_VERSION

    trt = load_tensorrt()
    if compat.trt_version(trt)[:2] < ONNX_MIN_VERSION:
        pytest.skip(
            f"the --target onnx engines need TensorRT 10.15 or newer; this is {trt.__version__} (kiln build "
            "--graphs auto builds the portable ones here)"
        )
    options = dataclasses.replace(_export_options(request.param), target="onnx")
    root = tmp_path_factory.mktemp(f"std-engines-{request.param}")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    directory = export(ckpt, root / "export", options).out
    summary = build_command(directory, BuildOptions(workspace=1 << 30, opt_batch=2, graphs=GraphSet.ONNX))
    return {"dir": directory, "summary": summary, "precision": request.param}


def test_std_engines_are_recorded_and_write_in_place(built_std: dict[str, Any]) -> None:
    import tensorrt as trt

    from kiln.exporter.engine import StaticTrtRunner, open_engines
    from kiln.exporter.engine.build import check_in_place

    directory: Path = built_std["dir"]
    record = json.loads((directory / "engines" / "engines.json").read_text())
    assert (
        record["graphs"]["set"] == "onnx"
        and json.loads((directory / "manifest.json").read_text())["engines"]["graphs"] == "onnx"
    )
    for kind in ("prefill", "decode"):
        entry = record["engines"][kind]
        assert (entry["file"], entry["onnx"], entry["graphs"]) == (
            f"engines/{kind}.std.plan",
            f"onnx/{kind}.std.onnx",
            "onnx",
        )
        engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
            (directory / entry["file"]).read_bytes()
        )
        aliases = check_in_place(
            trt, engine, entry["file"]
        )  # every present.* aliases its past_key_values.* (IKVCacheUpdateLayer)
        assert set(aliases) == {
            n for n in (engine.get_tensor_name(i) for i in range(engine.num_io_tensors)) if n.startswith("present.")
        }
        shapes = engine.get_tensor_profile_shape("past_key_values.0.key", 0)
        assert len({tuple(s)[1:] for s in shapes}) == 1  # the cache's dims but batch are fixed: static max_context
    assert not (directory / "engines" / "prefill.plan").exists() and verify_dir(directory).ok
    assert isinstance(open_engines(directory), StaticTrtRunner)


def test_std_engine_parity(built_std: dict[str, Any]) -> None:
    """kiln check --backend tensorrt on the std engines: tensors and greedy tokens (batch 1 and a
    left-padded batch) against PyTorch, through StaticTrtRunner (one buffer as past and present)."""
    from kiln.exporter.check import check_dir

    result = check_dir(built_std["dir"], backend="tensorrt")
    assert result.passed, result.failures()
