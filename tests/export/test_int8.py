"""--int8: explicit Q/DQ in the form TensorRT accepts, calibrated on real data, with caches."""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kiln.calibration import mse_threshold
from kiln.cli import main
from kiln.errors import CalibrationError, ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.plan import plan
from kiln.exporter.precision.int8 import check_qdq
from kiln.exporter.precision.kinds import Int8
from kiln_testing import edit_config, tiny_config, write_checkpoint


def _ids(path: Path, n: int = 4000, vocab: int = 101, seed: int = 0) -> Path:
    # token ids with structure (a repeating walk), not uniform noise
    rng = np.random.default_rng(seed)
    ids = (np.cumsum(rng.integers(1, 4, size=n)) % vocab).astype(np.int64)
    np.save(path, ids)
    return path


def _int8(tmp: Path, **changes: object) -> ExportOptions:
    fields: dict[str, object] = dict(
        precision=Precision.INT8,
        calib_data=str(_ids(tmp / "calib.npy")),
        calib_samples=8,
        calib_cache=tmp / "cache",
        parity_tokens=16,
    )
    fields.update(changes)
    return ExportOptions.from_flags(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("int8")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    export(ckpt, root / "out", _int8(root))
    return root / "out"


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def test_qdq_structure(int8_export: Path) -> None:
    for kind in ("prefill", "decode", "model"):
        path = int8_export / "onnx" / f"{kind}.onnx"
        onnx.checker.check_model(path, full_check=True)
        model = onnx.load(path)
        check_qdq(model)  # zero points int8 zeros, scales > 0, per-channel only on weights along N
        assert model.opset_import[0].version >= 19
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        producers = _producers(model)
        nodes = {n.name: n for n in model.graph.node}
        q_proj = nodes["/layers.0.attn.q_proj/MatMul"]
        act, weight = (producers[i] for i in q_proj.input)
        assert act.op_type == weight.op_type == "DequantizeLinear"
        assert inits[act.input[1]].shape == ()  # activation: per tensor
        assert inits[weight.input[0]].dtype == np.int8 and inits[weight.input[1]].shape == (
            inits[weight.input[0]].shape[1],
        )
        assert next(a.i for a in weight.attribute if a.name == "axis") == 1
        for name in ("/lm_head/MatMul", "/layers.0.attn/MatMul", "/layers.0.attn/MatMul_1"):
            assert all(
                producers.get(i) is None or producers[i].op_type != "DequantizeLinear" for i in nodes[name].input
            ), name


def test_manifest_parity_and_check(int8_export: Path) -> None:
    manifest = json.loads((int8_export / "manifest.json").read_text())
    assert manifest["precision"] == "int8" and manifest["kv_cache"]["dtype"] == "float32"
    quantized = manifest["graphs"]["decode"]["passes"]["int8"]["nodes"]
    assert "/layers.1.mlp.fc2/MatMul" in quantized and "/lm_head/MatMul" not in quantized
    assert manifest["export"]["calibration"]["settings"]["method"] == "max"
    report = json.loads((int8_export / "reports" / "parity.json").read_text())
    assert report["passed"] and report["tolerance"]["min_token_match"] == 0.9
    assert all(g["token_match_rate"] >= 0.9 for g in report["generation"])
    assert check_dir(int8_export, calib_data=int8_export.parent / "calib.npy").passed  # the scales run again too


def test_legacy_trt_cache(int8_export: Path) -> None:
    text = (int8_export / "calibration" / "decode.trt-calibration.cache").read_text().splitlines()
    assert text[0] == "TRT-101300-EntropyCalibration2"
    ranges = json.loads((int8_export / "reports" / "parity.json").read_text())["calibration"]
    assert ranges["cache"] == "written"
    cache = json.loads(next((int8_export.parent / "cache").glob("*.json")).read_text())
    assert len(text) > 1, "the cache holds no tensor's range"
    for line in text[1:]:
        m = re.fullmatch(r"(.+): ([0-9a-f]{8})", line)
        assert m, line
        lo, hi = cache["ranges"]["decode"][m.group(1)]
        assert struct.unpack(">f", bytes.fromhex(m.group(2)))[0] == pytest.approx(max(abs(lo), abs(hi)) / 127, rel=1e-6)


class _Recorded:
    """A ``Progress`` that records every stage: description -> [total, steps advanced]."""

    def __init__(self) -> None:
        self.stages: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[_Recorded]:
        self.stages[description] = [total, 0]
        self._current = description
        yield self

    def advance(self, steps: int = 1) -> None:
        self.stages[self._current][1] += steps

    def note(self, message: str) -> None:
        return None


def test_cache_reused_and_invalidated(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    progress = _Recorded()
    first = export(ckpt, tmp_path / "a", _int8(tmp_path, parity_tokens=4), progress).manifest.export.calibration
    # calibration is a stage per graph that counts its samples (8 windows), each done in full
    calibrating = {d: counts for d, counts in progress.stages.items() if d.startswith("calibrate")}
    assert calibrating == {f"calibrate {g}.onnx (max)": [8, 8] for g in ("prefill", "decode", "model")}
    progress = _Recorded()
    again = export(ckpt, tmp_path / "b", _int8(tmp_path, parity_tokens=4), progress).manifest.export.calibration
    assert (first["cache"], again["cache"], again["key"]) == ("written", "reused", first["key"])
    assert not [d for d in progress.stages if d.startswith("calibrate")]  # cached ranges: nothing to calibrate
    other = export(
        ckpt, tmp_path / "c", _int8(tmp_path, parity_tokens=4, calib_method="percentile")
    ).manifest.export.calibration
    assert other["cache"] == "written" and other["key"] != first["key"]
    other_data = _ids(tmp_path / "other.npy", seed=1)
    data = export(
        ckpt, tmp_path / "d", _int8(tmp_path, parity_tokens=4, calib_data=str(other_data))
    ).manifest.export.calibration
    assert data["cache"] == "written" and data["key"] not in (first["key"], other["key"])
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3


def test_a_checkpoint_whose_config_changed_is_calibrated_again(tmp_path: Path) -> None:
    """Same weights file, another config (another model): the cache's weights key covers every checkpoint file
    (it was the weights file's hash alone; a sharded checkpoint's first shard), so nothing calibrated on the
    other model is reused."""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    first = export(ckpt, tmp_path / "a", _int8(tmp_path, parity_tokens=4)).manifest.export.calibration
    edit_config(ckpt, rope_theta=500.0)
    progress = _Recorded()
    again = export(ckpt, tmp_path / "b", _int8(tmp_path, parity_tokens=4), progress).manifest.export.calibration
    assert again["cache"] == "written" and again["key"] != first["key"]
    assert [d for d in progress.stages if d.startswith("calibrate")] == [
        f"calibrate {g}.onnx (max)" for g in ("prefill", "decode", "model")
    ]


@pytest.mark.parametrize("method", ["entropy", "mse"])
def test_int8_fp16_demo_with_other_methods(tmp_path: Path, method: str) -> None:
    """On the trained demo model with its held-out text (clipping methods assume trained
    activations; a random tiny model has none of their outliers)."""
    from kiln.plugins import resolve_checkpoint

    text = resolve_checkpoint("demo") / "heldout.txt"
    options = _int8(
        tmp_path,
        precision=Precision.INT8_FP16,
        calib_method=method,
        calib_data=str(text),
        calib_samples=32,
        parity_tokens=64,
    )
    result = export("demo", tmp_path / "out", options)
    assert result.parity.passed and result.manifest.precision == "int8+fp16"
    model = onnx.load(tmp_path / "out" / "onnx" / "decode.onnx")
    check_qdq(model)
    scales = [i for i in model.graph.initializer if i.name.endswith("_scale")]
    assert scales and all(i.data_type == onnx.TensorProto.FLOAT16 for i in scales)  # DQ outputs fp16


def test_all_matmuls(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    manifest = export(
        ckpt, tmp_path / "out", _int8(tmp_path, precision=Precision.of(Int8(all_matmuls=True)), parity_tokens=4)
    ).manifest.to_json()
    assert "/lm_head/MatMul" in manifest["graphs"]["decode"]["passes"]["int8"]["nodes"]


def test_mse_threshold_trades_clipping_for_rounding() -> None:
    edges = np.linspace(0, 100, 101)
    hist = np.zeros(100)
    hist[:10] = 100_000  # a million values up to 10: rounding error over them dominates
    hist[99] = 1  # one outlier near 100: clipping it costs less than coarse steps for all
    assert 10 <= mse_threshold(hist, edges) < 30
    hist[:10] = 100  # a thousand values: now clipping the outlier costs more than the rounding
    assert mse_threshold(hist, edges) >= 99.0  # keeps (nearly) the whole range


def _error(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    return lines[-1]


def test_bad_calibration_inputs(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    out = str(tmp_path / "out")
    base = ["export", "--model", str(ckpt), "--out", out, "--int8", "--json", "--calib-cache", str(tmp_path / "cache")]
    assert "--int8 needs --calib-data" in _error(*base)
    (tmp_path / "empty.npy").write_bytes(b"")
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.int64))
    assert "the calibration data is empty" in _error(*base, "--calib-data", str(tmp_path / "empty.npy"))
    np.save(tmp_path / "big.npy", np.array([1, 2, 500, 3]))
    assert "1 token ids are outside the vocabulary [0, 101) (e.g. 500)" in _error(
        *base, "--calib-data", str(tmp_path / "big.npy")
    )
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n")
    assert "text calibration data needs the checkpoint's tokenizer.json" in _error(
        *base, "--calib-data", str(tmp_path / "text.txt")
    )
    assert "calibration data file not found" in _error(*base, "--calib-data", str(tmp_path / "nope.txt"))
    bad = CliRunner().invoke(main, [*base, "--calib-data", "synthetic", "--calib-method", "kl"])
    assert bad.exit_code == 2 and "'kl' is not one of 'max', 'percentile', 'entropy', 'mse'" in bad.stderr
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(ConfigError, match="--calib-method must be one of max, percentile, entropy, mse, found 'kl'"):
        plan(ExportOptions.from_flags(precision=Precision.INT8, calib_data="synthetic", calib_method="kl"))
    with pytest.raises(ConfigError, match="--calib-data only applies to --int8, --fp8 and --int4"):
        plan(ExportOptions.from_flags(calib_data="synthetic"))


def test_tokenizer_that_does_not_match(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["def f(x): return x * 2\n" * 50],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    tok.save(str(ckpt / "tokenizer.json"))
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 20)
    with pytest.raises(CalibrationError, match=r"the tokenizer has \d+ tokens but the model's vocabulary has 101"):
        export(ckpt, tmp_path / "out", _int8(tmp_path, calib_data=str(tmp_path / "text.txt")))
    assert not (tmp_path / "out").exists()


def test_int8_manifests_match_the_schema(int8_export: Path) -> None:
    from importlib import resources

    from jsonschema import Draft202012Validator

    schema = json.loads((resources.files("kiln.exporter.artifacts") / "manifest.schema.json").read_text())
    manifest = json.loads((int8_export / "manifest.json").read_text())
    Draft202012Validator(schema).validate(manifest)
    broken = {**manifest, "export": {**manifest["export"], "calibration": None}}
    assert list(Draft202012Validator(schema).iter_errors(broken))  # int8 without calibration is invalid


@pytest.mark.parametrize("case", ["gpt2", "qwen3-moe"])
def test_conv1d_and_moe_decoders(tmp_path: Path, case: str) -> None:
    """Issue 40: GPT-2's Conv1D (a Gemm with a bias) is quantized as MatMul + a float bias Add, not
    with the int32 bias DequantizeLinear ONNX Runtime's quantizer writes for a Gemm (TensorRT cannot
    parse one); Qwen3-MoE's router (a transposed Gemm) and fused experts (weights read through a
    Gather) stay float. Both pass parity and are proved against their Q/DQ model."""
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    tiny_model(case, seed=1).module.model.save_pretrained(ckpt, safe_serialization=True)
    result = export(ckpt, out, _int8(tmp_path, calib_data="synthetic", parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    manifest = json.loads((out / "manifest.json").read_text())
    for kind, graph in manifest["graphs"].items():
        model = onnx.load(out / graph["file"])
        assert check_qdq(model) > 0, kind
        nodes = {n.name: n for n in model.graph.node}
        quantized = graph["passes"]["int8"]["nodes"]
        assert quantized and all(nodes[name].op_type == "MatMul" for name in quantized), (kind, quantized)
        inits = {i.name: i.data_type for i in model.graph.initializer}
        dq_types = {inits.get(n.input[0]) for n in model.graph.node if n.op_type == "DequantizeLinear"}
        assert onnx.TensorProto.INT32 not in dq_types, kind
        if case == "gpt2":
            assert "/model.transformer.h.1.attn.c_attn/MatMul" in quantized, quantized
            assert nodes["/model.transformer.h.1.attn.c_attn/Add"].op_type == "Add"
        else:
            router = nodes["/model.model.layers.1.mlp.gate/Gemm"]
            assert router.name not in quantized and all(i in inits for i in router.input[1:]), router
            assert "/model.model.layers.1.mlp.experts/MatMul" in nodes, kind
            assert not any(".experts/" in name for name in quantized), quantized
            assert "/model.model.layers.1.self_attn.q_proj/MatMul" in quantized, quantized
    proof = json.loads((out / "reports" / "parity.json").read_text())["quantized"]
    assert proof is not None and proof["passed"] and proof["generation"], proof
