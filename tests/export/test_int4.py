"""--int4: weight-only int4, quantized once and written twice (portable block DQ, ORT MatMulNBits)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ConfigError, ExportError
from kiln.exporter.check import check_dir
from kiln.exporter.int4.numbers import unpack_int4
from kiln.exporter.int4.quantize import check_int4
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.plan import plan
from kiln.exporter.precision.kinds import Fp16, Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners.ort_runner import ort_session
from kiln_testing import RecordedProgress, config_error, tiny_config, write_checkpoint

KINDS = ("prefill", "decode", "model")


def _ids(path: Path, n: int = 6000, vocab: int = 101, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    np.save(path, (np.cumsum(rng.integers(1, 4, size=n)) % vocab).astype(np.int64))
    return path


@pytest.fixture(scope="module")
def int4_ort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("int4")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    export(
        ckpt,
        root / "out",
        ExportOptions.from_flags(precision=Precision.of(Int4(method=Int4Method.RTN)), target="ort", parity_tokens=16),
    )
    return root / "out"


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def test_portable_form_passes_checker_and_rules(int4_ort: Path) -> None:
    for kind in KINDS:
        path = int4_ort / "onnx" / f"{kind}.onnx"
        onnx.checker.check_model(path, full_check=True)
        assert check_int4(ir.load(path)) == 14  # q/k/v/o, gate, fc1, fc2 in 2 layers
        model = onnx.load(path)
        assert model.opset_import[0].version == 21 and model.ir_version >= 10
        producers = {o: n for n in model.graph.node for o in n.output}
        nodes = {n.name: n for n in model.graph.node}
        dq = producers[nodes["/layers.0.mlp.fc2/MatMul"].input[1]]
        inits = _inits(model)
        weight, scale = inits[dq.input[0]], inits[dq.input[1]]
        assert len(dq.input) == 2  # no zero point
        assert {a.name: a.i for a in dq.attribute} == {
            "axis": 0,
            "block_size": 64,
        }  # K=64: the 128 asked does not divide it
        assert weight.shape == (64, 32) and scale.shape == (1, 32) and scale.dtype == np.float32
        assert next(i for i in model.graph.initializer if i.name == dq.input[0]).data_type == onnx.TensorProto.INT4
        head = nodes["/lm_head/MatMul"]
        assert all(producers.get(i) is None or producers[i].op_type != "DequantizeLinear" for i in head.input)
        assert not any(n.op_type == "QuantizeLinear" for n in model.graph.node)


def test_ort_form_holds_the_portable_numbers(int4_ort: Path) -> None:
    """MatMulNBits' B is q + 8 of exactly the portable graph's int4 weights (packed q/k/v side by side)."""
    portable = onnx.load(int4_ort / "onnx" / "decode.onnx")
    ort = onnx.load(int4_ort / "onnx" / "decode.ort.onnx")
    # (no onnx.checker here: every --target ort graph holds ONNX Runtime's SimplifiedLayerNormalization,
    # which ONNX Runtime registers in the default domain and onnx does not know)
    producers = {o: n for n in portable.graph.node for o in n.output}
    p_nodes = {n.name: n for n in portable.graph.node}
    p_inits, o_inits = _inits(portable), _inits(ort)
    nbits = {n.name: n for n in ort.graph.node if n.op_type == "MatMulNBits"}
    assert not any(n.op_type == "DequantizeLinear" for n in ort.graph.node)
    assert len(nbits) == 8  # per layer: packed q/k/v, o, packed gate/fc1, fc2

    def portable_q(name: str) -> tuple[np.ndarray, np.ndarray]:
        dq = producers[p_nodes[name].input[1]]
        return p_inits[dq.input[0]].astype(np.int8), p_inits[dq.input[1]]

    node = nbits["/layers.1.attn.qkv_proj/ort/packed/MatMulNBits"]
    attrs = {a.name: a.i for a in node.attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"], attrs["K"], attrs["N"]) == (4, 32, 4, 32, 64)
    parts = [portable_q(f"/layers.1.attn.{p}_proj/MatMul") for p in "qkv"]
    q = np.concatenate([p[0] for p in parts], axis=1)
    scale = np.concatenate([p[1] for p in parts], axis=1)
    packed = o_inits[node.input[1]]  # [N, K/B, B/2]
    u = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(attrs["N"], -1).T.astype(np.int16)
    assert np.array_equal(u - 8, q)
    assert np.array_equal(o_inits[node.input[2]].reshape(attrs["N"], -1).T, scale)
    assert len(node.input) < 4 or not node.input[3]  # no zero points: the default 8


def test_manifest_parity_and_check(int4_ort: Path) -> None:
    manifest = json.loads((int4_ort / "manifest.json").read_text())
    assert manifest["precision"] == "int4" and manifest["export"]["opset"] == 21
    quant = manifest["export"]["quantization"]
    assert (quant["method"], quant["block_size"], quant["calibration"]) == ("rtn", 128, None)
    assert quant["layer_block_sizes"]["/layers.0.mlp.fc2/MatMul"] == 64 and quant["kept_float"]["rules"] == [
        "*.lm_head",
        "/model.proj_out/",  # Whisper's head (an exact module name: nothing of the demo's)
    ]
    assert "/lm_head/MatMul" not in manifest["graphs"]["decode"]["passes"]["int4"]["nodes"]
    ort = manifest["targets"]["ort"]
    assert ort["precision"] == "int4" and ort["record"]["int4"] == {
        "op": "MatMulNBits",
        "bits": 4,
        "block_size": 128,
        "accuracy_level": 4,
    }
    assert "/layers.0.attn.o_proj/MatMul" in ort["graphs"]["decode"]["passes"]["nbits_int4"]["nodes"]
    report = json.loads((int4_ort / "reports" / "parity.json").read_text())
    assert report["passed"] and report["tolerance"]["min_token_match"] == 0.7
    assert {g["target"] for g in report["generation"]} == {None, "ort"}
    assert check_dir(int4_ort).passed


def test_graphs_are_judged_against_their_own_int4_weights(int4_ort: Path) -> None:
    """Both graph sets against PyTorch on the graphs' int4 numbers: the portable set at fp32's
    tolerances (weight-only: nothing else approximates), the ORT set at int8's (its MatMulNBits
    quantize activations, accuracy_level 4); then their agreement with the checkpoint's model at
    int4's, recorded only (the default: random prompts do not judge quality)."""
    report = json.loads((int4_ort / "reports" / "parity.json").read_text())
    quantized = report["quantized"]
    assert report["agreement_gates"] is False and quantized["passed"]
    assert (
        quantized["tolerance"]["logits_rtol"] == 1e-4
        and quantized["targets"]["ort"]["tolerance"]["min_token_match"] == 1.0
    )
    portable = [t for t in quantized["tensors"] if t["target"] is None]
    assert {t["graph"] for t in portable} == set(KINDS) and all(
        t["error"] <= t["atol"] + t["rtol"] * t["scale"] for t in portable
    )
    assert (
        max(t["error"] / (t["atol"] + t["rtol"] * t["scale"]) for t in portable) < 0.1
    )  # fp32 rounding, far inside the limit
    assert {g["target"] for g in quantized["generation"]} == {None, "ort"}
    assert all(g["token_match_rate"] == 1.0 for g in quantized["generation"] if g["target"] is None)
    # the ORT set's prepacked MatMulNBits quantize activations to int8, as a user's session does
    # (without prepacking, ONNX Runtime fell back to fp32): near-ties of the random model may flip,
    # and nothing else may (no divergence but by a tie, at int8's logits limit)
    ort = [g for g in quantized["generation"] if g["target"] == "ort"]
    assert ort and all(g["token_match_rate"] >= 0.9 and g["first_divergence"] is None and g["passed"] for g in ort)
    assert json.loads((int4_ort / "manifest.json").read_text())["parity"]["agreement"] == "record"
    markdown = (int4_ort / "reports" / "parity.md").read_text()
    assert (
        "| portable vs int4 weights | int4 |" in markdown
        and "| ort vs checkpoint (agreement, recorded only) | int4 |" in markdown
    )
    assert "## Tensors against the int4 weights' model" in markdown
    checked = check_dir(int4_ort)
    assert (
        checked.quantized is not None and checked.quantized.passed and not checked.agreement_gates
    )  # as the export recorded


def test_int4_numbers_other_than_the_graphs_fail_where_agreement_passes(
    int4_ort: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One weight's scales 2% off (PyTorch computing other numbers than the graphs): far inside
    int4's agreement with the checkpoint's model, and refused against the quantized model."""
    import dataclasses

    from kiln.exporter.int4.proof import QuantizerNumbers

    weights = QuantizerNumbers.weights  # what kiln check's quantized model reads (the quantizer run again)

    def off(self):  # type: ignore[no-untyped-def]
        for i, weight in enumerate(weights(self)):
            yield dataclasses.replace(weight, scale=weight.scale * 1.02) if i == 0 else weight

    monkeypatch.setattr(QuantizerNumbers, "weights", off)
    checked = check_dir(int4_ort)
    assert checked.agreed and checked.quantized is not None and not checked.quantized.passed and not checked.passed
    failures = checked.failures()
    assert failures and all(f.startswith("against the int4 weights' model: ") for f in failures)
    assert any("max abs" in f and "tolerance 1e-05 + 0.0001 x max|row|" in f for f in failures), failures


def test_agreement_can_be_recorded_only_for_quantized_exports(tiny_ckpt: Path, tmp_path: Path) -> None:
    """int4, int8 and fp8 graphs are also checked against the quantized model (issue 40); fp16's are not."""
    with pytest.raises(ConfigError) as err:
        plan(ExportOptions.from_flags(precision=Precision.FP16, parity_agreement="record"))
    assert str(err.value) == (
        "config: --parity-agreement record only applies to --int8, --fp8 or --int4 exports, whose graphs are "
        "also checked against PyTorch on their own quantized numbers; "
        "a fp16 export's only proof is its agreement with the checkpoint's model"
    )
    plan(
        ExportOptions.from_flags(precision=Precision.INT8, calib_data="synthetic", parity_agreement="gate")
    )  # accepted
    base = ["export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out")]
    assert config_error(*base, "--parity-agreement", "record").startswith(
        "--parity-agreement record only applies to --int8, --fp8 or --int4 exports"
    )
    assert (
        "'maybe' is not one of 'gate', 'record'"
        in CliRunner().invoke(main, [*base, "--parity-agreement", "maybe"]).output
    )
    assert not (tmp_path / "out").exists()


def test_manifest_matches_the_schema(int4_ort: Path) -> None:
    from importlib import resources

    from jsonschema import Draft202012Validator

    schema = json.loads((resources.files("kiln.exporter.artifacts") / "manifest.schema.json").read_text())
    manifest = json.loads((int4_ort / "manifest.json").read_text())
    Draft202012Validator(schema).validate(manifest)
    broken = {**manifest, "export": {k: v for k, v in manifest["export"].items() if k != "quantization"}}
    assert list(Draft202012Validator(schema).iter_errors(broken))  # int4 without its quantization record


def test_gptq_with_fp16(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    options = ExportOptions.from_flags(
        precision=Precision.of(Int4(block=32), Fp16()),
        calib_data=str(_ids(tmp_path / "calib.npy")),
        calib_samples=16,
        parity_tokens=8,
    )
    progress = RecordedProgress()
    result = export(ckpt, tmp_path / "out", options, progress)
    assert result.parity.passed and result.manifest.precision == "int4+fp16"
    # progress counts the decoder layers GPTQ quantizes one at a time (over 16 windows), and the trace's phases
    assert progress.stages["GPTQ: 14 weights, 16 windows, layer by layer"] == [2, 2]
    assert progress.stages["trace"] == [3, 3]
    quant = result.manifest.export.quantization
    assert quant is not None and quant["method"] == "gptq" and quant["calibration"]["windows"] == 16
    path = tmp_path / "out" / "onnx" / "decode.onnx"
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path)
    assert check_int4(ir.load(path)) == 14
    inits = {i.name: i for i in model.graph.initializer}
    scales = [inits[n.input[1]] for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(scales) == 14 and all(i.data_type == onnx.TensorProto.FLOAT16 for i in scales)  # the DQ outputs fp16


def test_gptq_hf_layer_by_layer_leaves_the_reference_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face decoder with a sliding-window and a full-attention layer (Qwen2): GPTQ runs
    its layers one at a time (progress per layer) and the graphs compute its int4 numbers (parity
    against them gates); when parity first runs the checkpoint's model, its weights are bit for
    bit what they were before the export (parity itself then makes it the quantized model)."""
    pytest.importorskip("transformers")
    import torch

    import kiln.exporter.pipeline as pipeline
    from kiln.plugins.hf import tiny_model

    loaded = tiny_model("qwen2-window", seed=1)
    before = {name: tensor.clone() for name, tensor in loaded.module.state_dict().items()}
    seen: list[dict[str, torch.Tensor]] = []
    check_parity = pipeline.check_parity

    def recording(module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        seen.append({name: tensor.clone() for name, tensor in module.state_dict().items()})
        return check_parity(module, *args, **kwargs)

    monkeypatch.setattr(pipeline, "check_parity", recording)
    options = ExportOptions.from_flags(
        precision=Precision.of(Int4(block=16)),
        calib_data=str(_ids(tmp_path / "calib.npy", vocab=128)),
        calib_samples=8,
        parity_tokens=8,
        parity_agreement="record",
    )
    progress = RecordedProgress()
    result = pipeline.export_loaded(loaded, tmp_path / "out", options, progress)
    assert result.parity.passed and progress.stages["GPTQ: 14 weights, 8 windows, layer by layer"] == [2, 2]
    assert len(seen) == 1 and sorted(seen[0]) == sorted(before)
    assert all(torch.equal(before[name], seen[0][name]) for name in before)


def test_gptq_refuses_a_cross_attention_decoder(tmp_path: Path) -> None:
    """Its calibration prompts carry no encoder states: one line saying so and what to use, before
    anything is written, not a traceback from the model; round to nearest is not refused by it."""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(cross_attention=True))
    calib = str(_ids(tmp_path / "calib.npy"))
    line = config_error(
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(tmp_path / "out"),
        "--int4",
        "--calib-data",
        calib,
        "--calib-samples",
        "2",
    )
    assert (
        line == "--int4-method gptq is not supported for cross-attention decoders yet: its calibration runs prompts "
        "without encoder_hidden_states; use --int4-method rtn"
    )
    assert not (tmp_path / "out").exists()
    from kiln.plugins import load_model

    rtn = Int4(method=Int4Method.RTN)
    assert rtn.reasons(load_model(ckpt).spec, ExportOptions(precision=Precision.of(rtn))) == []


def _block_dq_graph(k: int = 64, n: int = 8, block: int = 16) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, size=(k // block, n)).astype(np.float32)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([4, k]))
    w = ir.val("w", const_value=ir.Tensor(q, dtype=ir.DataType.INT4, name="w"))
    s = ir.val("s", const_value=ir.tensor(scale, name="s"))
    dq = ir.node("DequantizeLinear", [w, s], {"axis": 0, "block_size": block})
    mm = ir.node("MatMul", [x, dq.outputs[0]])
    mm.outputs[0].name, mm.outputs[0].dtype, mm.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([4, n])
    graph = ir.Graph([x], [mm.outputs[0]], nodes=[dq, mm], initializers=[w, s], opset_imports={"": 21})
    return ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString(), q, scale


def test_parity_sessions_compute_weight_only() -> None:
    """ONNX Runtime fuses DQ+MatMul into MatMulNBits with int8 activations by default; the parity
    session keeps the weight-only product (what TensorRT computes)."""
    model, q, scale = _block_dq_graph()
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    exact = x.astype(np.float64) @ (q * np.repeat(scale, 16, axis=0)).astype(np.float64)
    fused = ort_session(model).run(None, {"x": x})[0]
    checked = ort_session(model, weight_only_dq=True).run(None, {"x": x})[0]
    assert np.abs(checked - exact).max() / np.abs(exact).max() < 1e-5
    assert np.abs(fused - exact).max() / np.abs(exact).max() > 1e-4  # the trap this guards against


def _rule_error(edit: str) -> str:
    data, _, _ = _block_dq_graph()
    model = ir.serde.deserialize_model(onnx.load_from_string(data))
    dq = next(n for n in model.graph if n.op_type == "DequantizeLinear")
    if edit == "opset":
        model.opset_imports[""] = 19
    elif edit == "scale":
        dq.inputs[1].const_value = ir.tensor(-np.ones((4, 8), np.float32))  # type: ignore[union-attr]
    elif edit == "block":
        dq.attributes["block_size"] = ir.AttrInt64("block_size", 24)
    elif edit == "zero":
        zero = ir.val("z", const_value=ir.Tensor(np.ones((4, 8), np.int8), dtype=ir.DataType.INT4, name="z"))
        model.graph.register_initializer(zero)
        dq.replace_input_with(2, zero) if len(dq.inputs) > 2 else dq.resize_inputs(3)
        dq.replace_input_with(2, zero)
    with pytest.raises(ExportError) as err:
        check_int4(model)
    return str(err.value)


def test_rule_check_names_what_is_wrong() -> None:
    assert "needs opset 21, the graph has 19" in _rule_error("opset")
    assert "scales must be finite and > 0" in _rule_error("scale")
    assert (
        "expected axis 0, a block_size dividing K=64 and scale [K/B, N]; found axis 0, block_size 24, scale (4, 8)"
        in _rule_error("block")
    )
    assert "the zero point must be absent or a constant of zeros" in _rule_error("zero")


def test_bad_combinations_are_one_line(tiny_ckpt: Path, tmp_path: Path) -> None:
    base = ["export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out")]
    assert config_error(*base, "--int4") == (
        "--int4-method gptq (the default) needs --calib-data: a text file, .jsonl (field 'text') or .npy/.npz "
        "token ids; or pass --int4-method rtn"
    )
    assert (
        config_error(*base, "--int4", "--int8", "--calib-data", "synthetic")
        == "--int8 and --int4 are different precisions of the same MatMuls; choose one"
    )
    assert config_error(*base, "--int4-method", "rtn") == "--int4-method and --int4-block only apply to --int4 exports"
    assert config_error(*base, "--int4", "--int4-method", "rtn", "--calib-data", "synthetic") == (
        "--calib-data only applies to --int8, --fp8 and --int4 (method gptq) exports"
    )
    assert "--target ort rewrites fp32 graphs" in config_error(
        *base, "--int4", "--fp16", "--int4-method", "rtn", "--target", "ort"
    )
    assert "choose one" in config_error(*base, "--int4", "--int4-method", "rtn", "--target", "ort", "--ort-int8")
    assert (
        config_error(*base, "--int4-float", "*.fc2")
        == "--int4-float and --int4-all-matmuls only apply to --int4 exports"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="--int4-block must be one of 16, 32, 64, 128, 256, found 100"):
        ExportOptions(precision=Precision.of(Int4(method=Int4Method.RTN, block=100)))


def test_numbers_round_trip() -> None:
    q = np.random.default_rng(0).integers(-8, 8, size=(6, 5)).astype(np.int8)
    from kiln.exporter.int4.numbers import pack_int4

    assert np.array_equal(unpack_int4(pack_int4(q), q.shape), q)
    assert pack_int4(np.array([-8, 7], np.int8)).tobytes() == b"\x78"  # element 0 in the low nibble
