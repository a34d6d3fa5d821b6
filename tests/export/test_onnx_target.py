"""``--target onnx``: graphs in ONNX's own operators (opset 24 ``Attention``, ``RMSNormalization``,
a static KV cache written by ``TensorScatter``), really run by ONNX Runtime: parity (tensors and
greedy tokens, left-padded batches) through the static contract at export and in ``kiln check``,
``onnx.checker``'s full check on every graph, greedy tokens through the in-place loop equal to the
portable graphs' and to transformers' ``generate()``, and no step copying the cache."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from jsonschema import Draft202012Validator

from kiln.errors import ConfigError
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind
from kiln.exporter.contract.static_cache import static_io
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import ExportResult, export
from kiln.exporter.plan import plan
from kiln.exporter.precision.kinds import Fp16, Int4, Int8
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.runtime.generate import Generator

PARITY_TOKENS = 12
COPY_WARNING = "in-place optimization not activated"  # ONNX Runtime's TensorScatter, when it copies past to present


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _assert_checked(result: ExportResult, precision: str = "fp32") -> None:
    parity = result.parity
    assert parity.passed, parity.failures()
    assert parity.targets["onnx"].precision == precision and parity.targets["onnx"].passed
    assert parity.targets["onnx"].backend == "onnxruntime (static cache)"
    assert {"prefill.onnx", "decode.onnx", "model.onnx"} <= {t.graph for t in parity.tensors}
    own = {"fp32": {(1e-5, 1e-4)}, "fp16": {(5e-2, 5e-3), (2e-2, 5e-3)}}[
        precision
    ]  # the precision's own tolerances (logits, KV)
    assert {(t.atol, t.rtol) for t in parity.tensors if t.graph.endswith(".onnx")} == own
    runs = {(g.path, g.batch) for g in parity.generation}
    assert {("onnx:prefill+decode", 1), ("onnx:prefill+decode", 3), ("onnx:model", 1), ("onnx:model", 3)} <= runs


def _assert_graphs(
    out: Path, n_layers: int, n_norms: int | None, max_context: int, precision: str = "fp32", decomposed: int = 0
) -> dict:
    """The target's graphs as the manifest records them: checked, opset 24, every layer's cache in
    place, ``decomposed`` of them (soft-capped: Gemma 2) read with MatMul/Softmax, the rest with
    ``Attention``."""
    manifest = json.loads((out / "manifest.json").read_text())
    schema = json.loads((Path(__file__).parents[2] / "exporter" / "artifacts" / "manifest.schema.json").read_text())
    assert not [e.message for e in Draft202012Validator(schema).iter_errors(manifest)]
    entry = manifest["targets"]["onnx"]
    assert (entry["precision"], entry["kv_cache"], entry["weights"]["file"]) == (
        precision,
        "static",
        "onnx/weights.std.bin",
    )
    kv_dtype = {
        "fp32": "float32",
        "fp16": "float16",
        "int4": "float32",
        "int4+fp16": "float16",
        "int8": "float32",
        "int8+fp16": "float16",
        "fp8": "float16",
    }[precision]
    for kind in DECODER_KINDS:
        graph = entry["graphs"][kind.value]
        path = out / graph["file"]
        assert graph["file"] == f"onnx/{kind.value}.std.onnx" and graph["file"] in manifest["files"]
        onnx.checker.check_model(str(path), full_check=True)  # types and shapes inferred through every node
        model = onnx.load(str(path), load_external_data=False)
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 24)] and model.ir_version == 11
        ops = _ops(path)
        assert ops["Attention"] == n_layers - decomposed and ops["TensorScatter"] == 2 * n_layers, ops
        portable = _ops(out / manifest["graphs"][kind.value]["file"])
        assert ops["Softmax"] == portable["Softmax"] - n_layers + decomposed and not {
            op for op in ops if op in ("GroupQueryAttention", "SimplifiedLayerNormalization")
        }, ops
        if n_norms is not None:
            assert ops["RMSNormalization"] == n_norms and ops["ReduceMean"] == 0, ops
        # the recorded contract is the static one, and the graph's own
        io = static_io(_spec(manifest), kind, max_context=max_context, kv_dtype=kv_dtype)
        assert graph["inputs"] == [t.to_dict() for t in io.inputs] and graph["outputs"] == [
            t.to_dict() for t in io.outputs
        ]
        assert [t["name"] for t in graph["inputs"]] == io.input_names == [i.name for i in model.graph.input]
        assert [t["name"] for t in graph["outputs"]] == io.output_names == [o.name for o in model.graph.output]
        caches = [
            t
            for t in graph["inputs"] + graph["outputs"]
            if "key_values" in t["name"] or t["name"].startswith("present.")
        ]
        assert caches and all(t["shape"][2] == max_context for t in caches)
        # every present is a TensorScatter's output, and every cache input is read by TensorScatter only
        producers = {o: n.op_type for n in model.graph.node for o in n.output}
        assert {producers[o.name] for o in model.graph.output if o.name.startswith("present.")} == {"TensorScatter"}
        readers = {n.op_type for n in model.graph.node for i in n.input if i.startswith("past_key_values.")}
        assert readers <= {"TensorScatter", "Shape"}, readers
        attention = entry["graphs"][kind.value]["passes"]["attention"]
        assert attention["layers"] == list(range(n_layers))
        assert len(attention.get("decomposed", {}).get("layers", [])) == decomposed, attention
        rotated = entry["graphs"][kind.value]["passes"].get("rotary", {}).get("layers", [])
        assert ops["RotaryEmbedding"] == 2 * len(rotated), ops  # q and k of each layer the report lists
    assert verify_dir(out).ok
    return manifest


def _spec(manifest: dict):  # the manifest's model numbers, as static_io takes them
    from kiln.plugins.base import DecoderSpec

    m = manifest["model"]
    return DecoderSpec(manifest["family"], m["n_layers"], m["n_kv_heads"], m["head_dim"], m["vocab_size"], None)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ExportResult]:
    from kiln_testing import tiny_config, write_checkpoint

    root = tmp_path_factory.mktemp("native_onnx")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    out = root / "out"
    return out, export(ckpt, out, ExportOptions.from_flags(max_batch=4, target="onnx", parity_tokens=PARITY_TOKENS))


def test_native_exports_checks_and_reruns(native: tuple[Path, ExportResult]) -> None:
    out, result = native
    _assert_checked(result)
    # 2 layers x (attention norm, PLE norm, MLP norm) + the final norm
    manifest = _assert_graphs(out, n_layers=2, n_norms=7, max_context=result.manifest.limits.max_context)
    assert manifest["graphs"]["decode"]["file"] == "onnx/decode.onnx"  # the portable graphs are untouched
    passes = manifest["targets"]["onnx"]["graphs"]["decode"]["passes"]
    assert passes["rotary"] == {"layers": [0, 1]} and "not_fused" not in passes  # every rotary is RotaryEmbedding
    assert _ops(out / "onnx" / "decode.std.onnx")["Neg"] == 0  # rotate_half is gone
    checked = check_dir(out)  # kiln check re-runs parity through the static contract
    assert checked.passed and {"decode", "decode.onnx"} <= {t.graph for t in checked.tensors}
    assert {g.path for g in checked.generation} == {"prefill+decode", "model", "onnx:prefill+decode", "onnx:model"}


def test_in_place_loop_equals_the_portable_loop(native: tuple[Path, ExportResult]) -> None:
    """kiln generate --target onnx: one buffer per cache tensor, bound as past and present of
    every step; its tokens and logits are the portable loop's, and the buffer holds exactly the
    keys of the tokens run (the prompt and every fed token), zeros beyond."""
    out, _ = native
    static, concat = Generator(out, target="onnx"), Generator(out)
    assert (static.kv_cache, concat.kv_cache) == ("static-buffer", "concat")
    prompt = [11, 42, 7, 3, 99, 15]
    a = static.run(prompt, 24, stop_at_eos=False, keep_logits=True)
    b = concat.run(prompt, 24, stop_at_eos=False, keep_logits=True)
    assert a.tokens == b.tokens and len(a.tokens) == 24
    assert a.logits is not None and b.logits is not None
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)
    buffers = static._kv.buffers  # type: ignore[attr-defined]
    written = len(prompt) + len(a.tokens) - 1  # the last token chosen is never fed
    for buffer in buffers.values():
        array = buffer.numpy()
        assert array.shape[2] == static.max_context
        assert np.abs(array[:, :, :written]).sum(axis=-1).all()  # every slot run holds a key or value
        assert not array[:, :, written:].any()  # nothing beyond


def _in_place_greedy(out: Path, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Greedy tokens of a left-padded batch through prefill.std + decode.std, every step bound to
    the same zeroed buffers as past and present (IOBinding), write_indices = the tokens before."""
    import onnxruntime as ort

    from kiln.exporter.contract.steps import left_pad

    prefill, decode = (
        ort.InferenceSession(str(out / "onnx" / f"{k}.std.onnx"), providers=["CPUExecutionProvider"])
        for k in ("prefill", "decode")
    )
    ids, mask, pos = left_pad(prompts, 0)
    pasts = [i for i in decode.get_inputs() if i.name.startswith("past_key_values.")]
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    buffers = {
        p.name: ort.OrtValue.ortvalue_from_numpy(np.zeros((len(prompts), *p.shape[1:]), dtypes[p.type])) for p in pasts
    }
    tokens = []
    feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    for step in range(steps):
        session = prefill if step == 0 else decode
        binding = session.io_binding()
        binding.bind_output("logits", "cpu")
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name, buffer in buffers.items():
            binding.bind_ortvalue_input(name, buffer)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), buffer)
        session.run_with_iobinding(binding)
        tokens.append(binding.get_outputs()[0].numpy()[:, -1].argmax(-1))
        written = mask.shape[1]
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        feeds = {
            "input_ids": tokens[-1][:, None].astype(np.int64),
            "attention_mask": mask,
            "position_ids": pos,
            "write_indices": np.full(len(prompts), written, np.int64),
        }
    return np.stack(tokens, axis=1)


def test_left_padded_batch_in_place_equals_pytorch(native: tuple[Path, ExportResult]) -> None:
    """A left-padded batch of three through the in-place loop: PyTorch's greedy tokens, row by row."""
    from kiln.exporter.parity import greedy
    from kiln.exporter.runners import TorchRunner
    from kiln.plugins import load_model

    out, result = native
    prompts = [[11, 42, 7, 3, 99, 15], [5, 8], [23, 1, 9]]
    loaded = load_model(out.parent / "ckpt")
    want, _ = greedy(TorchRunner(loaded.module, loaded.spec.n_layers), loaded.spec, prompts, 16)
    np.testing.assert_array_equal(_in_place_greedy(out, prompts, 16), want)


def _decode_step(out: Path, *, one_buffer: bool) -> tuple[list[int], list[int]]:
    """One decode step of decode.std.onnx at warning log level, each cache bound as past and as
    present either to ONE OrtValue or to two; the data pointers of the buffers and of the
    presents the step returned."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 1  # info and up: TensorScatter's copy warning is logged
    session = ort.InferenceSession(str(out / "onnx" / "decode.std.onnx"), options, providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    binding = session.io_binding()
    binding.bind_output("logits", "cpu")
    feeds = {
        "input_ids": np.array([[5]]),
        "attention_mask": np.ones((1, 4), np.int64),
        "position_ids": np.array([[3]]),
        "write_indices": np.array([3]),
    }
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    buffers = []
    for past in pasts:
        buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, *past.shape[1:]), np.float32))
        present = buffer if one_buffer else ort.OrtValue.ortvalue_from_numpy(np.zeros((1, *past.shape[1:]), np.float32))
        binding.bind_ortvalue_input(past.name, buffer)
        binding.bind_ortvalue_output(past.name.replace("past_key_values.", "present."), present)
        buffers.append(buffer.data_ptr())
    session.run_with_iobinding(binding)
    return buffers, [o.data_ptr() for o in binding.get_outputs()[1:]]


def test_no_step_copies_the_cache(native: tuple[Path, ExportResult], capfd: pytest.CaptureFixture[str]) -> None:
    """With one OrtValue bound as past and present (what kiln generate binds), the step's presents
    are the buffers themselves and ONNX Runtime logs no copy; bound to two buffers (the control,
    proving the check can fail) it copies every cache tensor and says so."""
    out, result = native
    buffers, presents = _decode_step(out, one_buffer=True)
    assert presents == buffers
    assert COPY_WARNING not in capfd.readouterr().err
    _, copied = _decode_step(out, one_buffer=False)
    assert copied != buffers
    assert capfd.readouterr().err.count(COPY_WARNING) == 2 * result.report.spec.n_layers


def test_native_fp16(tmp_path: Path) -> None:
    """--fp16 --target onnx: the fp16 graphs' attention (its softmax an fp32 island) becomes an fp16
    Attention over fp16 static buffers; fp16 parity, and the in-place loop's tokens are the
    portable fp16 loop's."""
    from kiln_testing import tiny_config, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    out = tmp_path / "out"
    result = export(
        ckpt,
        out,
        ExportOptions.from_flags(max_batch=4, target="onnx", precision=Precision.FP16, parity_tokens=PARITY_TOKENS),
    )
    _assert_checked(result, "fp16")
    manifest = _assert_graphs(
        out, n_layers=2, n_norms=7, max_context=result.manifest.limits.max_context, precision="fp16"
    )  # every RMSNorm island fused
    assert manifest["targets"]["onnx"]["graphs"]["decode"]["inputs"][4]["dtype"] == "float16"
    passes = manifest["targets"]["onnx"]["graphs"]["decode"]["passes"]
    assert (
        passes["rms_norm_fp16"] == {"fused": 7}
        and passes["rms_norm"] == {"fused": 0}
        and "rms_norm" not in passes.get("not_fused", {})
    )
    for kind in (
        DECODER_KINDS
    ):  # each norm reads fp32 casts of the fp16 stream and weight (fp32 statistics by type), its output cast to fp16
        graph = onnx.load(str(out / "onnx" / f"{kind.value}.std.onnx"), load_external_data=False).graph
        producers = {o: n for n in graph.node for o in n.output}
        readers = {i: n for n in graph.node for i in n.input}
        norms = [n for n in graph.node if n.op_type == "RMSNormalization"]
        ones = {i.name: i.data_type for i in graph.initializer if i.name.startswith("ort/ones")}
        scales = Counter("ones" if n.input[1] in ones else producers[n.input[1]].op_type for n in norms)
        assert scales == {"Cast": 5, "ones": 2} and set(ones.values()) == {
            onnx.TensorProto.FLOAT
        }  # each PLE norm's scale is fp32 ones
        assert {(producers[n.input[0]].op_type, readers[n.output[0]].op_type) for n in norms} == {("Cast", "Cast")}
        assert {next(a.i for a in n.attribute if a.name == "stash_type") for n in norms} == {1}
        assert {
            next(a.i for a in producers[i].attribute if a.name == "to") for n in norms for i in n.input if i not in ones
        } == {onnx.TensorProto.FLOAT}
        assert not {n.op_type for n in graph.node} & {"ReduceMean", "Pow", "Sqrt", "Reciprocal"}
    prompt = [11, 42, 7, 3, 99, 15]
    static = Generator(out, target="onnx").run(prompt, 16, stop_at_eos=False)
    assert static.tokens == Generator(out).run(prompt, 16, stop_at_eos=False).tokens


@pytest.mark.parametrize("fp16", [False, True])
def test_native_int4(fp16: bool, tmp_path: Path) -> None:
    """--int4 (RTN) --target onnx: the portable graphs' block-DequantizeLinear weights are kept,
    the attention rewritten; int4 parity, and the in-place loop's tokens are the portable loop's."""
    from kiln_testing import tiny_config, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    out = tmp_path / "out"
    rtn = Int4(method=Int4Method.RTN)
    precision = Precision.of(rtn, Fp16()) if fp16 else Precision.of(rtn)
    result = export(
        ckpt,
        out,
        ExportOptions.from_flags(max_batch=4, target="onnx", precision=precision, parity_tokens=PARITY_TOKENS),
    )
    assert result.parity.passed, result.parity.failures()
    assert result.parity.targets["onnx"].precision == precision.value
    _assert_graphs(
        out, n_layers=2, n_norms=7, max_context=result.manifest.limits.max_context, precision=precision.value
    )  # every norm fused, the fp16 ones too
    for kind in DECODER_KINDS:
        portable, static = _ops(out / "onnx" / f"{kind.value}.onnx"), _ops(out / "onnx" / f"{kind.value}.std.onnx")
        assert static["DequantizeLinear"] == portable["DequantizeLinear"] > 0  # every int4 weight kept
    prompt = [11, 42, 7, 3, 99, 15]
    assert (
        Generator(out, target="onnx").run(prompt, 16, stop_at_eos=False).tokens
        == Generator(out).run(prompt, 16, stop_at_eos=False).tokens
    )


def test_a_static_graph_not_matching_its_recorded_contract_is_caught(
    native: tuple[Path, ExportResult], tmp_path: Path
) -> None:
    """verify reads the target graphs' own recorded inputs (not the portable contract's): a
    manifest claiming another capacity, or a graph swapped for the portable one, is reported."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(native[0], out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["targets"]["onnx"]["graphs"]["decode"]["inputs"][4]["shape"][2] = 99
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_dir(out).structure
    assert len(problems) == 1 and problems[0].startswith(
        "graph onnx/decode.std.onnx: its inputs are not the ones the manifest records"
    ), problems
    manifest["targets"]["onnx"]["graphs"]["decode"]["inputs"][4]["shape"][2] = native[1].manifest.limits.max_context
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert not verify_dir(out).structure
    shutil.copy(
        out / "onnx" / "decode.onnx", out / "onnx" / "decode.std.onnx"
    )  # the portable graph under the static one's name
    problems = [p for p in verify_dir(out).structure if "decode.std.onnx" in p]
    assert any("its inputs are not the ones the manifest records" in p for p in problems), problems


def _calibrated_export(tmp_path: Path, out: Path, precision: Precision) -> ExportResult:
    """The native tiny model exported ``--target onnx`` at a calibrated precision (int8, fp8), parity
    passed and the target's graphs at that precision."""
    from kiln_testing import tiny_config, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    rng = np.random.default_rng(0)
    np.save(tmp_path / "calib.npy", (np.cumsum(rng.integers(1, 4, size=4000)) % 101).astype(np.int64))
    options = ExportOptions.from_flags(
        max_batch=4,
        target="onnx",
        precision=precision,
        calib_data=str(tmp_path / "calib.npy"),
        calib_samples=8,
        parity_tokens=PARITY_TOKENS,
    )
    result = export(ckpt, out, options)
    assert result.parity.passed, result.parity.failures()
    assert result.parity.targets["onnx"].precision == precision.value
    return result


def test_native_fp8(tmp_path: Path) -> None:
    """--fp8 --target onnx: the portable graphs' Q/DQ kept (the attention MatMuls are float), the
    attention rewritten, TensorRT's fp8 rules checked again; fp8 parity, and the in-place loop's
    tokens are the portable loop's."""
    import onnx_ir as ir

    from kiln.exporter.precision.qdq_rules import check_qdq

    precision = Precision.FP8
    out = tmp_path / "out"
    result = _calibrated_export(tmp_path, out, precision)
    _assert_graphs(
        out, n_layers=2, n_norms=7, max_context=result.manifest.limits.max_context, precision=precision.value
    )  # every norm fused, the fp16 ones too
    for kind in DECODER_KINDS:
        portable, static = _ops(out / "onnx" / f"{kind.value}.onnx"), _ops(out / "onnx" / f"{kind.value}.std.onnx")
        assert (static["QuantizeLinear"], static["DequantizeLinear"]) == (
            portable["QuantizeLinear"],
            portable["DequantizeLinear"],
        ) and portable["QuantizeLinear"] > 0
        assert (
            check_qdq(ir.load(out / "onnx" / f"{kind.value}.std.onnx")) == static["DequantizeLinear"]
        )  # TensorRT's fp8 rules, on the rewritten graph
    prompt = [11, 42, 7, 3, 99, 15]
    assert (
        Generator(out, target="onnx").run(prompt, 16, stop_at_eos=False).tokens
        == Generator(out).run(prompt, 16, stop_at_eos=False).tokens
    )


class _AsWritten:
    """The portable prefill and decode graphs run exactly as written: ONNX Runtime sessions with its
    graph optimizations off (a parity ``Runner``)."""

    name = "onnxruntime (as written)"

    def __init__(self, out: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        self._sessions = {
            kind: ort.InferenceSession(
                str(out / "onnx" / f"{kind.value}.onnx"), options, providers=["CPUExecutionProvider"]
            )
            for kind in (GraphKind.PREFILL, GraphKind.DECODE)
        }

    def graphs(self) -> tuple[GraphKind, ...]:
        return tuple(self._sessions)

    def run(self, kind: GraphKind, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._sessions[kind]
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT8_FP16])
def test_native_int8(precision: Precision, tmp_path: Path) -> None:
    """--int8 [--fp16] --target onnx: every Q/DQ of the portable graphs kept (the attention score
    MatMuls are float), written without zero points, the QuantizeLinears saying output_dtype INT8
    (``precision.int8_form``: with explicit int8 zero points a default ONNX Runtime session cannot
    load these opset-24 graphs), TensorRT's rules checked again; int8 parity; each graph loads in a
    default session; the in-place loop's greedy tokens (batch 1, and a left-padded batch of three)
    are those of the portable graphs run as written. With --int8 alone, ONNX Runtime's default
    session runs the portable graphs otherwise (it fuses their Q/DQ MatMuls into QLinearMatMul over
    uint8 activations; measured 0.38 off their own prefill logits here, and other greedy tokens),
    so the reference loop turns its graph optimizations off; with --fp16 the default portable
    loop is that reference too, and its tokens are asserted as well."""
    import onnx_ir as ir
    import onnxruntime as ort

    from kiln.exporter.parity import greedy
    from kiln.exporter.precision.qdq_rules import check_qdq

    out = tmp_path / "out"
    result = _calibrated_export(tmp_path, out, precision)
    assert {(t.atol, t.rtol) for t in result.parity.tensors if t.graph.endswith(".onnx")} == {
        (1.5, 0.05),
        (1.0, 0.05),
    }  # int8's own tolerances
    _assert_graphs(
        out, n_layers=2, n_norms=7, max_context=result.manifest.limits.max_context, precision=precision.value
    )
    for kind in DECODER_KINDS:
        portable, path = out / "onnx" / f"{kind.value}.onnx", out / "onnx" / f"{kind.value}.std.onnx"
        counts = _ops(portable), _ops(path)
        assert [(c["QuantizeLinear"], c["DequantizeLinear"]) for c in counts] == [
            (22, 36)
        ] * 2  # 14 weights, 22 activations (q/k/v and gate/fc1 share one)
        graph = onnx.load(str(path), load_external_data=False).graph
        qdq = [n for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
        assert all(len(n.input) == 2 for n in qdq)
        assert {(a.name, a.i) for n in qdq if n.op_type == "QuantizeLinear" for a in n.attribute} == {
            ("output_dtype", onnx.TensorProto.INT8)
        }
        assert check_qdq(ir.load(path)) == 36
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # a default session loads it
    spec = result.report.spec
    kv = np.dtype(np.float16 if precision.float16 else np.float32)
    prompt, prompts = [11, 42, 7, 3, 99, 15], [[11, 42, 7, 3, 99, 15], [5, 8], [23, 1, 9]]
    as_written = _AsWritten(out)
    in_place = list(Generator(out, target="onnx").run(prompt, 16, stop_at_eos=False).tokens)
    assert in_place == greedy(as_written, spec, [prompt], 16, kv_dtype=kv)[0][0].tolist()
    np.testing.assert_array_equal(
        _in_place_greedy(out, prompts, 16), greedy(as_written, spec, prompts, 16, kv_dtype=kv)[0]
    )
    if precision.float16:
        assert in_place == list(Generator(out).run(prompt, 16, stop_at_eos=False).tokens)


def test_int8_all_matmuls_refused_by_name() -> None:
    """--int8-all-matmuls quantizes the attention score MatMuls, which --target onnx makes each
    layer's Attention: measured, the export then stopped with "the attention of layer(s) [0, 1] is
    not the pattern --target onnx rewrites"; now the options are refused before any work."""
    with pytest.raises(ConfigError) as err:
        plan(
            ExportOptions.from_flags(
                target="onnx", precision=Precision.of(Int8(all_matmuls=True)), calib_data="synthetic"
            )
        )
    assert str(err.value) == (
        "config: --target onnx does not take --int8-all-matmuls: it writes each layer's attention as one ONNX "
        "Attention, whose score MatMuls are float; "
        "drop --int8-all-matmuls, or export without --target onnx"
    )
    plan(
        ExportOptions.from_flags(
            target="onnx", precision=Precision.of(Int8(float_rules=("*.fc2",)), Fp16()), calib_data="synthetic"
        )
    )  # --int8-float is taken


# the windowed cases (window 4, shorter than their parity runs) prove the static mask's window;
# gemma2/gemma3 soft-cap their scores: those layers read the in-place cache with plain ops
HF_CASES = [
    "llama", "qwen3", "gpt2", "phi3-partial", "smollm3", "mistral-window", "mixtral-window", "qwen2-window",
    "starcoder2-window", "qwen3-moe", "gemma", "gemma2-window", "gemma3-window",
]  # fmt: skip
WINDOWS = {
    "mistral-window": {"0": 4, "1": 4},
    "mixtral-window": {"0": 4, "1": 4},
    "starcoder2-window": {"0": 4, "1": 4},
    "qwen2-window": {"1": 4},
    "gemma2-window": {"0": 4},
    "gemma3-window": {"0": 4},
}
# issue 23's cases for fp16 and int4: one of each attention form (GQA, qk-norm, soft-capping, partial
# rotary, windows, Conv1D, MoE, NoPE layers)
ISSUE_CASES = ["llama", "qwen3", "gemma2-window", "phi3-partial", "mistral-window", "gpt2", "mixtral-window", "smollm3"]
INT4_CASES = [c for c in ISSUE_CASES if c != "gemma2-window"]  # gemma2: test_hf_int4_agreement_refuses_a_near_tie_model
INT4_BLOCK = 16  # the tiny models' K (32, 64) hold whole blocks of 16
PROMPT = [5, 17, 3, 29, 11]


def _hf_export(case: str, tmp_path: Path, **options) -> tuple[object, Path, ExportResult]:
    """The tiny random model of ``case``, saved by transformers and exported --target onnx."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    model = tiny_model(case, seed=1).module.model
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    model.save_pretrained(ckpt, safe_serialization=True)
    return (
        model,
        out,
        export(ckpt, out, ExportOptions.from_flags(max_batch=4, target="onnx", parity_tokens=8, **options)),
    )


def _decomposed(result: ExportResult) -> int:
    """How many layers soft-cap their scores: every layer of Gemma 2 (Gemma 3's config carries
    ``attn_logit_softcapping`` but its attention never reads it: its graphs hold no Tanh)."""
    return result.report.spec.n_layers if result.report.spec.config.get("model_type") == "gemma2" else 0


def _transformers_tokens(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return want[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_generation_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    """Parity passes, and greedy tokens through the in-place loop (batch 1) equal transformers'
    own generate() with its own cache."""
    model, out, result = _hf_export(case, tmp_path)
    _assert_checked(result)
    n_layers = result.report.spec.n_layers
    manifest = _assert_graphs(
        out,
        n_layers=n_layers,
        n_norms=None,
        max_context=result.manifest.limits.max_context,
        decomposed=_decomposed(result),
    )
    attention = manifest["targets"]["onnx"]["graphs"]["decode"]["passes"]["attention"]
    assert attention.get("windows", {}) == WINDOWS.get(case, {})
    if _decomposed(result):
        assert (
            attention["decomposed"]["layers"] == list(range(n_layers)) and "softcap" in attention["decomposed"]["why"]
        )
    assert list(Generator(out, target="onnx").run(PROMPT, 16, stop_at_eos=False).tokens) == _transformers_tokens(
        model, PROMPT, 16
    )


@pytest.mark.parametrize("case", ISSUE_CASES)
def test_hf_fp16_generation_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    """--fp16 --target onnx: fp16 parity, and the in-place loop's greedy tokens equal the portable
    fp16 loop's and transformers' generate() of the model in fp16."""
    model, out, result = _hf_export(case, tmp_path, precision=Precision.FP16)
    _assert_checked(result, "fp16")
    _assert_graphs(
        out,
        n_layers=result.report.spec.n_layers,
        n_norms=None,
        max_context=result.manifest.limits.max_context,
        precision="fp16",
        decomposed=_decomposed(result),
    )
    static = list(Generator(out, target="onnx").run(PROMPT, 16, stop_at_eos=False).tokens)
    assert static == list(Generator(out).run(PROMPT, 16, stop_at_eos=False).tokens)
    assert static == _transformers_tokens(model.half(), PROMPT, 16)


def _rtn_int4(model, block: int) -> int:
    """kiln's RTN int4 numbers (``int4_numbers``) written back, dequantized, into every Linear and
    Conv1D of ``model`` but the LM head: the model an --int4 export computes. How many it wrote."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from kiln.exporter.int4.numbers import dequantize, layer_block, rtn

    written = 0
    for name, module in model.named_modules():
        if name.endswith("lm_head") or not isinstance(module, (torch.nn.Linear, Conv1D)):
            continue
        linear = isinstance(module, torch.nn.Linear)  # Linear stores [N, K], Conv1D [K, N]
        weight = module.weight.detach().float().numpy()
        weight = weight.T if linear else weight
        b = layer_block(weight.shape[0], block)
        assert b is not None, name
        q, scale = rtn(weight, b, np.dtype(np.float32))
        dq = dequantize(q, scale)
        module.weight.data = torch.from_numpy(np.ascontiguousarray(dq.T if linear else dq)).to(module.weight.dtype)
        written += 1
    return written


def _assert_greedy_up_to_ties(model, prompt: list[int], tokens: list[int]) -> None:
    """Each of ``tokens`` is ``model``'s greedy choice given the ones before it (teacher-forced), or
    within a rounding tie of it (1e-5 + 1e-3 * the row's largest logit), and at least 90% exactly."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    exact = 0
    for step, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        best = int(row.argmax())
        gap, tie = float(row[best] - row[token]), 1e-5 + 1e-3 * float(row.abs().max())
        assert gap <= tie, f"step {step}: token {token} is {gap:.3g} below the greedy {best} (tie {tie:.3g})"
        exact += best == token
    assert exact >= 0.9 * len(tokens), f"{exact} of {len(tokens)} exactly greedy"


@pytest.mark.parametrize("case", INT4_CASES)
def test_hf_int4_generation_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    """--int4 (RTN) --target onnx: every Linear/Conv1D but the LM head is an int4 DQ weight (GPT-2's
    Conv1D Gemms too), the in-place loop's tokens equal the portable loop's, and they are the greedy
    tokens of the transformers model holding the same int4 numbers."""
    from kiln.exporter.precision.kinds.int4 import Int4Method

    model, out, result = _hf_export(
        case, tmp_path, precision=Precision.of(Int4(method=Int4Method.RTN, block=INT4_BLOCK))
    )
    assert result.parity.passed, result.parity.failures()
    _assert_graphs(
        out,
        n_layers=result.report.spec.n_layers,
        n_norms=None,
        max_context=result.manifest.limits.max_context,
        precision="int4",
    )
    written = _rtn_int4(model, INT4_BLOCK)
    for kind in DECODER_KINDS:
        assert (
            _ops(out / "onnx" / f"{kind.value}.std.onnx")["DequantizeLinear"]
            == _ops(out / "onnx" / f"{kind.value}.onnx")["DequantizeLinear"]
            == written
        )
    static = list(Generator(out, target="onnx").run(PROMPT, 16, stop_at_eos=False).tokens)
    assert static == list(Generator(out).run(PROMPT, 16, stop_at_eos=False).tokens)
    _assert_greedy_up_to_ties(model, PROMPT, static)


def test_hf_int4_near_tie_model_agrees_by_its_ties(tmp_path: Path) -> None:
    """The tiny random Gemma 2's logits are near-ties at most steps: int4 changes its greedy tokens
    there, within int4's own tolerance. Even with --parity-agreement gate the export is written:
    those near-ties count as agreement (issue 40: the agreement floor refused this correct graph)."""
    from kiln.exporter.precision.kinds.int4 import Int4Method

    _, out, result = _hf_export(
        "gemma2-window",
        tmp_path,
        precision=Precision.of(Int4(method=Int4Method.RTN, block=INT4_BLOCK)),
        parity_agreement="gate",
    )
    assert result.parity.passed and result.parity.agreed and result.manifest.parity.agreement == "gate"
    assert sum(g.ties for s in result.parity.sets() for g in s.generation) > 0  # the flips it has are near-ties
    assert (out / "manifest.json").is_file()


def test_hf_int4_near_tie_model_exports_with_agreement_recorded(tmp_path: Path) -> None:
    """The same Gemma 2 with --parity-agreement record: its graphs meet fp32's tolerances against
    PyTorch on their own int4 weights (always gating), the agreement is recorded (report,
    manifest), and the portable graphs computed weight-only (as parity and TensorRT compute them)
    generate transformers' own generate() tokens of the model holding the same int4 numbers.
    (``kiln generate`` lets ONNX Runtime quantize the activations of DQ -> MatMul to int8, its
    default: at this model's near-ties its tokens differ, so they are compared loop to loop only.)"""
    from kiln.exporter.parity import greedy
    from kiln.exporter.precision.kinds.int4 import Int4Method
    from kiln.exporter.runners import OrtRunner

    model, out, result = _hf_export(
        "gemma2-window",
        tmp_path,
        precision=Precision.of(Int4(method=Int4Method.RTN, block=INT4_BLOCK)),
        parity_agreement="record",
    )
    quantized = result.parity.quantized
    assert result.parity.passed and quantized is not None and quantized.passed
    assert quantized.tolerance.logits_rtol == 1e-4 and set(quantized.targets) == {"onnx"}
    assert result.manifest.parity.agreement == "record"
    assert "vs checkpoint (agreement, recorded only)" in (out / "reports" / "parity.md").read_text()
    _rtn_int4(model, INT4_BLOCK)
    paths = {kind: out / "onnx" / f"{kind.value}.onnx" for kind in DECODER_KINDS}
    with OrtRunner(paths) as runner:
        tokens, _ = greedy(runner, result.report.spec, [PROMPT], 16)
    assert tokens[0].tolist() == _transformers_tokens(model, PROMPT, 16)
    static = list(Generator(out, target="onnx").run(PROMPT, 16, stop_at_eos=False).tokens)
    assert static == list(Generator(out).run(PROMPT, 16, stop_at_eos=False).tokens)


def test_windows_read_from_the_config_or_refused() -> None:
    """A window is applied where the spec declares it proved (``sliding_window_proved``), refused
    otherwise by a message naming the architectures the families declare."""
    from kiln.exporter.targets.onnx.windows import layer_windows
    from kiln.plugins.base import DecoderSpec

    def spec(proved: bool, **config: object) -> DecoderSpec:
        return DecoderSpec("hf", 3, 2, 8, 32, 64, config=dict(config), sliding_window_proved=proved)

    assert layer_windows(spec(False, architecture="LlamaForCausalLM")) == {}
    assert layer_windows(spec(False, architecture="Phi3ForCausalLM", sliding_window=None)) == {}  # its field, unset
    assert layer_windows(spec(True, architecture="MistralForCausalLM", sliding_window=16)) == {0: 16, 1: 16, 2: 16}
    assert layer_windows(spec(True, architecture="Qwen2ForCausalLM", sliding_window=16, use_sliding_window=False)) == {}
    kinds = ["full_attention", "sliding_attention", "sliding_attention"]
    assert layer_windows(
        spec(True, architecture="Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True, layer_types=kinds)
    ) == {1: 16, 2: 16}
    with pytest.raises(ConfigError) as err:
        layer_windows(spec(False, architecture="Phi3ForCausalLM", sliding_window=2047))
    assert str(err.value) == (
        "config: --target onnx applies sliding windows only for MistralForCausalLM, Qwen2ForCausalLM, "
        "Gemma2ForCausalLM, Gemma3ForCausalLM, Starcoder2ForCausalLM, MixtralForCausalLM, "
        "Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration, each proved by a test; this Phi3ForCausalLM "
        "model "
        "has a 2047-token window: export it without --target onnx"
    )
    with pytest.raises(
        ConfigError, match=r"config.layer_types \['full_attention', 'chunked_attention'\] is not one of"
    ):
        layer_windows(
            spec(
                True,
                architecture="Gemma3ForCausalLM",
                sliding_window=4,
                layer_types=["full_attention", "chunked_attention"],
            )
        )
    # Llama 4's chunked layers: refused (the static masks would attend to every earlier key); without one, nothing to
    # refuse
    chunked = ["chunked_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ConfigError) as err:
        layer_windows(spec(False, architecture="Llama4ForCausalLM", attention_chunk_size=8192, layer_types=chunked))
    assert str(err.value) == (
        "config: --target onnx does not apply chunked attention (this Llama4ForCausalLM model attends within "
        "chunks of 8192 tokens:"
        " attention_chunk_size); export it without --target onnx"
    )
    assert (
        layer_windows(
            spec(False, architecture="Llama4ForCausalLM", attention_chunk_size=8192, layer_types=["full_attention"] * 3)
        )
        == {}
    )
    assert (
        layer_windows(
            spec(False, architecture="Llama4ForCausalLM", attention_chunk_size=None, layer_types=["full_attention"] * 3)
        )
        == {}
    )


def test_a_window_is_applied_by_its_declaration_never_by_its_name() -> None:
    from kiln.exporter.targets.onnx.windows import layer_windows
    from kiln.plugins.base import DecoderSpec

    mistral = DecoderSpec("hf", 2, 2, 8, 32, 64, config={"architecture": "MistralForCausalLM", "sliding_window": 4})
    with pytest.raises(ConfigError, match=r"; this MistralForCausalLM model has a 4-token window: export it without"):
        layer_windows(mistral)  # a proved architecture's name, but no declaration
    assert layer_windows(dataclasses.replace(mistral, sliding_window_proved=True)) == {0: 4, 1: 4}


def test_the_windows_declared_proved_are_those_these_tests_prove() -> None:
    """The hf family declares a sliding window proved (``Arch.sliding_window_proved``, in the specs
    of its table's rows and of a config read) for exactly the architectures whose windowed case
    above exports --target onnx, and Gemma 3's and Mistral 3's wrappers (test_hf_multimodal.py exports their windows);
    a row declaring a window proved where its config has none is a family's bug."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face configs need transformers")
    from kiln.plugins.hf import HF
    from kiln.plugins.hf.archs import Arch
    from kiln.plugins.hf.multimodal import read_any_spec
    from kiln.plugins.hf.tiny import TINY

    proved = [*WINDOWS, "gemma3-multimodal-window", "mistral3-multimodal-window"]
    declared = [spec.config["architecture"] for spec in HF.specs() if spec.sliding_window_proved]
    assert sorted(declared) == sorted(TINY[case][0] for case in proved)
    for case in [*proved, "phi3-partial", "smollm3", "llama"]:
        arch, make = TINY[case]
        assert read_any_spec(make(transformers), arch, "hf").sliding_window_proved is (case in proved), case
    with pytest.raises(
        ValueError, match=r"^Toy: its sliding window is proved, yet its config has none \(window=False\)$"
    ):
        Arch("Toy", sliding_window_proved=True)


def test_the_plugins_table_takes_what_these_tests_export() -> None:
    """The Hugging Face table (``kiln plugins``, docs/architectures.md) against what the tests above
    export --target onnx: fp32 (HF_CASES), fp16 (ISSUE_CASES), int4 (INT4_CASES): each case's cell
    is taken, and a windowed case's on no condition (its window is one a test proves)."""
    from kiln.exporter.support import support
    from kiln.plugins.hf import HF
    from kiln.plugins.hf.tiny import TINY

    cells = {spec.config["architecture"]: support(spec).cells for spec in HF.specs()}
    for precision, cases in (("fp32", HF_CASES), ("fp16", ISSUE_CASES), ("int4", INT4_CASES)):
        for case in cases:
            cell = cells[TINY[case][0]][precision]["onnx"]
            assert cell.taken and (cell.condition is None or not case.endswith("-window")), (precision, case, cell)


def test_static_contract() -> None:
    """The names and dims contract.static_cache promises, for a 2-layer model at 64 slots."""
    from kiln.plugins.base import DecoderSpec

    spec = DecoderSpec("native", 2, 2, 8, 32, 64)
    prefill, decode = (static_io(spec, kind, max_context=64) for kind in (GraphKind.PREFILL, GraphKind.DECODE))
    caches = ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert prefill.input_names == ["input_ids", "attention_mask", "position_ids", *caches]
    assert decode.input_names == ["input_ids", "attention_mask", "position_ids", "write_indices", *caches]
    assert decode.inputs[3].dims == ("batch",) and decode.inputs[3].dtype == "int64"
    assert {t.dims for t in decode.inputs[4:]} == {("batch", 2, 64, 8)} == {t.dims for t in decode.outputs[1:]}
    assert decode.output_names == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]


def test_engine_profiles_and_trtexec_of_the_static_graphs(
    native: tuple[Path, ExportResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kiln build's profiles of the real std graphs: every input the graph file declares, its fixed
    dims fixed (each cache's max_context slots), batch ranged; without TensorRT trtexec.sh holds both
    graph sets and the export stays verifiable (no engine is built here: no TensorRT, no GPU)."""
    import shutil
    import sys

    from kiln.errors import EngineError
    from kiln.exporter.artifacts import manifest as manifest_mod
    from kiln.exporter.engine import BuildOptions, GraphSet, build_command
    from kiln.exporter.engine.profiles import engine_profiles

    directory = Path(shutil.copytree(native[0], tmp_path / "export"))
    manifest = manifest_mod.read(directory)
    limits = manifest.limits
    for profile in engine_profiles(manifest, BuildOptions(), GraphSet.ONNX):
        graph = onnx.load(str(directory / profile.onnx), load_external_data=False).graph
        dims = {
            v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in graph.input
        }
        assert [s.name for s in profile.inputs] == list(dims)
        for spec in profile.inputs:
            assert len(spec.min) == len(dims[spec.name])
            for i, dim in enumerate(dims[spec.name]):
                if isinstance(dim, int):
                    assert spec.min[i] == spec.opt[i] == spec.max[i] == dim
                elif dim == "batch":
                    assert (spec.min[i], spec.max[i]) == (1, limits.max_batch)
            if spec.name.startswith("past_key_values."):
                assert dims[spec.name][2] == spec.max[2] == spec.min[2] == limits.max_context
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(EngineError, match="TensorRT is not installed"):
        build_command(directory, BuildOptions())
    script = (directory / "engines" / "trtexec.sh").read_text()
    kv = manifest.targets["onnx"].graphs["decode"].inputs[4]
    assert kv.name == "past_key_values.0.key" and f"--maxShapes=input_ids:{limits.max_batch}x1," in script
    assert (
        f"past_key_values.0.key:{limits.max_batch}x{kv.shape[1]}x{limits.max_context}x{kv.shape[3]}" in script
        and "--onnx=onnx/decode.std.onnx" in script
    )
    assert verify_dir(directory).ok, verify_dir(directory).problems()
