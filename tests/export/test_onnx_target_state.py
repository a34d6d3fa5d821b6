"""``--target onnx`` for recurrent-state caches (issue 43; kinds ``state`` and ``hybrid`` of
plugins/cache_layout.py; exporter/targets/onnx/states.py): a tiny Mamba2 (state only), Bamba (Mamba2
and attention layers) and LFM2 (short-convolution and attention layers) export with the target at
fp32 and fp16, their parity passes through the static contract, the graphs keep the attention layers'
keys and values in static buffers written by ``TensorScatter`` and carry each state as a plain input
and output of its fixed shape, every op is a standard one (no ``com.microsoft``, no control flow,
``CumSum`` in float), ``kiln verify`` passes, and greedy tokens through ``kiln generate --target onnx``
(the states in two buffers swapped each step) and through the static runner on a left-padded batch
equal transformers' ``generate()``. The families not proved, and one whose trace TensorRT's parser
is not documented to take (GraniteMoeHybrid), stay refused by name."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])")

from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ExportError
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind
from kiln.exporter.contract.static_cache import static_io
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import ExportResult, export
from kiln.exporter.support import refusal
from kiln.exporter.targets.onnx.states import standard_ops
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln.runtime.generate import Generator
from kiln_testing import hf_greedy, hf_model

STEPS = 12
PROMPT = [5, 17, 33, 9, 101, 64, 3, 88, 12]
# the ops the target's graphs of these families hold, each one TensorRT's ONNX parser imports
# (onnx-tensorrt docs/operators.md; Attention, RotaryEmbedding, RMSNormalization, TensorScatter from 10.15)
PARSED = {
    "Add", "And", "Attention", "Cast", "Clip", "Concat", "ConstantOfShape", "Conv", "CumSum", "Div", "Einsum",
    "Equal", "Exp", "Expand", "Gather", "GatherND", "Greater", "LessOrEqual", "MatMul", "Max", "Mul", "Neg", "Not",
    "Or", "Pad", "RMSNormalization", "Range", "Reshape", "RotaryEmbedding", "Shape", "Sigmoid", "Slice", "Softplus",
    "Split", "Squeeze", "Sub", "TensorScatter", "Transpose", "Trilu", "Unsqueeze", "Where",
}  # fmt: skip


def _export(case: str, root: Path, precision: Precision = Precision.FP32) -> tuple[Path, Path, ExportResult]:
    ckpt, out = root / "ckpt", root / f"out_{precision.value}"
    tiny_transformers(case, seed=1).save_pretrained(ckpt, safe_serialization=True)
    return (
        ckpt,
        out,
        export(ckpt, out, ExportOptions.from_flags(max_batch=4, target="onnx", precision=precision, parity_tokens=8)),
    )


@pytest.fixture(scope="module", params=["mamba2", "bamba", "lfm2"])
def exported(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, ExportResult]:
    root = tmp_path_factory.mktemp(f"onnx_state_{request.param}")
    return (request.param, *_export(request.param, root))


def _assert_parity(result: ExportResult, precision: str) -> None:
    parity = result.parity
    assert parity.passed, parity.failures()
    onnx_target = parity.targets["onnx"]
    assert (onnx_target.precision, onnx_target.passed, onnx_target.backend) == (
        precision,
        True,
        "onnxruntime (static cache)",
    ), onnx_target
    assert {"prefill.onnx", "decode.onnx", "model.onnx"} <= {t.graph for t in parity.tensors}
    runs = {(g.path, g.batch) for g in parity.generation}
    assert {("onnx:prefill+decode", 1), ("onnx:prefill+decode", 3), ("onnx:model", 1), ("onnx:model", 3)} <= runs, runs


def _assert_graphs(out: Path, result: ExportResult) -> None:
    """Each graph: checked, opset 24, the recorded static contract and its own, the keys and values of
    the attention layers in place (TensorScatter), each state a plain input and output of its fixed
    shape (produced by the mixer, never TensorScatter), and standard ops only."""
    spec = result.report.spec
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["targets"]["onnx"]
    assert entry["kv_cache"] == "static"
    kv_dtype = manifest["kv_cache"]["dtype"]
    layers = sorted({i for i, t in spec.cache_layout.tensors() if t.suffix == "key"})
    states = {f"{i}.{t.suffix}": [t.heads, t.length, t.width] for i, t in spec.cache_layout.tensors() if t.length}
    assert states, "the family carries a recurrent state"
    for kind in DECODER_KINDS:
        graph = entry["graphs"][kind.value]
        path = out / graph["file"]
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 24)]
        io = static_io(spec, kind, max_context=result.manifest.limits.max_context, kv_dtype=kv_dtype)
        assert graph["inputs"] == [t.to_dict() for t in io.inputs] and graph["outputs"] == [
            t.to_dict() for t in io.outputs
        ]
        assert [i.name for i in model.graph.input] == io.input_names and [
            o.name for o in model.graph.output
        ] == io.output_names
        ops = Counter(n.op_type for n in model.graph.node)
        assert (ops["TensorScatter"], ops["Attention"]) == (2 * len(layers), len(layers)), ops
        assert set(ops) <= PARSED and set(graph["passes"]["standard_ops"]["op_types"]) == set(ops), set(ops) - PARSED
        assert ("write_indices" in io.input_names) == (bool(layers) and kind is not GraphKind.PREFILL)
        producers = {o: n.op_type for n in model.graph.node for o in n.output}
        shapes = {t.name: t.dims for t in (*io.inputs, *io.outputs)}
        for name, dims in states.items():
            assert list(shapes[f"present.{name}"][1:]) == dims and producers[f"present.{name}"] != "TensorScatter"
            assert (f"past_key_values.{name}" in shapes) == (kind is not GraphKind.PREFILL)
        for layer in layers:
            assert producers[f"present.{layer}.key"] == producers[f"present.{layer}.value"] == "TensorScatter"
        _assert_cumsum_in_float(model)
    assert verify_dir(out).ok


def _assert_cumsum_in_float(model: onnx.ModelProto) -> None:
    """Every CumSum sums float with a constant axis (what TensorRT's parser takes)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = list(inferred.graph.value_info) + list(inferred.graph.input)
    types = {v.name: v.type.tensor_type.elem_type for v in known}
    constants = {i.name for i in model.graph.initializer} | {
        o for n in model.graph.node if n.op_type == "Constant" for o in n.output
    }
    for node in (n for n in model.graph.node if n.op_type == "CumSum"):
        assert (
            types[node.input[0]] in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and node.input[1] in constants
        ), node


def _kiln_generate(out: Path, prompt: list[int], steps: int) -> list[int]:
    args = ["generate", str(out), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", str(steps)]
    result = CliRunner().invoke(main, [*args, "--ignore-eos", "--json", "--target", "onnx"])
    assert result.exit_code == 0, result.output
    return list(json.loads(result.stdout)["tokens"])


def test_exports_with_parity_and_the_graphs_carry_the_state(exported: tuple[str, Path, Path, ExportResult]) -> None:
    from kiln.exporter.check import check_dir

    _, _, out, result = exported
    _assert_parity(result, "fp32")
    _assert_graphs(out, result)
    checked = check_dir(out)  # kiln check re-runs parity through the static contract
    assert checked.passed and {"onnx:prefill+decode", "onnx:model"} <= {g.path for g in checked.generation}


def test_the_static_feeds_pass_a_state_through_and_cut_only_the_buffers() -> None:
    """``static_feeds``/``portable_outputs`` on a hybrid's contract (Bamba: layer 1 attention, layers 0
    and 2 Mamba2): a state goes in and comes back whole, even when longer than the step's tokens (a
    2-token prompt, a 4-row conv window); a key/value buffer is made of the past and cut back."""
    from kiln.exporter.contract.static_cache import portable_outputs, static_feeds

    spec = tiny_model("bamba", seed=0).spec
    decode = static_io(spec, GraphKind.DECODE, max_context=16)
    caches = {t.name: (tuple(t.dims[1:]), np.dtype(np.float32)) for t in decode.inputs if "key_values" in t.name}
    prefill_caches = {n: c for n, c in caches.items() if n.endswith((".key", ".value"))}
    assert set(prefill_caches) == {"past_key_values.1.key", "past_key_values.1.value"}
    assert caches["past_key_values.0.conv"][0] == (1, 4, 160) and caches["past_key_values.1.key"][0] == (2, 16, 16)
    ids = {"input_ids": np.ones((1, 2), np.int64), "attention_mask": np.ones((1, 2), np.int64)}
    static, cuts = static_feeds(GraphKind.PREFILL, ids, prefill_caches)
    assert cuts == {"present.1.key": 2, "present.1.value": 2} and static["past_key_values.1.key"].shape == (
        1,
        2,
        16,
        16,
    )
    conv = np.arange(4 * 160, dtype=np.float32).reshape(1, 1, 4, 160)
    assert portable_outputs({"present.0.conv": conv, "present.1.key": np.ones((1, 2, 16, 16))}, cuts)[
        "present.0.conv"
    ].shape == (1, 1, 4, 160)
    step = {"input_ids": np.ones((1, 1), np.int64), "attention_mask": np.ones((1, 3), np.int64)}
    pasts = {"past_key_values.0.conv": conv, "past_key_values.1.key": np.ones((1, 2, 2, 16), np.float32)}
    static, cuts = static_feeds(GraphKind.DECODE, step | pasts, caches)
    assert static["past_key_values.0.conv"] is conv and cuts == {"present.1.key": 3}
    assert static["past_key_values.1.key"].shape == (1, 2, 16, 16) and static["write_indices"].tolist() == [2]
    assert not static["past_key_values.1.key"][:, :, 2:].any() and static["past_key_values.1.key"][:, :, :2].all()


def test_kiln_generate_on_the_target_equals_transformers_generate(
    exported: tuple[str, Path, Path, ExportResult], capfd: pytest.CaptureFixture[str]
) -> None:
    """``kiln generate --target onnx``: the key/value buffers bound as past and present (ONNX Runtime
    copies none of them), each state read from one buffer and written to the other; transformers'
    greedy tokens."""
    _, ckpt, out, _ = exported
    capfd.readouterr()
    assert _kiln_generate(out, PROMPT, STEPS) == hf_greedy(hf_model(ckpt), [PROMPT], STEPS)[0].tolist()
    generator = Generator(out, target="onnx")
    generator.run(PROMPT, 4, stop_at_eos=False)
    kv = generator._kv  # type: ignore[attr-defined]
    assert kv.states and all(np.abs(s.numpy()).sum() > 0 for s in kv.states.values())  # the last step's state
    assert all(b.numpy().shape[2] == generator.max_context for b in kv.buffers.values())
    assert "in-place optimization not activated" not in capfd.readouterr().err  # TensorScatter's copy warning


def test_a_left_padded_batch_through_the_static_runner_equals_transformers(
    exported: tuple[str, Path, Path, ExportResult],
) -> None:
    """Prefill + decode and the unified graph through the static contract (``StaticCacheRunner``), a
    padded row's state staying its unpadded row's."""
    from kiln.exporter.parity import greedy, make_prompts
    from kiln.exporter.targets.onnx.runner import StaticCacheRunner
    from kiln.plugins import load_model

    _, ckpt, out, _ = exported
    spec = load_model(ckpt).spec
    prompts = make_prompts(spec, [9, 5], seed=2)
    want = hf_greedy(hf_model(ckpt), [list(map(int, p)) for p in prompts], STEPS)
    split = {k: out / "onnx" / f"{k.value}.std.onnx" for k in (GraphKind.PREFILL, GraphKind.DECODE)}
    for graphs, unified in ((split, False), ({GraphKind.UNIFIED: out / "onnx" / "model.std.onnx"}, True)):
        with StaticCacheRunner(graphs) as runner:
            got, _ = greedy(runner, spec, prompts, STEPS, unified=unified)
        np.testing.assert_array_equal(got, want, err_msg=str(sorted(graphs)))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mamba2", "bamba", "lfm2"])
def test_fp16_parity_and_generation(case: str, tmp_path: Path) -> None:
    """--fp16 --target onnx: fp16 parity, and ``kiln generate --target onnx`` gives the portable fp16
    graphs' tokens and transformers' generate() of the model in fp16."""
    ckpt, out, result = _export(case, tmp_path, Precision.FP16)
    _assert_parity(result, "fp16")
    _assert_graphs(out, result)
    assert json.loads((out / "manifest.json").read_text())["kv_cache"]["dtype"] == "float16"
    static = _kiln_generate(out, PROMPT, STEPS)
    assert static == list(Generator(out).run(PROMPT, STEPS, stop_at_eos=False).tokens)
    assert static == hf_greedy(hf_model(ckpt).half(), [PROMPT], STEPS)[0].tolist()


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("granitemoehybrid", "does not write GraniteMoeHybridForCausalLM: its mixture-of-experts routing sums int32"),
        (
            "mamba",
            "writes a recurrent state (state cache) only for Mamba2ForCausalLM, BambaForCausalLM, Lfm2ForCausalLM",
        ),
        ("qwen3_next", "this Qwen3NextForCausalLM model is not one: the portable graphs (and --target ort) export it"),
    ],
)
def test_the_families_not_proved_are_refused_by_name(case: str, why: str) -> None:
    spec = tiny_model(case, seed=0).spec
    found = refusal(spec, {"target": "onnx"})
    assert found is not None and why in found, found
    assert refusal(spec, {"target": "ort"}) is None and refusal(spec, {}) is None


def test_a_low_bit_precision_is_refused_by_name_for_a_proved_family() -> None:
    spec = tiny_model("mamba2", seed=0).spec
    found = refusal(spec, {"target": "onnx", "precision": Precision.parse("int4")})
    assert (
        found is not None and "at fp32 and fp16 only, each proved by a test; export Mamba2ForCausalLM at int4" in found
    )
    assert refusal(spec, {"target": "onnx", "precision": Precision.FP16}) is None


def _graph(op_type: str, domain: str = "", dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Model:
    x = ir.val("x", dtype, ir.Shape([2, 3]))
    axis = ir.val("axis", ir.DataType.INT64, ir.Shape([]))
    node = ir.node(op_type, [x, axis], domain=domain, name=f"/{op_type}")
    node.outputs[0].name = "y"
    graph = ir.Graph([x, axis], node.outputs, nodes=[node], opset_imports={"": 24, **({domain: 1} if domain else {})})
    return ir.Model(graph, ir_version=11)


def test_standard_ops_refuses_what_tensorrt_does_not_parse() -> None:
    assert standard_ops(_graph("CumSum")) == ["CumSum"]
    assert standard_ops(_graph("CumSum", dtype=ir.DataType.FLOAT16)) == ["CumSum"]
    with pytest.raises(ExportError, match="CumSum '/CumSum' sums INT32, and TensorRT's parser takes CumSum in FP32"):
        standard_ops(_graph("CumSum", dtype=ir.DataType.INT32))
    with pytest.raises(ExportError, match="node '/MatMulNBits' is com.microsoft::MatMulNBits, not a standard op"):
        standard_ops(_graph("MatMulNBits", "com.microsoft"))
    with pytest.raises(ExportError, match="node '/Loop' is ai.onnx::Loop, not a standard op"):
        standard_ops(_graph("Loop"))
