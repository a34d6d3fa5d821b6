"""LoRA slots (``--lora-slots``) in ``kiln build``: each slot input's profile range, the trtexec lines,
the slot-free graph TensorRT parses and the rank-0 feeds the engine runners bind (no TensorRT needed)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.errors import ArtifactError
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind, graph_io
from kiln.exporter.contract.lora import LoraSlot, LoraSlots
from kiln.exporter.engine import build as build_mod
from kiln.exporter.engine import runner as runner_mod
from kiln.exporter.engine.options import BuildOptions, GraphSet
from kiln.exporter.engine.profiles import engine_profile, engine_profiles, lora_shapes
from kiln.exporter.engine.runner import TrtRunner, lora_default_feeds
from kiln.exporter.engine.trtexec import render_script, trtexec_args
from kiln.plugins.native import spec_of
from kiln_testing import placeholder_export, tiny_config, typed_manifest, with_std_target

Q, DOWN = LoraSlot.of("model.layers.0.self_attn.q_proj", 64, 64), LoraSlot.of("model.layers.0.mlp.down_proj", 128, 64)
SLOTS = LoraSlots(8, "float32", (Q, DOWN))


def manifest(lora: LoraSlots | None = SLOTS, dtype: str = "float32") -> dict[str, Any]:
    spec = spec_of(tiny_config())
    graphs = {}
    for kind in DECODER_KINDS:
        io = graph_io(spec, kind)
        graphs[kind.value] = {
            "file": f"onnx/{kind.value}.onnx",
            "inputs": [t.to_dict() for t in io.inputs],
            "outputs": [t.to_dict() for t in io.outputs],
        }
    m: dict[str, Any] = {
        "manifest_version": 2,
        "precision": "fp32",
        "limits": {"max_batch": 8, "max_context": 48},
        "graphs": graphs,
    }
    if lora is not None:
        m["lora"] = {
            "max_rank": lora.max_rank,
            "dtype": dtype,
            "slots": [
                {
                    "module": s.module,
                    "in_features": s.in_features,
                    "out_features": s.out_features,
                    "a": s.a,
                    "b": s.b,
                    "rank_dim": s.rank_dim,
                }
                for s in lora.slots
            ],
        }
    return m


def shapes(
    m: dict[str, Any], kind: GraphKind, graphs: GraphSet = GraphSet.PORTABLE
) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {
        s.name: (s.min, s.opt, s.max) for s in engine_profile(typed_manifest(m), kind, BuildOptions(), graphs).inputs
    }


SLOT_SHAPES = {
    Q.a: ((64, 0), (64, 8), (64, 8)),
    Q.b: ((0, 64), (8, 64), (8, 64)),
    DOWN.a: ((128, 0), (128, 8), (128, 8)),
    DOWN.b: ((0, 64), (8, 64), (8, 64)),
}


@pytest.mark.parametrize("kind", [GraphKind.PREFILL, GraphKind.DECODE])
def test_every_slot_input_is_ranged_from_rank_0_to_max_rank(kind: GraphKind) -> None:
    plain, slotted = shapes(manifest(None), kind), shapes(manifest(), kind)
    assert list(slotted) == [
        *plain,
        Q.a,
        Q.b,
        DOWN.a,
        DOWN.b,
    ]  # the contract's inputs first, unchanged, then the slots in the manifest's order
    assert {k: v for k, v in slotted.items() if k in plain} == plain
    assert {k: v for k, v in slotted.items() if k not in plain} == SLOT_SHAPES
    profile = engine_profile(typed_manifest(manifest()), kind, BuildOptions())
    assert profile.slot_inputs == (Q.a, Q.b, DOWN.a, DOWN.b)
    assert {s.dtype for s in profile.inputs if s.name in SLOT_SHAPES} == {"float32"}


def test_slots_take_the_graphs_dtype() -> None:
    profile = engine_profile(typed_manifest(manifest(dtype="float16")), GraphKind.DECODE, BuildOptions())
    assert {s.dtype for s in profile.inputs if s.name in SLOT_SHAPES} == {"float16"}
    assert lora_shapes(SLOTS)[0].to_dict() == {"dtype": "float32", "min": [64, 0], "opt": [64, 8], "max": [64, 8]}


def test_an_export_without_slots_has_no_slot_inputs() -> None:
    for profile in engine_profiles(typed_manifest(manifest(None)), BuildOptions()):
        assert profile.slot_inputs == () and not any(s.name.endswith((".lora_A", ".lora_B")) for s in profile.inputs)


def test_the_onnx_target_graphs_have_no_slots() -> None:
    """--target onnx graphs (engines/*.std.plan) carry no slots: their profiles ignore the manifest's lora."""
    plain, slotted = with_std_target(manifest(None)), with_std_target(manifest())
    for kind in (GraphKind.PREFILL, GraphKind.DECODE):
        assert shapes(slotted, kind, GraphSet.ONNX) == shapes(plain, kind, GraphSet.ONNX)
        assert engine_profile(typed_manifest(slotted), kind, BuildOptions(), GraphSet.ONNX).slot_inputs == ()


def test_trtexec_lines_carry_the_slot_shapes() -> None:
    prefill, decode = engine_profiles(typed_manifest(manifest()), BuildOptions())
    plain = engine_profiles(typed_manifest(manifest(None)), BuildOptions())[1]
    args, plain_args = trtexec_args(decode, BuildOptions()), trtexec_args(plain, BuildOptions())
    slot = {
        "min": f"{Q.a}:64x0,{Q.b}:0x64,{DOWN.a}:128x0,{DOWN.b}:0x64",
        "opt": f"{Q.a}:64x8,{Q.b}:8x64,{DOWN.a}:128x8,{DOWN.b}:8x64",
        "max": f"{Q.a}:64x8,{Q.b}:8x64,{DOWN.a}:128x8,{DOWN.b}:8x64",
    }
    for which in ("min", "opt", "max"):
        [mine] = [a for a in args if a.startswith(f"--{which}Shapes=")]
        [theirs] = [a for a in plain_args if a.startswith(f"--{which}Shapes=")]
        assert mine == f"{theirs},{slot[which]}"
    assert [a for a in args if "Shapes=" not in a] == [a for a in plain_args if "Shapes=" not in a]
    script = render_script((prefill, decode), BuildOptions())
    assert "trtexec reads the file as it is" in script and "Build slotted engines with kiln build." in script
    assert "LoRA slots" not in render_script(
        engine_profiles(typed_manifest(manifest(None)), BuildOptions()), BuildOptions()
    )


def _slotted_graph(path: Path, initializer: bool = True) -> None:
    """A graph y = x @ W + (x @ A) @ B whose A and B are inputs with rank-0 initializers, W external."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    a = helper.make_tensor_value_info("s.lora_A", TensorProto.FLOAT, [4, "s.rank"])
    b = helper.make_tensor_value_info("s.lora_B", TensorProto.FLOAT, ["s.rank", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    w = onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    inits = [w]
    if initializer:
        inits += [
            onnx.numpy_helper.from_array(np.zeros((4, 0), np.float32), "s.lora_A"),
            onnx.numpy_helper.from_array(np.zeros((0, 4), np.float32), "s.lora_B"),
        ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("MatMul", ["x", "s.lora_A"], ["xa"]),
        helper.make_node("MatMul", ["xa", "s.lora_B"], ["d"]),
        helper.make_node("Add", ["xw", "d"], ["y"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, a, b], [y], inits))
    onnx.save(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)


def test_slot_free_graph_keeps_the_inputs_and_drops_their_initializers(tmp_path: Path) -> None:
    _slotted_graph(tmp_path / "g.onnx")
    proto = onnx.load_from_string(build_mod.slot_free_graph(tmp_path / "g.onnx", ("s.lora_A", "s.lora_B")))
    assert [i.name for i in proto.graph.input] == ["x", "s.lora_A", "s.lora_B"]
    [w] = proto.graph.initializer
    assert w.name == "W" and w.data_location == TensorProto.EXTERNAL  # the weights stay in their file beside the graph
    _slotted_graph(tmp_path / "h.onnx", initializer=False)
    with pytest.raises(ArtifactError, match="LoRA slot inputs are not all initializers"):
        build_mod.slot_free_graph(tmp_path / "h.onnx", ("s.lora_A", "s.lora_B"))


class _Parser:
    """A stand-in ``trt.OnnxParser``: records which parse it was asked for."""

    calls: list[tuple[str, Any]] = []

    def __init__(self, network: object, logger: object) -> None:
        self.num_errors = 0

    def parse(self, model: bytes, path: str) -> bool:
        _Parser.calls.append(("parse", (onnx.load_from_string(model), path)))
        return True

    def parse_from_file(self, path: str) -> bool:
        _Parser.calls.append(("parse_from_file", path))
        return True


def test_the_build_parses_slotted_graphs_without_their_initializers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slotted_graph(tmp_path / "g.onnx")
    monkeypatch.setattr(build_mod.compat, "network_flags", lambda trt: 0)
    trt = types.SimpleNamespace(OnnxParser=_Parser)
    builder: Any = types.SimpleNamespace(create_network=lambda flags: object())
    _Parser.calls = []
    build_mod._parse(trt, builder, None, tmp_path / "g.onnx")  # type: ignore[arg-type]
    build_mod._parse(trt, builder, None, tmp_path / "g.onnx", ("s.lora_A", "s.lora_B"))  # type: ignore[arg-type]
    (plain, file), (slotted, (proto, path)) = _Parser.calls
    assert (plain, file) == ("parse_from_file", str(tmp_path / "g.onnx"))
    assert slotted == "parse" and path == str(tmp_path / "g.onnx")  # the path locates the external weights
    assert [i.name for i in proto.graph.initializer] == ["W"]


def test_runner_binds_rank_0_slots_unless_fed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = lora_default_feeds(SLOTS)
    assert {k: (v.shape, v.dtype) for k, v in defaults.items()} == {
        Q.a: ((64, 0), np.float32),
        Q.b: ((0, 64), np.float32),
        DOWN.a: ((128, 0), np.float32),
        DOWN.b: ((0, 64), np.float32),
    }
    assert lora_default_feeds(None) == {}
    assert lora_default_feeds(LoraSlots(4, "float16", (Q,)))[Q.a].dtype == np.float16
    directory = placeholder_export(tmp_path / "export", manifest())
    monkeypatch.setattr(runner_mod, "recorded_engines", lambda d, graphs: ({}, {}))
    runner = TrtRunner.from_directory(directory, extra_feeds={"table": np.ones(1)})
    adapter = np.ones((64, 2), np.float32)
    feeds = runner.feeds({"input_ids": np.zeros((1, 1), np.int64), Q.a: adapter})
    assert set(feeds) == {"input_ids", "table", *SLOT_SHAPES} and feeds[Q.a] is adapter and feeds[Q.b].shape == (0, 64)
    plain = TrtRunner.from_directory(placeholder_export(tmp_path / "plain", manifest(None)))
    assert set(plain.feeds({"input_ids": np.zeros((1, 1), np.int64)})) == {"input_ids"}
