"""``--target ort``: ONNX Runtime-target graphs beside the portable ones, really run by ONNX
Runtime, checked for fp32 parity (tensors and greedy generation, left-padded batches included)
exactly like the portable graphs, with the rewrite asserted on the graphs themselves."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import ExportResult, export
from kiln.exporter.plan import plan
from kiln.exporter.targets.ort.nbits import pack_int8_blocks
from kiln_testing import tiny_config, write_checkpoint

PARITY_TOKENS = 12


def _ops(path: Path) -> Counter[str]:
    model = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node)


def _const_weight_matmuls(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    constants = {t.name for t in model.graph.initializer}
    return sum(1 for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constants)


def _assert_ort_checked(result: ExportResult, precision: str) -> None:
    parity = result.parity
    assert parity.passed, parity.failures()
    assert parity.targets["ort"].precision == precision and parity.targets["ort"].passed
    checked = {t.graph for t in parity.tensors}
    assert {"prefill.ort", "decode.ort", "model.ort"} <= checked
    runs = {(g.path, g.batch) for g in parity.generation}
    # batch 1 and the left-padded batch of 3, through prefill + decode and through model.onnx
    assert {("ort:prefill+decode", 1), ("ort:prefill+decode", 3), ("ort:model", 1), ("ort:model", 3)} <= runs


def _norms(ops: Counter[str]) -> int:
    return ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"]


def _gqa_attr(path: Path, name: str, default: int) -> list[int]:
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return [
        next((a.i for a in n.attribute if a.name == name), default) for n in nodes if n.op_type == "GroupQueryAttention"
    ]


def _assert_rewritten(out: Path, n_layers: int, n_norms: int, rotary_in_gqa: bool = False) -> None:
    onnx_dir = out / "onnx"
    for kind in (GraphKind.PREFILL, GraphKind.DECODE):
        path = onnx_dir / f"{kind.value}.ort.onnx"
        ops = _ops(path)
        in_gqa = rotary_in_gqa and kind is GraphKind.DECODE  # decode with head_dim % 16 == 0 only
        assert ops["GroupQueryAttention"] == n_layers and ops["RotaryEmbedding"] == (0 if in_gqa else 2 * n_layers), ops
        assert _gqa_attr(path, "do_rotary", 0) == [int(in_gqa)] * n_layers
        # prefill: the family's mask alone decides (causal=0); decode: GQA's default causal=1,
        # the same for its last-position query and ORT's fast CPU path
        assert _gqa_attr(path, "causal", 1) == [int(kind is GraphKind.DECODE)] * n_layers
        assert ops["Softmax"] == 0 and ops["Neg"] == 0, ops  # the portable core and rotate_half are gone
        # q, k and v projections: one MatMul each layer (packed), o_proj, the SwiGLU MLP's gate and
        # up projections packed into one, its down projection, and the head
        assert ops["Split"] == (0 if in_gqa else n_layers) + n_layers and ops["MatMul"] == 4 * n_layers + 1, ops
        # every norm fused, and all but the first with the residual Add before it
        assert _norms(ops) == n_norms and ops["SkipSimplifiedLayerNormalization"] == n_norms - 1, ops
        assert ops["Pow"] == 0 and ops["Reciprocal"] == 0, ops
        # GQA writes the presents, and nothing reads them back (repeat_kv is gone)
        nodes = onnx.load(str(path), load_external_data=False).graph.node
        makers = {out: n.op_type for n in nodes for out in n.output if out.startswith("present.")}
        assert set(makers.values()) == {"GroupQueryAttention"} and len(makers) == 2 * n_layers
        assert not [i for n in nodes for i in n.input if i.startswith("present.")]
    # model.onnx keeps portable attention (GQA's CPU kernel refuses batch > 1 with a past and seq > 1)
    unified = _ops(onnx_dir / "model.ort.onnx")
    assert unified["GroupQueryAttention"] == 0 and unified["Softmax"] == n_layers
    assert _norms(unified) == n_norms
    # the portable graphs are untouched: standard ops only
    for kind in DECODER_KINDS:
        model = onnx.load(str(onnx_dir / f"{kind.value}.onnx"), load_external_data=False)
        assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
        assert _ops(onnx_dir / f"{kind.value}.onnx")["Softmax"] == n_layers


def _assert_manifest(out: Path, precision: str) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    schema = json.loads((Path(__file__).parents[2] / "exporter" / "artifacts" / "manifest.schema.json").read_text())
    errors = [e.message for e in Draft202012Validator(schema).iter_errors(manifest)]
    assert not errors, errors
    ort = manifest["targets"]["ort"]
    assert ort["precision"] == precision
    assert {g["file"] for g in ort["graphs"].values()} == {f"onnx/{k.value}.ort.onnx" for k in DECODER_KINDS}
    assert ort["weights"]["file"] in manifest["files"]
    for graph in ort["graphs"].values():
        assert graph["file"] in manifest["files"]
    assert verify_dir(out).ok
    return manifest


def test_native_ort_target_fp32(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = export(tiny_ckpt, out, ExportOptions.from_flags(max_batch=4, target="ort", parity_tokens=PARITY_TOKENS))
    _assert_ort_checked(result, "fp32")
    # fp32 tolerances, as for the portable graphs
    assert all((t.atol, t.rtol) == (1e-5, 1e-4) for t in result.parity.tensors if t.graph.endswith(".ort"))
    # 2 layers x (attention norm, PLE norm, MLP norm) + the final norm
    _assert_rewritten(out, n_layers=2, n_norms=7)
    manifest = _assert_manifest(out, "fp32")
    assert manifest["targets"]["ort"]["graphs"]["decode"]["passes"]["attention"]["layers"] == [0, 1]
    # decode: the family's mask subgraph was proven to be padding-only and replaced (the decode graph's only)
    assert [
        manifest["targets"]["ort"]["graphs"][k]["passes"].get("decode_mask", {}).get("compact", False)
        for k in ("prefill", "decode", "model")
    ] == [False, True, False]
    assert manifest["precision"] == "fp32" and manifest["graphs"]["decode"]["file"] == "onnx/decode.onnx"

    # kiln check re-runs parity on both sets of graphs
    checked = check_dir(out)
    assert checked.passed and {"decode", "decode.ort"} <= {t.graph for t in checked.tensors}
    assert {g.path for g in checked.generation} == {"prefill+decode", "model", "ort:prefill+decode", "ort:model"}
    _assert_decode_writes_in_place(out)


def _assert_decode_writes_in_place(out: Path) -> None:
    """The ORT decode graph run with past and present bound to ONE buffer longer than the
    context (as kiln generate --target ort and kiln bench run it) computes what the contract
    run computes and writes only the new row; kiln generate's two loops agree token for token."""
    import onnxruntime as ort

    from kiln.runtime.generate import Generator

    session = ort.InferenceSession(str(out / "onnx" / "decode.ort.onnx"), providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    n_kv, head_dim = pasts[0].shape[1], pasts[0].shape[3]
    past_len, capacity = 9, 16
    rng = np.random.default_rng(0)
    past = {p.name: rng.standard_normal((2, n_kv, past_len, head_dim)).astype(np.float32) for p in pasts}
    mask = np.ones((2, past_len + 1), dtype=np.int64)
    mask[0, :3] = 0  # left padding
    base = {"input_ids": np.array([[5], [7]]), "attention_mask": mask, "position_ids": np.array([[6], [9]])}
    names = [o.name for o in session.get_outputs()]
    want = dict(zip(names, session.run(None, {**base, **past}), strict=True))
    buffers = {}
    binding = session.io_binding()
    binding.bind_output("logits", "cpu")  # outputs come back in the order they were bound
    for name, value in base.items():
        binding.bind_cpu_input(name, value)
    for name, value in past.items():
        buffer = np.zeros((2, n_kv, capacity, head_dim), dtype=np.float32)
        buffer[:, :, :past_len] = value
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(name, buffers[name])
        binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), buffers[name])
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.get_outputs()[0].numpy(), want["logits"], atol=1e-5)
    for name, buffer in buffers.items():
        array = buffer.numpy()
        np.testing.assert_array_equal(array[:, :, :past_len], past[name])  # the past is untouched
        np.testing.assert_allclose(
            array[:, :, past_len], want[name.replace("past_key_values.", "present.")][:, :, past_len], atol=1e-6
        )
        assert not array[:, :, past_len + 1 :].any()  # nothing written beyond the new row

    shared, concat = Generator(out, target="ort"), Generator(out)
    assert (shared.kv_cache, concat.kv_cache) == ("shared-buffer", "concat")
    prompt = [11, 42, 7, 3, 99, 15]
    a = shared.run(prompt, 24, stop_at_eos=False, keep_logits=True)
    b = concat.run(prompt, 24, stop_at_eos=False, keep_logits=True)
    assert a.tokens == b.tokens
    assert a.logits is not None and b.logits is not None
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)


def test_native_rotary_inside_gqa_at_decode(tmp_path: Path) -> None:
    """head_dim 16: the decode graph feeds GQA the packed QKV and lets it rotate, at the
    caller's (left-padded) position_ids; still exact to fp32 tolerances."""
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config(d_model=64))
    out = tmp_path / "out"
    result = export(ckpt, out, ExportOptions.from_flags(max_batch=4, target="ort", parity_tokens=PARITY_TOKENS))
    _assert_ort_checked(result, "fp32")
    _assert_rewritten(out, n_layers=2, n_norms=7, rotary_in_gqa=True)


def test_hf_llama_ort_target_fp32(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("LlamaForCausalLM", seed=1).module.model.save_pretrained(ckpt, safe_serialization=True)
    out = tmp_path / "out"
    result = export(ckpt, out, ExportOptions.from_flags(max_batch=4, target="ort", parity_tokens=PARITY_TOKENS))
    _assert_ort_checked(result, "fp32")
    _assert_rewritten(out, n_layers=2, n_norms=5, rotary_in_gqa=True)  # the tiny Llama's head_dim is 16
    assert _assert_manifest(out, "fp32")["targets"]["ort"]["graphs"]["decode"]["passes"]["decode_mask"]["compact"]
    assert _ops(out / "onnx" / "decode.ort.onnx")["GatherND"] == 0  # transformers' mask subgraph is gone


@pytest.mark.parametrize(
    ("arch", "int8"), [("Qwen2ForCausalLM", False), ("MistralForCausalLM", False), ("GPT2LMHeadModel", True)]
)
def test_other_hf_families(arch: str, int8: bool, tmp_path: Path) -> None:
    """q/k/v biases (Qwen2: not packed), a sliding-window mask (Mistral: the family's own mask is
    GQA's bias), MHA with learned positions, no rotary and 2-D Gemm projections (GPT-2)."""
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model(arch, seed=1).module.model.save_pretrained(ckpt, safe_serialization=True)
    out = tmp_path / "out"
    options = ExportOptions.from_flags(
        max_batch=4, target="ort", target_flags={"ort_int8": int8}, parity_tokens=PARITY_TOKENS
    )
    result = export(ckpt, out, options)
    _assert_ort_checked(result, "int8" if int8 else "fp32")
    graphs = _assert_manifest(out, "int8" if int8 else "fp32")["targets"]["ort"]["graphs"]
    assert (
        graphs["prefill"]["passes"]["attention"]["layers"]
        == graphs["decode"]["passes"]["attention"]["layers"]
        == [0, 1]
    )
    if int8:  # GPT-2's projections are Gemms: 2 layers x (c_attn, c_proj, c_fc, mlp c_proj) + the head
        assert (
            len(graphs["decode"]["passes"]["nbits_int8"]["nodes"]) == 9
            and _ops(out / "onnx" / "decode.ort.onnx")["Gemm"] == 0
        )


def test_native_ort_int8_through_the_cli(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        "export",
        "--model",
        str(tiny_ckpt),
        "--out",
        str(out),
        "--max-batch",
        "4",
        "--parity-tokens",
        str(PARITY_TOKENS),
    ]
    cli = CliRunner().invoke(main, [*args, "--target", "ort", "--ort-int8"])
    assert cli.exit_code == 0, cli.output
    last = cli.stdout.strip().splitlines()[-1]
    written = json.loads((out / "manifest.json").read_text())
    sizes = [(w["file"], w["bytes"]) for w in (written["weights"], written["targets"]["ort"]["weights"])]
    assert (
        sizes[0][0] == "onnx/weights.bin"
        and sizes[1][0] != sizes[0][0]
        and all(size == (out / f).stat().st_size for f, size in sizes)
    )
    files = " + ".join(f"{f} {size / 1e3:.3g} KB" for f, size in sizes)  # a tiny model's: kilobytes
    assert last.startswith(
        f"wrote {out}: 3 fp32 graphs + 3 ONNX Runtime-target int8 graphs (onnx/*.ort.onnx), 2 weights files ({files})"
    )
    assert "; parity passed: portable (fp32): logits error " in last and "; ort (int8): logits error " in last
    assert (
        "tokens 100% equal over " in last and len(last.replace(str(out), "OUT")) < 700
    )  # it ran to 900-1,400 characters; the quality clause adds about 100
    assert last.endswith(f"; report {out / 'reports' / 'parity.md'}")
    parity = json.loads((out / "reports" / "parity.json").read_text())
    assert parity["passed"] and parity["targets"]["ort"]["precision"] == "int8"
    for target, name, rule in (
        (None, "portable (fp32)", (1e-5, 1e-4)),
        ("ort", "ort (int8)", (1.5, 0.05)),
    ):  # the line's figures are the report's
        logits = [t for t in parity["tensors"] if t["target"] == target and t["output"] == "logits"]
        worst = max(
            logits, key=lambda t: t["error"] / (t["atol"] + t["rtol"] * t["scale"])
        )  # the row closest to its limit
        assert (worst["atol"], worst["rtol"]) == rule
        limit = worst["atol"] + worst["rtol"] * worst["scale"]
        assert f"{name}: logits error {worst['error']:.3g} (limit {limit:.3g})" in last
    ort_tensors = [t for t in parity["tensors"] if t["graph"].endswith(".ort")]
    assert {t["graph"] for t in ort_tensors} == {"prefill.ort", "decode.ort", "model.ort"}
    assert all(t["atol"] == 1.5 or t["atol"] == 1.0 for t in ort_tensors)  # int8 tolerances, not fp32's
    assert {g["path"] for g in parity["generation"]} >= {"ort:prefill+decode", "ort:model"}
    manifest = _assert_manifest(out, "int8")
    assert manifest["precision"] == "fp32"  # the portable graphs stay fp32
    for kind in DECODER_KINDS:
        path = out / "onnx" / f"{kind.value}.ort.onnx"
        # 2 layers x (q|k|v packed, o, gate|fc1 packed, fc2) + the LM head, in every graph
        want = 9
        assert _ops(path)["MatMulNBits"] == want and _const_weight_matmuls(path) == 0
        assert _const_weight_matmuls(out / "onnx" / f"{kind.value}.onnx") == 15
        assert len(manifest["targets"]["ort"]["graphs"][kind.value]["passes"]["nbits_int8"]["nodes"]) == want
    # the three ORT graphs share one copy of the int8 weights
    assert manifest["targets"]["ort"]["weights"]["bytes"] < (out / "onnx" / "weights.bin").stat().st_size

    # kiln bench times the ORT-target graphs beside the portable ones of the same directory
    bench = CliRunner().invoke(
        main,
        [
            "bench",
            str(out),
            "--runs",
            "3",
            "--prefill-seq",
            "8",
            "--past",
            "8",
            "--no-torch",
            "--no-roofline",
            "--json",
        ],
    )
    assert bench.exit_code == 0, bench.output
    report = json.loads(bench.output)
    assert set(report["median_ms"]["decode"]) == {"kiln fp32 (out)", "kiln ort int8 (out)"}
    assert [d["shared_kv_buffer"] for d in report["directories"]] == [False, True]

    # the same export as the previous kiln wrote it (manifest_version 1): its ORT decode graph still
    # runs with the shared buffer, which version 2 states as targets.ort.kv_cache
    from kiln_testing import downgrade

    v1 = tmp_path / "v1"
    shutil.copytree(out, v1)
    (v1 / "manifest.json").write_text(json.dumps(downgrade(json.loads((v1 / "manifest.json").read_text()))))
    run = CliRunner().invoke(
        main, ["generate", str(v1), "--target", "ort", "--ids", "1,2", "--max-new-tokens", "3", "--json"]
    )
    assert run.exit_code == 0 and json.loads(run.stdout)["kv_cache"] == "shared-buffer", run.output


def test_int8_blocks_round_trip() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((70, 5)).astype(np.float32)  # K not a multiple of the block
    packed, scales = pack_int8_blocks(weight, 32)
    assert packed.shape == (5, 3, 32) and packed.dtype == np.uint8 and scales.shape == (5, 3)
    restored = ((packed.astype(np.float32) - 128) * scales[..., None]).reshape(5, 96)[:, :70].T
    assert np.abs(restored - weight).max() <= scales.max() / 2 + 1e-7
    assert np.all(packed.reshape(5, 96)[:, 70:] == 128)  # padding quantizes to zero


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(target_flags={"ort_int8": True}), "--ort-int8 only applies to --target ort"),
        (
            dict(target="ort", precision=Precision.FP16),
            "--target ort rewrites fp32 graphs and cannot be combined with --fp16/--int8/--fp8 (found fp16)",
        ),
        (
            dict(target="ort", precision=Precision.INT8, calib_data="synthetic"),
            "(found int8); for int8 on ONNX Runtime use --target ort --ort-int8",
        ),
    ],
)
def test_bad_combinations_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        plan(ExportOptions.from_flags(**options))
    assert message in str(info.value)


def test_cli_refuses_ort_int8_without_target(tiny_ckpt: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["export", "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--ort-int8"]
    )
    assert result.exit_code == 1
    assert "error: config: --ort-int8 only applies to --target ort" in result.output
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny_portable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny native export (portable graphs only): head_dim 16, rope theta 500."""
    root = tmp_path_factory.mktemp("ort_portable")
    ckpt = write_checkpoint(root / "ckpt", tiny_config(d_model=64, rope_theta=500.0))
    export(ckpt, root / "out", ExportOptions.from_flags(max_batch=2, parity_tokens=2))
    return root / "out" / "onnx"


def test_rotary_tables_are_the_graphs_own(tiny_portable: Path) -> None:
    import onnx_ir as ir

    from kiln.exporter.patterns.attention import find_attention
    from kiln.exporter.patterns.rotary_tables import graph_tables

    model = ir.load(tiny_portable / "decode.onnx")
    cores = find_attention(model, head_dim=16)
    assert [c.layer for c in cores] == [0, 1] and all(c.rotary is not None and c.n_heads == 4 for c in cores)
    assert all(c.past_key is not None and c.past_key.name == f"past_key_values.{c.layer}.key" for c in cores)
    tables = graph_tables(model, tiny_portable, 48, 16)(*cores[0].rotary)  # type: ignore[misc]
    assert tables is not None
    # the formula in float64; the graph computes its angles in float32 (hence 1e-5, not 1e-7),
    # which is why the tables are taken from the graph rather than re-derived
    angles = np.arange(48)[:, None] * 500.0 ** (-np.arange(0, 16, 2) / 16)[None, :]
    np.testing.assert_allclose(tables[0], np.cos(angles), atol=1e-5)
    np.testing.assert_allclose(tables[1], np.sin(angles), atol=1e-5)
    assert not np.allclose(
        tables[0], np.cos(np.arange(48)[:, None] * 10000.0 ** (-np.arange(0, 16, 2) / 16)[None, :]), atol=1e-3
    )


def test_layers_without_tables_keep_their_rotary(tiny_portable: Path) -> None:
    """When the cos/sin subgraph cannot be evaluated per position (longrope past its switch reads
    max(position_ids)), the graph's own rotary stays and GQA reads q and k rotated (the
    longrope case of test_hf_archs proves its parity)."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from kiln.exporter.targets.ort.gqa import fuse_attention

    model = ir.load(tiny_portable / "decode.onnx")
    assert fuse_attention(model, n_kv_heads=2, head_dim=16, tables=lambda cos, sin: None, decode=True) == [0, 1]
    RemoveUnusedNodesPass()(model)
    ops = Counter(n.op_type for n in model.graph)
    assert (
        ops["Softmax"] == 0 and ops["GroupQueryAttention"] == 2 and ops["RotaryEmbedding"] == 0 and ops["Neg"] == 4
    ), ops
    assert all(
        not any(a.name == "do_rotary" for a in n.attributes.values())
        for n in model.graph
        if n.op_type == "GroupQueryAttention"
    )


def _gqa_graph(window: int | None) -> onnx.ModelProto:
    """A decode-shaped graph whose GQA bias is the padding mask, optionally also hiding keys
    more than ``window`` positions back (a sliding window)."""
    from onnx import TensorProto, helper

    h = helper
    nodes = [
        h.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
        h.make_node("Where", ["keep", "zero", "fill"], ["pad_bias"]),
        h.make_node("Unsqueeze", ["pad_bias", "axes"], ["bias"] if window is None else ["pad4"]),
    ]
    if window is not None:  # key j visible only when j >= T - window
        nodes += [
            h.make_node("Shape", ["attention_mask"], ["shape"], start=1, end=2),
            h.make_node("Squeeze", ["shape"], ["total"]),
            h.make_node("Range", ["start", "total", "step"], ["keys"]),
            h.make_node("Sub", ["total", "window"], ["first"]),
            h.make_node("Less", ["keys", "first"], ["old"]),
            h.make_node("Where", ["old", "fill", "pad4"], ["bias"]),
        ]
    nodes.append(
        h.make_node(
            "GroupQueryAttention",
            ["q", "", "", "", "", "", "", "", "", "", "bias"],
            ["out", "pk", "pv"],
            domain="com.microsoft",
            num_heads=1,
            kv_num_heads=1,
        )
    )
    inits = [
        h.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
        h.make_tensor("fill", TensorProto.FLOAT, [], [-3.0e38]),
        h.make_tensor("axes", TensorProto.INT64, [2], [1, 2]),
        h.make_tensor("start", TensorProto.INT64, [], [0]),
        h.make_tensor("step", TensorProto.INT64, [], [1]),
        h.make_tensor("window", TensorProto.INT64, [], [window or 0]),
    ]
    graph = h.make_graph(
        nodes,
        "decode",
        [
            h.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_seq"]),
            h.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", 1, 16]),
        ],
        [h.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 19), h.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize(
    ("window", "max_context", "local"), [(None, 64, None), (8, 64, 8), (100, 64, None), (40, 64, 40)]
)
def test_decode_mask_compacted_when_proven_equal(
    window: int | None, max_context: int, local: int | None, tmp_path: Path
) -> None:
    """The padding-only bias replaces the family's mask when the probes prove it equal; a
    sliding window shorter than the context (and so seen by the probes) becomes GQA's
    local_window_size, one longer is no window at all."""
    import onnx_ir as ir

    from kiln.exporter.targets.ort.decode_mask import compact_decode_bias

    model = ir.from_proto(_gqa_graph(window))
    got = compact_decode_bias(model, tmp_path, max_context)
    assert got.compact
    assert got.local_windows == (
        ((-1, local),) if local is not None else ()
    )  # the test graph's GQA has no layer in its name
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.inputs[10].producer().name == "/ort/decode_mask/Unsqueeze"  # type: ignore[union-attr]
    assert gqa.attributes.get_int("local_window_size", -1) == (local if local is not None else -1)


def test_decode_mask_kept_when_not_a_window(tmp_path: Path) -> None:
    """A bias that hides the first key of every row (no window of one size) keeps the family's mask."""
    import onnx_ir as ir

    from kiln.exporter.targets.ort.decode_mask import compact_decode_bias

    proto = _gqa_graph(8)
    sub = next(n for n in proto.graph.node if n.op_type == "Sub")
    sub.op_type, sub.input[:] = "Identity", ["window"]  # first = 1 for every length: key 0 hidden
    window = next(t for t in proto.graph.initializer if t.name == "window")
    window.int64_data[:] = [1]
    model = ir.from_proto(proto)
    got = compact_decode_bias(model, tmp_path, 64)
    assert not got.compact and got.local_windows == ()
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.inputs[10].producer().name != "/ort/decode_mask/Unsqueeze"  # type: ignore[union-attr]
