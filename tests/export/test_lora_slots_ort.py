"""``kiln export --lora-slots R --target ort``: the ONNX Runtime-target graphs keep the portable
graphs' LoRA slots, and their fusions carry them (issue 26, item 2).

A tiny Llama is exported once with slots of rank 8 and ``--target ort``. The ORT graphs have the
portable graphs' slot inputs (names, shapes, dtype, rank-0 defaults), each read by a MatMul (a
packing pass that took a slot's default for a constant would bake rank 0 in), and still fuse:
GroupQueryAttention in every layer, q/k/v packed with the three LoRA deltas carried into the
packed value, and decode's GQA rotating that packed QKV itself (nothing reported unfused). One
PEFT adapter (random A and B, large enough to change the greedy tokens: asserted) is converted by
``kiln adapter``, whose parity covers the ORT graphs fed it; ``kiln generate --target ort
--adapter`` (the in-place KV cache, the adapter bound through IOBinding) gives PEFT's
``generate()`` tokens. Qwen2 (q/k/v biases: its projections are not packed, as without slots) the
same way. With ``--ort-int8`` the base weights are int8 MatMulNBits and the slots stay float
MatMuls beside them. ``--target onnx`` is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)
peft = pytest.importorskip("peft", reason="LoRA adapters need peft (pip install -e .[hf])")

import onnx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from kiln.cli import main  # noqa: E402
from kiln.exporter.artifacts.manifest import read  # noqa: E402
from kiln.exporter.contract.io import GraphKind  # noqa: E402
from kiln.exporter.options import ExportOptions  # noqa: E402
from kiln.exporter.parity import make_prompts  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.plugins import load_model  # noqa: E402
from kiln.runtime.generate import Generator  # noqa: E402
from kiln_testing import config_error, hf_greedy, make_adapter, peft_of, save_base  # noqa: E402

STEPS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KINDS = (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED)


def _exported(case: str, root: Path, **options: Any) -> dict[str, Path]:
    """``case`` exported with slots of rank 8 and --target ort (and ``options``; parity passed),
    and one adapter on every projection converted by ``kiln adapter`` (its parity passed, the ORT
    graphs among them)."""
    ckpt = save_base(case, root / "ckpt")
    paths = {"ckpt": ckpt, "adapter": make_adapter(ckpt, root / "adapter", ALL, seed=2), "out": root / "out"}
    result = export(
        ckpt,
        paths["out"],
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, lora_slots=8, target="ort", **options),
    )
    assert result.parity.passed, result.parity.failures()
    run = CliRunner().invoke(main, ["adapter", str(paths["adapter"]), "--export", str(paths["out"]), "--json"])
    assert run.exit_code == 0, run.output
    summary = json.loads(run.output[run.output.index("{") :])
    parity = summary["parity"]
    assert parity["passed"]
    ort_runs = {g["path"] for g in parity["generation"] if g.get("target") == "ort"}
    assert ort_runs == {"ort:prefill+decode", "ort:model"}, parity[
        "generation"
    ]  # the adapter proved on the ORT graphs too
    assert {t["graph"] for t in parity["tensors"] if t.get("target") == "ort"} == {
        "prefill.ort",
        "decode.ort",
        "model.ort",
    }
    paths["file"] = Path(summary["file"])
    return paths


def _graph(out: Path, file: str) -> onnx.ModelProto:
    return onnx.load(str(out / file), load_external_data=False)


def _slots(graph: onnx.ModelProto) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The slot inputs (name -> (dtype, dims)) and their initializers' dims."""
    inputs = {
        i.name: (i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
        for i in graph.graph.input
    }
    defaults = {t.name: list(t.dims) for t in graph.graph.initializer if t.name.endswith((".lora_A", ".lora_B"))}
    return {k: v for k, v in inputs.items() if k.endswith((".lora_A", ".lora_B"))}, defaults


def _assert_ort_slots(out: Path) -> dict[GraphKind, onnx.ModelProto]:
    """Each ORT graph has its portable graph's slot inputs and defaults, each read by a MatMul."""
    manifest = read(out)
    assert manifest.lora is not None and manifest.targets is not None
    graphs = {}
    for kind in KINDS:
        portable = _slots(_graph(out, manifest.graph(kind).file))
        graphs[kind] = _graph(out, manifest.targets["ort"].graphs[kind.value].file)
        assert _slots(graphs[kind]) == portable and len(portable[0]) == 2 * len(manifest.lora.slots)
        readers: dict[str, set[str]] = {}
        for node in graphs[kind].graph.node:
            for name in set(node.input) & set(portable[0]):
                readers.setdefault(name, set()).add(node.op_type)
        assert readers == {name: {"MatMul"} for name in portable[0]}, (
            kind
        )  # each read, by MatMuls only: none baked into a packed or int8 weight
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    return graphs


def _ops(graph: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in graph.graph.node if n.op_type == op]


def _assert_tokens(paths: dict[str, Path]) -> None:
    """kiln generate --target ort --adapter gives PEFT's tokens; nothing fed, the base model's."""
    spec = load_model(paths["ckpt"]).spec
    (prompt,) = make_prompts(spec, [9], seed=1)
    tokens = {}
    for adapter, file in ((paths["adapter"], paths["file"]), (None, None)):
        generator = Generator(paths["out"], target="ort", adapter=file)
        assert generator.kv_cache == "shared-buffer"  # the in-place decode, the adapter bound beside it
        tokens[adapter] = list(generator.run(prompt, STEPS, stop_at_eos=False).tokens)
        assert tokens[adapter] == hf_greedy(peft_of(paths["ckpt"], adapter), [prompt], STEPS)[0].tolist(), adapter
    assert tokens[paths["adapter"]] != tokens[None]  # the adapter changes the tokens


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _exported("llama", tmp_path_factory.mktemp("slots_ort"))


def test_ort_graphs_keep_the_slots_and_their_fusions(llama: dict[str, Path]) -> None:
    graphs = _assert_ort_slots(llama["out"])
    ort = read(llama["out"]).targets["ort"]  # type: ignore[index]
    passes = {kind: ort.graphs[kind.value].passes for kind in KINDS}
    for kind in GraphKind.PREFILL, GraphKind.DECODE:
        assert len(_ops(graphs[kind], "GroupQueryAttention")) == 2 and passes[kind]["attention"] == {"layers": [0, 1]}
        assert "not_fused" not in passes[kind], passes[
            kind
        ]  # q/k/v packed, decode's rotary in GQA: every fusion as without slots
        concats = [n for n in _ops(graphs[kind], "Concat") if "qkv_proj/ort/packed/lora/" in n.name]
        assert len(concats) == 2 and all(
            len(n.input) == 3 for n in concats
        )  # the q/k/v deltas carried into each packed QKV
    decode_gqa = _ops(graphs[GraphKind.DECODE], "GroupQueryAttention")
    assert all(any(a.name == "do_rotary" and a.i == 1 for a in n.attribute) for n in decode_gqa)
    assert (
        len(_ops(graphs[GraphKind.DECODE], "RotaryEmbedding")) == 0
        and len(_ops(graphs[GraphKind.PREFILL], "RotaryEmbedding")) == 4
    )
    assert len(_ops(graphs[GraphKind.UNIFIED], "SkipSimplifiedLayerNormalization")) == 4


def test_ort_generate_with_an_adapter(llama: dict[str, Path]) -> None:
    _assert_tokens(llama)


def test_kiln_check_adapter_on_the_ort_graphs(llama: dict[str, Path]) -> None:
    run = CliRunner().invoke(main, ["check", str(llama["out"]), "--adapter", str(llama["adapter"])])
    assert run.exit_code == 0 and "parity passed" in run.output, run.output


@pytest.mark.slow
def test_qwen2_biased_projections(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases sit between each projection and attention: q/k/v are not packed for
    GQA (reported, as without slots), the generic packing packs their base MatMuls and the deltas
    follow; GQA still fuses, and the adapter's tokens are PEFT's."""
    paths = _exported("qwen2-tied", tmp_path)
    graphs = _assert_ort_slots(paths["out"])
    passes = read(paths["out"]).targets["ort"].graphs["prefill"].passes  # type: ignore[index]
    assert len(_ops(graphs[GraphKind.PREFILL], "GroupQueryAttention")) == len(passes["attention"]["layers"]) > 0
    assert passes["not_fused"]["qkv_pack"] and all(
        "q/k/v are not three MatMuls (q by Add, k by Add, v by Add)" in why for why in passes["not_fused"]["qkv_pack"]
    )
    _assert_tokens(paths)


@pytest.mark.slow
def test_ort_int8_keeps_the_slots_float(tmp_path: Path) -> None:
    """--ort-int8: every base weight MatMul (q/k/v and gate/up packed, o, down, the head) is an
    int8 MatMulNBits, every slot's A and B a float MatMul (``_assert_ort_slots``) whose delta is
    added to the MatMulNBits' output (or the packed one's Split); kiln adapter's parity, at the
    int8 tolerances against PEFT's model, passed on these graphs, and the adapter changes the
    tokens (int8 weights: PEFT's fp32 greedy tokens are parity's agreement, not asserted here)."""
    paths = _exported("llama", tmp_path, target_flags={"ort_int8": True})
    decode = _assert_ort_slots(paths["out"])[GraphKind.DECODE]
    made = {out: node.op_type for node in decode.graph.node for out in node.output}
    assert len(_ops(decode, "MatMulNBits")) == 2 * 4 + 1 and len(_ops(decode, "MatMul")) == 2 * 2 * len(
        ALL
    )  # the slots' two MatMuls each
    lora = [n for n in _ops(decode, "Add") if "/lora/" in n.name]
    assert (
        sorted(made[n.input[0]] for n in lora) == ["MatMulNBits"] * 6 + ["Split"] * 4
    )  # packed q/k/v, o, down; gate and up
    spec = load_model(paths["ckpt"]).spec
    (prompt,) = make_prompts(spec, [9], seed=1)
    runs = [
        Generator(paths["out"], target="ort", adapter=file).run(prompt, STEPS, stop_at_eos=False).tokens
        for file in (paths["file"], None)
    ]
    assert runs[0] != runs[1]


def test_refusals(llama: dict[str, Path], tmp_path: Path) -> None:
    ckpt = str(llama["ckpt"])
    assert config_error(
        "export", "--model", ckpt, "--out", str(tmp_path / "x"), "--lora-slots", "4", "--target", "onnx"
    ) == ("--lora-slots with --target onnx: slots are built on the portable graphs and --target ort only")
    assert not (tmp_path / "x").exists()
