"""The TensorRT version guards (compat.py) against stand-ins for the 10.x and 11.x modules, the
ONNX parser error messages, and the refusal of engines built elsewhere (records.py).

The stand-ins are ``types.SimpleNamespace`` objects with the names each version binds
(python/src/infer/pyCore.cpp on release/10.13 and main = 11.1) but deliberately odd enum values:
the guards must look names up, never rely on numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kiln.exporter.engine.build as build_mod
from kiln.errors import ArtifactError, EngineError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.hashing import sha256_file
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind, graph_io
from kiln.exporter.engine import BuildOptions, TrtRunner, build_command, compat
from kiln.exporter.engine.build import format_parser_error, load_tensorrt, parser_errors
from kiln.exporter.engine.options import HardwareCompat
from kiln.exporter.engine.records import (
    EngineRecord,
    RuntimeInfo,
    check_engine_compat,
    compat_problems,
    read_records,
    write_records,
)
from kiln.plugins.native import spec_of
from kiln_testing import placeholder_export, tiny_config, with_std_target


def trt10(**extra: Any) -> Any:
    """TensorRT 10.13: EXPLICIT_BATCH and STRONGLY_TYPED flags, weak-typing builder flags, no EngineStat."""
    names: dict[str, Any] = {
        "__version__": "10.13.0.35",
        "Builder": object,
        "NetworkDefinitionCreationFlag": SimpleNamespace(EXPLICIT_BATCH=40, STRONGLY_TYPED=7),
        "BuilderFlag": SimpleNamespace(FP16="FP16", INT8="INT8", REFIT="REFIT", TF32="TF32", VERSION_COMPATIBLE="VC"),
        "HardwareCompatibilityLevel": SimpleNamespace(
            NONE="none", AMPERE_PLUS="ampere", SAME_COMPUTE_CAPABILITY="same"
        ),
    }
    return SimpleNamespace(**{**names, **extra})


def trt11(**extra: Any) -> Any:
    """TensorRT 11.1: STRONGLY_TYPED deprecated and ignored, no EXPLICIT_BATCH, weak-typing flags gone, EngineStat."""
    names: dict[str, Any] = {
        "__version__": "11.1.0.106",
        "Builder": object,
        "NetworkDefinitionCreationFlag": SimpleNamespace(STRONGLY_TYPED=3, PREFER_AOT_PYTHON_PLUGINS=5),
        "BuilderFlag": SimpleNamespace(REFIT="REFIT", TF32="TF32", VERSION_COMPATIBLE="VC"),
        "HardwareCompatibilityLevel": SimpleNamespace(
            NONE="none", AMPERE_PLUS="ampere", SAME_COMPUTE_CAPABILITY="same"
        ),
        "EngineStat": SimpleNamespace(TOTAL_WEIGHTS_SIZE="total", STRIPPED_WEIGHTS_SIZE="stripped"),
    }
    return SimpleNamespace(**{**names, **extra})


def only_version(version: str | None) -> Any:
    return SimpleNamespace(__version__=version)


# --- version guards -------------------------------------------------------------------------


def test_strongly_typed_flag_by_name_on_10() -> None:
    assert compat.network_flags(trt10()) == 1 << 7  # the member's value, whatever it is


def test_no_network_flag_on_11() -> None:
    assert compat.network_flags(trt11()) == 0  # always strongly typed; the flag is deprecated and ignored


def test_10_without_strong_typing_is_refused() -> None:
    old = trt10(NetworkDefinitionCreationFlag=SimpleNamespace(EXPLICIT_BATCH=0))
    with pytest.raises(EngineError, match="no NetworkDefinitionCreationFlag.STRONGLY_TYPED"):
        compat.network_flags(old)


@pytest.mark.parametrize("version", ["10.11.0.33", "9.3.0.1", "8.6.1"])
def test_versions_before_10_12_are_refused(version: str) -> None:
    with pytest.raises(EngineError, match=rf"TensorRT {version} is too old: .* 10.12 or newer"):
        compat.require_supported(only_version(version))


@pytest.mark.parametrize(
    ("version", "parsed"),
    [
        ("10.12.0.36", (10, 12, 0, 36)),
        ("11.1.0.106", (11, 1, 0, 106)),
        ("10.13.0.35.post1", (10, 13, 0, 35)),
        ("11.0.0rc1", (11, 0, 0)),
    ],
)
def test_supported_versions(version: str, parsed: tuple[int, ...]) -> None:
    assert compat.require_supported(only_version(version)) == parsed


def test_unreadable_version() -> None:
    with pytest.raises(EngineError, match="cannot read the TensorRT version"):
        compat.trt_version(only_version(None))


@pytest.mark.parametrize("make", [trt10, trt11])
def test_hardware_levels_by_name(make: Any) -> None:
    trt = make()
    assert compat.hardware_level(trt, HardwareCompat.NONE) == "none"
    assert compat.hardware_level(trt, HardwareCompat.AMPERE_PLUS) == "ampere"
    assert compat.hardware_level(trt, HardwareCompat.SAME_CC) == "same"


def test_missing_hardware_level_is_refused() -> None:
    trt = trt10(HardwareCompatibilityLevel=SimpleNamespace(NONE="none", AMPERE_PLUS="ampere"))
    with pytest.raises(EngineError, match="no HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY"):
        compat.hardware_level(trt, HardwareCompat.SAME_CC)


@pytest.mark.parametrize("make", [trt10, trt11])
def test_builder_flags_by_name(make: Any) -> None:
    trt = make()
    assert compat.builder_flag(trt, "VERSION_COMPATIBLE") == "VC"
    assert compat.builder_flag(trt, "REFIT") == "REFIT"


def test_removed_builder_flag_is_an_error_on_11() -> None:
    assert compat.builder_flag(trt10(), "FP16") == "FP16"
    with pytest.raises(EngineError, match=r"TensorRT 11.1.0.106 has no BuilderFlag.FP16"):
        compat.builder_flag(trt11(), "FP16")


class FakeConfig:
    def __init__(self) -> None:
        self.cleared: list[object] = []

    def clear_flag(self, flag: object) -> None:
        self.cleared.append(flag)


@pytest.mark.parametrize("make", [trt10, trt11])
def test_tf32_is_cleared_by_name(make: Any) -> None:
    config = FakeConfig()
    assert compat.disable_tf32(make(), config)  # type: ignore[arg-type]
    assert config.cleared == ["TF32"]
    without = make(BuilderFlag=SimpleNamespace(REFIT="REFIT"))
    assert not compat.disable_tf32(without, FakeConfig())  # type: ignore[arg-type]


def test_host_code_allowed_only_where_the_runtime_has_it() -> None:
    runtime = SimpleNamespace(engine_host_code_allowed=False)
    compat.allow_host_code(runtime)  # type: ignore[arg-type]
    assert runtime.engine_host_code_allowed is True
    compat.allow_host_code(SimpleNamespace())  # type: ignore[arg-type]


def test_device_memory_prefers_v2() -> None:
    engine = SimpleNamespace(device_memory_size=1, device_memory_size_v2=2)
    assert compat.device_memory_bytes(engine) == 2  # type: ignore[arg-type]  # 10.x
    # 11.x: v1 removed
    assert compat.device_memory_bytes(SimpleNamespace(device_memory_size_v2=3)) == 3  # type: ignore[arg-type]
    assert compat.device_memory_bytes(SimpleNamespace(device_memory_size=4)) == 4  # type: ignore[arg-type]  # 10.0
    assert compat.device_memory_bytes(SimpleNamespace()) is None  # type: ignore[arg-type]


def test_weights_bytes_only_where_engine_stat_exists() -> None:
    engine = SimpleNamespace(get_engine_stat=lambda stat: {"total": 1234, "stripped": -1}[stat])
    assert compat.weights_bytes(trt11(), engine) == 1234  # type: ignore[arg-type]
    assert compat.weights_bytes(trt10(), engine) is None  # type: ignore[arg-type]  # 10.13: no EngineStat
    assert compat.weights_bytes(trt11(), SimpleNamespace()) is None  # type: ignore[arg-type]


def test_load_tensorrt_checks_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", trt11())
    assert load_tensorrt().__version__ == "11.1.0.106"
    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="10.11.0.33", Builder=object))
    with pytest.raises(EngineError, match="too old"):
        load_tensorrt()


# --- ONNX parser errors ----------------------------------------------------------------------


def parser_error(name: str | None, op: str | None, node: int, desc: str) -> Any:
    fields: dict[str, Any] = {"node": lambda: node, "desc": lambda: desc}
    if name is not None:  # node_name()/node_operator() are missing from older bindings
        fields["node_name"] = lambda: name
        fields["node_operator"] = lambda: op
    return SimpleNamespace(**fields)


def test_parser_error_names_the_node() -> None:
    error = parser_error("/layers.0/attn/MatMul", "MatMul", 12, "Invalid matrix multiplication dimensions")
    assert (
        format_parser_error(error) == "node '/layers.0/attn/MatMul' (MatMul): Invalid matrix multiplication dimensions"
    )
    assert format_parser_error(parser_error(None, None, 3, "bad")) == "node #3: bad"
    assert (
        format_parser_error(parser_error("", "", -1, "model has no opset import")) == "graph: model has no opset import"
    )


def test_every_parser_error_is_reported() -> None:
    errors = [parser_error(f"n{i}", "Foo", i, f"No importer registered for op: Foo {i}") for i in range(3)]
    parser = SimpleNamespace(num_errors=3, get_error=lambda i: errors[i])
    assert parser_errors(parser) == [f"node 'n{i}' (Foo): No importer registered for op: Foo {i}" for i in range(3)]
    assert parser_errors(SimpleNamespace(num_errors=0, get_error=None)) == []


# --- refusing engines built elsewhere ------------------------------------------------------------

H200 = RuntimeInfo(tensorrt="10.13.0.35", cuda="12.9", gpu="NVIDIA H200", compute_capability="9.0")


def record(**changes: Any) -> dict[str, Any]:
    built = EngineRecord(
        kind="decode",
        file="engines/decode.plan",
        sha256="0" * 64,
        bytes=10,
        onnx="onnx/decode.onnx",
        onnx_sha256="1" * 64,
        built_with=H200,
        hardware_compat="none",
        version_compatible=False,
        refittable=False,
        tf32=False,
        profiles=({"input_ids": {"dtype": "int64", "min": [1, 1], "opt": [1, 1], "max": [8, 1]}},),
    ).to_dict()
    built.update(changes)
    return built


def runtime(tensorrt: str = "10.13.0.35", cc: str = "9.0", gpu: str = "NVIDIA H200") -> RuntimeInfo:
    return RuntimeInfo(tensorrt=tensorrt, cuda="12.9", gpu=gpu, compute_capability=cc)


def test_same_machine_is_accepted() -> None:
    assert compat_problems(record(), runtime()) == []
    check_engine_compat(record(), runtime())


def test_other_tensorrt_version_is_refused() -> None:
    with pytest.raises(EngineError) as info:
        check_engine_compat(record(), runtime(tensorrt="10.16.1.11"))
    assert str(info.value) == (
        "engine: engines/decode.plan was built by TensorRT 10.13.0.35 and needs exactly that version, found "
        "TensorRT 10.16.1.11; "
        "pip install tensorrt==10.13.0.35, or rebuild it here with kiln build (--version-compatible makes "
        "engines that run on later versions)"
    )


def test_other_compute_capability_is_refused() -> None:
    with pytest.raises(EngineError) as info:
        check_engine_compat(record(), runtime(cc="8.0", gpu="NVIDIA A100"))
    assert str(info.value) == (
        "engine: engines/decode.plan was built for compute capability 9.0 (NVIDIA H200) and needs a GPU of that "
        "compute capability, "
        "found 8.0 (NVIDIA A100); rebuild it here with kiln build, or build with --hardware-compat ampere+ for "
        "any GPU of compute capability 8.0 or newer"
    )
    assert compat_problems(record(hardware_compat="same-cc"), runtime(cc="9.0", gpu="NVIDIA H100")) == []
    assert len(compat_problems(record(hardware_compat="same-cc"), runtime(cc="8.9"))) == 1


def test_both_problems_are_named() -> None:
    problems = compat_problems(record(), runtime(tensorrt="11.1.0.106", cc="8.6"))
    assert len(problems) == 2
    assert "needs exactly that version, found TensorRT 11.1.0.106" in problems[0] and "found 8.6" in problems[1]


@pytest.mark.parametrize(("cc", "ok"), [("8.0", True), ("8.6", True), ("9.0", True), ("12.0", True), ("7.5", False)])
def test_ampere_plus(cc: str, ok: bool) -> None:
    problems = compat_problems(record(hardware_compat="ampere+"), runtime(cc=cc, gpu="some GPU"))
    assert (problems == []) is ok
    if not ok:
        assert problems == [
            "engines/decode.plan was built with --hardware-compat ampere+ and needs compute capability 8.0 or "
            f"newer, found {cc} (some GPU)"
        ]


@pytest.mark.parametrize(
    ("built", "here", "ok"),
    [
        ("10.13.0.35", "10.13.0.35", True),
        ("10.13.0.35", "10.16.1.11", True),  # later minor of the same major
        ("10.13.0.35", "11.1.0.106", True),  # 10 -> 11 is supported for version-compatible plans
        ("11.0.0.1", "11.4.1.2", True),
        ("10.16.1.11", "10.13.0.35", False),  # never an older runtime
        ("11.1.0.106", "10.16.1.11", False),
        ("10.13.0.35", "12.0.0.1", False),  # no other cross-major pair
    ],
)
def test_version_compatible_engines(built: str, here: str, ok: bool) -> None:
    problems = compat_problems(record(version_compatible=True, tensorrt=built), runtime(tensorrt=here))
    assert (problems == []) is ok
    if not ok:
        assert f"built by TensorRT {built}" in problems[0] and f"found TensorRT {here}" in problems[0]


def test_version_compatible_refusal_message() -> None:
    problems = compat_problems(record(version_compatible=True, tensorrt="10.16.1.11"), runtime(tensorrt="10.13.0.35"))
    assert problems == [
        "engines/decode.plan is a version-compatible engine built by TensorRT 10.16.1.11: it needs TensorRT "
        "10.16.1.11 or a later 10.x "
        "or any 11.x, found TensorRT 10.13.0.35; rebuild it here with kiln build"
    ]


def test_records_round_trip(tmp_path: Path) -> None:
    built = EngineRecord(
        **{
            **{k: v for k, v in record().items() if k in EngineRecord.__dataclass_fields__},
            "built_with": H200,
            "profiles": ({},),
        }
    )
    path = write_records(tmp_path, {"decode": built}, {"workspace": 1}, "engines/trtexec.sh")
    assert path == tmp_path / "engines" / "engines.json"
    data = read_records(tmp_path)
    assert (
        data["engines"]["decode"]["compute_capability"] == "9.0" and data["engines"]["decode"]["strongly_typed"] is True
    )
    assert RuntimeInfo.from_dict(data["engines"]["decode"]) == H200
    check_engine_compat(data["engines"]["decode"], H200)
    path.write_text("{}")
    with pytest.raises(ArtifactError, match="not an engines.json of version 1"):
        read_records(tmp_path)
    path.unlink()
    with pytest.raises(ArtifactError, match="no engines/engines.json; run kiln build"):
        read_records(tmp_path)


# --- the build flow over a stand-in TensorRT (plumbing only; tests/gpu builds real engines) -------


def fake_tensorrt(manifest: dict[str, Any], version: str = "11.1.0.106") -> Any:
    """Just enough of the Builder/OnnxParser/Runtime API for build_command to run end to end:
    the "plan" is the JSON of the profile it was given, so the shapes can be checked back."""

    class Logger:
        Severity = SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2)

        def __init__(self) -> None:
            pass

    class Network:
        def __init__(self) -> None:
            self.inputs: list[Any] = []
            self.num_inputs = 0

        def get_input(self, i: int) -> Any:
            return self.inputs[i]

    class Parser:
        num_errors = 0

        def __init__(self, network: Network, logger: Any) -> None:
            self.network = network

        def parse_from_file(self, path: str) -> bool:
            for spec in manifest["graphs"][Path(path).stem]["inputs"]:
                shape = [d if isinstance(d, int) else -1 for d in spec["shape"]]
                self.network.inputs.append(SimpleNamespace(name=spec["name"], shape=shape))
            self.network.num_inputs = len(self.network.inputs)
            return True

    class Config:
        def __init__(self) -> None:
            self.flags: set[str] = set()
            self.profile: dict[str, list[list[int]]] = {}

        def set_memory_pool_limit(self, pool: str, size: int) -> None:
            assert pool == "WORKSPACE"

        def set_flag(self, flag: str) -> None:
            self.flags.add(flag)

        def clear_flag(self, flag: str) -> None:
            assert flag == "TF32"

        def add_optimization_profile(self, profile: Any) -> int:
            self.profile = profile.shapes
            return 0

        def create_timing_cache(self, data: bytes) -> Any:
            return SimpleNamespace(serialize=lambda: bytes(data) + b"+")

        def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
            self.cache = cache
            return True

        def get_timing_cache(self) -> Any:
            return self.cache

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, list[list[int]]] = {}

        def set_shape(self, name: str, *dims: list[int]) -> None:
            self.shapes[name] = [list(d) for d in dims]

    class Builder:
        def __init__(self, logger: Any) -> None:
            pass

        def create_network(self, flags: int) -> Network:
            assert flags == 0  # 11.x: strongly typed without a flag
            return Network()

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            return json.dumps({"profile": config.profile, "flags": sorted(config.flags)}).encode()

    class Runtime:
        def __init__(self, logger: Any) -> None:
            pass

        def deserialize_cuda_engine(self, data: bytes) -> Any:
            plan = json.loads(data)
            return SimpleNamespace(
                device_memory_size_v2=1024, get_tensor_profile_shape=lambda name, i: plan["profile"][name]
            )

    return trt11(
        __version__=version,
        Builder=Builder,
        OnnxParser=Parser,
        Runtime=Runtime,
        ILogger=Logger,
        Dims=list,
        MemoryPoolType=SimpleNamespace(WORKSPACE="WORKSPACE"),
    )


def fake_export(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Any]:
    """A verifiable export directory with placeholder graphs, and the stand-in TensorRT installed."""
    spec = spec_of(tiny_config())
    graphs = {
        k.value: {
            "file": f"onnx/{k.value}.onnx",
            "inputs": [t.to_dict() for t in graph_io(spec, k).inputs],
            "outputs": [t.to_dict() for t in graph_io(spec, k).outputs],
        }
        for k in DECODER_KINDS
    }
    m: dict[str, Any] = {"manifest_version": 2, "limits": {"max_batch": 8, "max_context": 48}, "graphs": graphs}
    directory = placeholder_export(root / "export", m)
    trt = fake_tensorrt(m)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(build_mod, "current_runtime", lambda trt: RuntimeInfo("11.1.0.106", "13.0", "Fake GPU", "9.0"))
    return directory, trt


def test_build_flow_records_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, _ = fake_export(tmp_path, monkeypatch)

    summary = build_command(directory, BuildOptions(refittable=True, opt_batch=2))
    decode = summary["engines"]["decode"]
    assert decode["sha256"] == sha256_file(directory / "engines" / "decode.plan")
    assert decode["tensorrt"] == "11.1.0.106" and decode["compute_capability"] == "9.0" and decode["refittable"] is True
    assert decode["profiles"][0]["past_key_values.0.key"] == {
        "dtype": "float32",
        "min": [1, 2, 1, 8],
        "opt": [2, 2, 23, 8],
        "max": [8, 2, 47, 8],
    }
    assert decode["device_memory_bytes"] == 1024 and decode["weights_bytes"] is None
    plan = json.loads((directory / "engines" / "decode.plan").read_text())
    assert plan["flags"] == ["REFIT"] and plan["profile"]["attention_mask"] == [[1, 2], [2, 24], [8, 48]]
    assert read_records(directory)["engines"] == summary["engines"]
    written = manifest_mod.read(directory).to_json()
    assert (
        written["engines"]["tensorrt"] == "11.1.0.106"
        and written["engines"]["files"]["prefill"] == "engines/prefill.plan"
    )
    assert verify_dir(directory).ok, verify_dir(directory).problems()

    build_command(directory, BuildOptions())  # a rebuild reuses the timing cache and stays verifiable
    assert (directory / "engines" / "timing.cache").read_bytes() == b"++++"
    assert verify_dir(directory).ok
    assert TrtRunner.from_directory(directory).graphs() == (GraphKind.PREFILL, GraphKind.DECODE)
    (directory / "engines" / "prefill.plan").write_bytes(b"tampered")
    with pytest.raises(ArtifactError, match="prefill.plan: sha256 differs from engines.json"):
        TrtRunner.from_directory(directory)


def test_failed_build_is_one_error_and_the_directory_stays_verifiable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, trt = fake_export(tmp_path, monkeypatch)
    build_command(directory, BuildOptions())
    assert "engines" in manifest_mod.read(directory).to_json()

    def fail(self: Any, network: Any, config: Any) -> None:
        for logger in loggers:
            logger.log(trt.ILogger.Severity.ERROR, "[builder] out of memory")

    loggers: list[Any] = []

    def keep_logger(self: Any, logger: Any) -> None:
        loggers.append(logger)

    monkeypatch.setattr(trt.Builder, "__init__", keep_logger)
    monkeypatch.setattr(trt.Builder, "build_serialized_network", fail)
    with pytest.raises(EngineError) as info:
        build_command(directory, BuildOptions())
    assert (
        str(info.value)
        == f"engine: {directory / 'onnx' / 'prefill.onnx'}: TensorRT could not build the prefill engine: [builder] "
        "out of memory"
    )
    assert not (directory / "engines" / "engines.json").exists()  # no record of plans that may be stale
    assert "engines" not in manifest_mod.read(directory).to_json()
    assert verify_dir(directory).ok, verify_dir(directory).problems()


def test_parser_failure_names_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, trt = fake_export(tmp_path, monkeypatch)
    errors = [parser_error(f"/layers.{i}/Foo", "Foo", i, "No importer registered for op: Foo") for i in range(7)]
    monkeypatch.setattr(trt.OnnxParser, "parse_from_file", lambda self, path: False)
    monkeypatch.setattr(trt.OnnxParser, "num_errors", 7)
    monkeypatch.setattr(trt.OnnxParser, "get_error", lambda self, i: errors[i], raising=False)
    with pytest.raises(EngineError) as info:
        build_command(directory, BuildOptions())
    text = str(info.value)
    assert text.startswith(
        f"engine: {directory / 'onnx' / 'prefill.onnx'}: TensorRT's ONNX parser failed: node '/layers.0/Foo' "
        "(Foo): No importer"
    )
    assert "node '/layers.4/Foo' (Foo)" in text and "/layers.5/" not in text and text.endswith("(and 2 more)")


# --- engines of the --target onnx graphs (static cache), over the stand-in TensorRT --------------


def fake_std_export(
    root: Path, monkeypatch: pytest.MonkeyPatch, version: str = "11.1.0.106", aliased: bool = True
) -> tuple[Path, Any]:
    """``fake_export`` with ``targets.onnx`` too; the stand-in's engines name their I/O and say
    which output aliases which input, as ``ICudaEngine.get_aliased_input_tensor`` does (10.15+):
    each ``present.*`` its ``past_key_values.*`` when ``aliased``, none otherwise."""
    spec = spec_of(tiny_config())
    graphs = {
        k.value: {
            "file": f"onnx/{k.value}.onnx",
            "inputs": [t.to_dict() for t in graph_io(spec, k).inputs],
            "outputs": [t.to_dict() for t in graph_io(spec, k).outputs],
        }
        for k in DECODER_KINDS
    }
    m = with_std_target({"manifest_version": 2, "limits": {"max_batch": 8, "max_context": 48}, "graphs": graphs})
    directory = placeholder_export(root / "export", m)
    by_stem = {
        **graphs,
        **{f"{k}.std": g for k, g in m["targets"]["onnx"]["graphs"].items()},
    }  # the stand-in parser reads graphs by file stem
    trt = fake_tensorrt({"graphs": by_stem}, version)
    trt.TensorIOMode = SimpleNamespace(INPUT="in", OUTPUT="out")
    plain = trt.Runtime.deserialize_cuda_engine

    def deserialize(self: Any, data: bytes) -> Any:
        engine = plain(self, data)
        inputs = list(json.loads(data)["profile"])
        outputs = [
            "logits",
            *(n.replace("past_key_values.", "present.") for n in inputs if n.startswith("past_key_values.")),
        ]
        names = [*inputs, *outputs]
        engine.num_io_tensors = len(names)
        engine.get_tensor_name = names.__getitem__
        engine.get_tensor_mode = lambda name: "out" if name in outputs else "in"
        engine.get_aliased_input_tensor = lambda name: (
            name.replace("present.", "past_key_values.") if aliased and name.startswith("present.") else None
        )
        return engine

    monkeypatch.setattr(trt.Runtime, "deserialize_cuda_engine", deserialize)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(build_mod, "current_runtime", lambda trt: RuntimeInfo(version, "13.0", "Fake GPU", "9.0"))
    return directory, trt


def test_std_build_flow_records_the_graph_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.exporter.engine import StaticTrtRunner, open_engines
    from kiln.exporter.engine.options import GraphSet

    directory, _ = fake_std_export(tmp_path, monkeypatch)
    build_command(directory, BuildOptions(graphs=GraphSet.PORTABLE))  # first the portable set...
    assert (directory / "engines" / "decode.plan").is_file()
    summary = build_command(directory, BuildOptions(opt_batch=2))  # ...then auto: the std set replaces it
    reason = "the export has --target onnx graphs and TensorRT 11.1.0.106 parses them (10.15+)"
    assert summary["graphs"] == {"set": "onnx", "reason": reason}
    decode = summary["engines"]["decode"]
    assert (decode["file"], decode["onnx"], decode["graphs"]) == (
        "engines/decode.std.plan",
        "onnx/decode.std.onnx",
        "onnx",
    )
    assert decode["profiles"][0]["past_key_values.1.value"] == {
        "dtype": "float32",
        "min": [1, 2, 48, 8],
        "opt": [2, 2, 48, 8],
        "max": [8, 2, 48, 8],
    }
    assert decode["profiles"][0]["write_indices"] == {"dtype": "int64", "min": [1], "opt": [2], "max": [8]}
    plan = json.loads((directory / "engines" / "decode.std.plan").read_text())
    assert plan["profile"]["past_key_values.0.key"] == [[1, 2, 48, 8], [2, 2, 48, 8], [8, 2, 48, 8]]
    assert (
        not (directory / "engines" / "decode.plan").exists() and not (directory / "engines" / "prefill.plan").exists()
    )  # one set in engines/
    assert read_records(directory)["graphs"] == {"set": "onnx", "reason": reason}
    written = manifest_mod.read(directory).to_json()["engines"]
    assert (written["graphs"], written["graphs_reason"], written["files"]["prefill"]) == (
        "onnx",
        reason,
        "engines/prefill.std.plan",
    )
    from jsonschema import Draft202012Validator

    schema = json.loads((Path(__file__).parents[2] / "exporter" / "artifacts" / "manifest.schema.json").read_text())
    engines_schema = Draft202012Validator({"$defs": schema["$defs"], **schema["properties"]["engines"]})
    assert not list(engines_schema.iter_errors(written))
    assert list(engines_schema.iter_errors({**written, "graphs": "auto"}))  # only a chosen set is recorded
    assert verify_dir(directory).ok, verify_dir(directory).problems()
    runner = open_engines(directory)
    assert isinstance(runner, StaticTrtRunner) and runner.graphs() == (GraphKind.PREFILL, GraphKind.DECODE)
    with pytest.raises(
        ArtifactError, match=r"its engines were built from the onnx graphs \(engines.json\), not the portable ones"
    ):
        TrtRunner.from_directory(directory)
    summary = build_command(directory, BuildOptions(graphs=GraphSet.PORTABLE))
    assert summary["graphs"] == {"set": "portable", "reason": "--graphs portable"} and isinstance(
        open_engines(directory), TrtRunner
    )
    assert not (directory / "engines" / "decode.std.plan").exists() and verify_dir(directory).ok


def test_std_engine_not_written_in_place_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, _ = fake_std_export(tmp_path, monkeypatch, aliased=False)
    with pytest.raises(
        EngineError,
        match=r"prefill.std.plan: the cache is not written in place: present.0.key -> None, .*TensorRT's parser did "
        r"not lower TensorScatter to IKVCacheUpdateLayer",
    ):
        build_command(directory, BuildOptions())
    assert not (directory / "engines" / "engines.json").exists() and verify_dir(directory).ok


def test_std_graphs_on_tensorrt_10_14(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto builds the portable graphs on a TensorRT older than 10.15, and says why; --graphs onnx is refused there."""
    from kiln.exporter.engine.options import GraphSet

    directory, trt = fake_std_export(tmp_path, monkeypatch, version="10.14.1.48")
    monkeypatch.setattr(compat, "network_flags", lambda trt: 0)  # the stand-in builds 11.x networks only
    summary = build_command(directory, BuildOptions())
    assert summary["graphs"]["set"] == "portable" and summary["graphs"]["reason"].startswith(
        "TensorRT 10.14.1.48 is older than 10.15"
    )
    assert summary["engines"]["decode"]["file"] == "engines/decode.plan"
    with pytest.raises(EngineError) as info:
        build_command(directory, BuildOptions(graphs=GraphSet.ONNX))
    text = str(info.value)
    assert (
        "\n" not in text
        and text.startswith("engine: --graphs onnx needs TensorRT 10.15 or newer")
        and "found TensorRT 10.14.1.48" in text
    )
    assert "(wrote " in text and verify_dir(directory).ok


class _FakeCuda:
    """polygraphy.cuda's DeviceArray/Stream over host arrays, each at an address of its own: what
    StaticTrtRunner calls, so the stand-in context can check which buffer each tensor is bound to."""

    def __init__(self) -> None:
        self.memory: dict[int, Any] = {}
        cuda = self

        class DeviceArray:
            def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
                import numpy as np

                self.array = np.zeros(shape, dtype)
                self.ptr = 1000 + len(cuda.memory)
                cuda.memory[self.ptr] = self

            def resize(self, shape: tuple[int, ...]) -> None:
                import numpy as np

                self.array = np.zeros(shape, self.array.dtype)

            def copy_from(self, host: Any, stream: Any = None) -> None:
                assert host.shape == self.array.shape and host.dtype == self.array.dtype
                self.array = host.copy()

            def numpy(self) -> Any:
                return self.array.copy()

            def free(self) -> None:
                cuda.memory.pop(self.ptr, None)

        class Stream:
            ptr = 7

            def synchronize(self) -> None:
                pass

            def free(self) -> None:
                pass

        self.DeviceArray, self.Stream = DeviceArray, Stream


def test_static_runner_binds_each_present_at_its_past(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """StaticTrtRunner over a stand-in engine whose context writes the new tokens into the buffer
    bound to each present, and fails (as TensorRT's API error) when a present is not bound at its
    past's address: the portable question (a past of 3) comes back as presents of 4 slots, the past
    kept, the new slot written in place. Plumbing only: the real engines run in tests/gpu."""
    import numpy as np
    import polygraphy

    import kiln.exporter.engine.runner as runner_mod
    from kiln.exporter.engine import StaticTrtRunner, open_engines

    directory, trt = fake_std_export(tmp_path, monkeypatch)
    build_command(directory, BuildOptions())
    cuda = _FakeCuda()
    monkeypatch.setattr(polygraphy, "cuda", cuda, raising=False)
    monkeypatch.setattr(runner_mod, "current_runtime", lambda trt: RuntimeInfo("11.1.0.106", "13.0", "Fake GPU", "9.0"))
    trt.nptype = lambda t: np.dtype(t)
    plain = trt.Runtime.deserialize_cuda_engine

    class Context:
        def __init__(self, engine: Any) -> None:
            self.engine, self.shapes, self.addresses = engine, {}, {}

        def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            self.addresses[name] = ptr
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            assert name == "logits"
            return (*self.shapes["input_ids"], 32)

        def execute_async_v3(self, stream: int) -> bool:
            batch, seq = self.shapes["input_ids"]
            writes = (
                cuda.memory[self.addresses["write_indices"]].array
                if "write_indices" in self.addresses and "write_indices" in self.shapes
                else np.zeros(batch, np.int64)
            )
            for name in (n for n in self.addresses if n.startswith("present.")):
                if self.addresses[name] != self.addresses[name.replace("present.", "past_key_values.")]:
                    return False  # TensorRT: "If different addresses are assigned, TensorRT reports an API error"
                cache = cuda.memory[self.addresses[name]].array
                for b in range(batch):
                    cache[b, :, writes[b] : writes[b] + seq, :] = 1.0 + writes[b] + np.arange(seq)[:, None]
            cuda.memory[self.addresses["logits"]].array[...] = 7.0
            return True

    def deserialize(self: Any, data: bytes) -> Any:
        engine = plain(self, data)
        engine.get_tensor_dtype = lambda name: (
            "int64" if name in ("input_ids", "attention_mask", "position_ids", "write_indices") else "float32"
        )
        engine.get_tensor_shape = lambda name: (
            (-1, 2, 48, 8) if "key_values" in name or name.startswith("present.") else (-1, -1)
        )
        engine.create_execution_context = lambda: Context(engine)
        return engine

    monkeypatch.setattr(trt.Runtime, "deserialize_cuda_engine", deserialize)
    runner = open_engines(directory)
    assert isinstance(runner, StaticTrtRunner)
    past = np.full((2, 2, 3, 8), 0.5, np.float32)
    feeds = {
        "input_ids": np.zeros((2, 1), np.int64),
        "attention_mask": np.ones((2, 4), np.int64),
        "position_ids": np.full((2, 1), 3, np.int64),
    }
    feeds |= {f"past_key_values.{i}.{kv}": past for i in range(2) for kv in ("key", "value")}
    with runner:
        out = runner.run(GraphKind.DECODE, feeds)
        prefill = runner.run(
            GraphKind.PREFILL, {k: np.zeros((1, 5), np.int64) for k in ("input_ids", "attention_mask", "position_ids")}
        )
    assert out["logits"].shape == (2, 1, 32) and (out["logits"] == 7.0).all()
    for i in range(2):
        present = out[f"present.{i}.key"]
        assert present.shape == (2, 2, 4, 8) and (present[:, :, :3] == 0.5).all() and (present[:, :, 3] == 4.0).all()
    assert (
        prefill["present.1.value"].shape == (1, 2, 5, 8)
        and (prefill["present.1.value"][0, :, :, 0] == np.arange(1.0, 6.0)).all()
    )
    assert not cuda.memory  # every buffer freed on exit
    with pytest.raises(EngineError, match="inside a with block"):
        runner.run(GraphKind.DECODE, feeds)


def test_cli_build_says_which_graphs_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from kiln.cli import main

    directory, _ = fake_std_export(tmp_path, monkeypatch)
    result = CliRunner().invoke(main, ["build", str(directory)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        f"wrote engines/prefill.std.plan, engines/decode.std.plan in {directory} from the onnx graphs "
        "(the export has --target onnx graphs and TensorRT 11.1.0.106 parses them (10.15+); TensorRT 11.1.0.106, "
        "Fake GPU"
    )
    result = CliRunner().invoke(main, ["build", str(directory), "--graphs", "portable", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["graphs"] == {
        "set": "portable",
        "reason": "--graphs portable",
    }
