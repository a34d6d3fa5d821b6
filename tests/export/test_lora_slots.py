"""``kiln export --lora-slots``: one export, adapters swapped at run time (issue 26, item 2).

A tiny Llama is exported once with slots of rank 8. Two adapters are made by PEFT (random
lora_A/lora_B large enough to change the greedy tokens: asserted, so a slot that did nothing
would fail): one of rank 4 on every attention and MLP projection, one of rank 2 (rank-stabilised,
another alpha) on q_proj and v_proj only. ``kiln adapter`` converts each (after its own parity
against PEFT); then the export's graphs generate each adapter's PEFT ``generate()`` tokens through
``kiln generate --adapter`` (batch 1), through the parity runner fed the file's tensors (a
left-padded batch), and through ONNX Runtime GenAI's ``og.Adapters``; with nothing fed, the base
model's tokens. The refusals are asserted as the one line the CLI prints.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)
peft = pytest.importorskip("peft", reason="LoRA adapters need peft (pip install -e .[hf])")

import onnx  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from jsonschema import Draft202012Validator  # noqa: E402

from kiln.cli import main  # noqa: E402
from kiln.exporter.artifacts.manifest import read  # noqa: E402
from kiln.exporter.contract.io import GraphKind  # noqa: E402
from kiln.exporter.lora.adapter_file import read_adapter_file  # noqa: E402
from kiln.exporter.options import ExportOptions, Precision  # noqa: E402
from kiln.exporter.parity import greedy, make_prompts  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.exporter.runners import OrtRunner  # noqa: E402
from kiln.plugins import load_model  # noqa: E402
from kiln.runtime.generate import Generator  # noqa: E402
from kiln_testing import config_error, hf_greedy, make_adapter, peft_of, save_base  # noqa: E402

STEPS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def slots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slots")
    ckpt = save_base("llama", root / "ckpt")
    paths = {
        "ckpt": ckpt,
        "wide": make_adapter(ckpt, root / "wide", ALL, seed=2),
        "narrow": make_adapter(
            ckpt, root / "narrow", ["q_proj", "v_proj"], seed=3, r=2, lora_alpha=4, use_rslora=True, scale=0.3
        ),
        "out": root / "out",
    }
    result = export(ckpt, paths["out"], ExportOptions.from_flags(max_batch=4, parity_tokens=8, lora_slots=8))
    assert result.parity.passed, result.parity.failures()
    for name in ("wide", "narrow"):
        run = CliRunner().invoke(main, ["adapter", str(paths[name]), "--export", str(paths["out"]), "--json"])
        assert run.exit_code == 0, run.output
        summary = json.loads(run.output[run.output.index("{") :])
        assert summary["parity"]["passed"] and summary["file"] == str(
            paths[name].with_name(f"{name}.onnx_adapter").absolute()
        )
        paths[f"{name}_file"] = Path(summary["file"])
    return paths


def test_every_linear_but_the_head_has_a_slot(slots: dict[str, Path]) -> None:
    manifest = read(slots["out"])
    lora = manifest.lora
    assert lora is not None and (lora.max_rank, lora.dtype) == (8, "float32")
    assert [s.module for s in lora.slots] == [
        f"model.layers.{i}.{p}.{m}"
        for i in range(2)
        for p, m in [*(("self_attn", m) for m in ALL[:4]), *(("mlp", m) for m in ALL[4:])]
    ]
    q = lora.slots[0]
    assert (q.in_features, q.out_features, q.a, q.b, q.rank_dim) == (
        64,
        64,
        "model.layers.0.self_attn.q_proj.lora_A",
        "model.layers.0.self_attn.q_proj.lora_B",
        "model.layers.0.self_attn.q_proj.rank",
    )
    assert (lora.slots[1].out_features, lora.slots[6].in_features) == (32, 128)  # k_proj of 2 KV heads; down_proj
    schema = json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    assert not [
        e.message
        for e in Draft202012Validator(schema).iter_errors(json.loads((slots["out"] / "manifest.json").read_text()))
    ]
    for kind in GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED:
        graph = onnx.load(str(slots["out"] / manifest.graph(kind).file), load_external_data=False)
        inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
        defaults = {t.name: list(t.dims) for t in graph.graph.initializer if t.name.endswith((".lora_A", ".lora_B"))}
        assert inputs[q.a] == [64, q.rank_dim] and inputs[q.b] == [q.rank_dim, 64]
        assert len(defaults) == 28 and defaults[q.a] == [64, 0] and defaults[q.b] == [0, 64]  # rank 0 unless fed
    assert CliRunner().invoke(main, ["verify", str(slots["out"])]).exit_code == 0


def _assert_tokens(out: Path, ckpt: Path, adapter: Path | None, file: Path | None) -> list[int]:
    """Batch 1 through kiln generate's loop (IOBinding, the file's OrtValues bound) and a
    left-padded batch through the parity runner fed the file's tensors equal PEFT's generate();
    returns the batch-1 tokens."""
    spec = load_model(ckpt).spec
    manifest = read(out)
    model = peft_of(ckpt, adapter)
    (prompt,) = make_prompts(spec, [9], seed=1)
    want = hf_greedy(model, [prompt], STEPS)
    got = Generator(out, adapter=file).run(prompt, STEPS, stop_at_eos=False).tokens
    assert list(got) == want[0].tolist(), adapter
    batch = make_prompts(spec, [9, 5], seed=2)
    feeds = read_adapter_file(file, manifest.lora, "test") if file else {}
    graphs = {k: out / manifest.graph(k).file for k in (GraphKind.PREFILL, GraphKind.DECODE)}
    with OrtRunner(graphs, extra_feeds=feeds) as runner:
        tokens, _ = greedy(runner, spec, batch, STEPS)
    np.testing.assert_array_equal(tokens, hf_greedy(model, batch, STEPS), err_msg=str(adapter))
    return [int(t) for t in want[0]]


def test_each_adapter_generates_peft_s_tokens(slots: dict[str, Path]) -> None:
    """Each adapter's PEFT tokens; nothing fed: the base model's; all three differ."""
    seen = [
        _assert_tokens(
            slots["out"], slots["ckpt"], slots[name] if name else None, slots[f"{name}_file"] if name else None
        )
        for name in ("wide", "narrow", None)
    ]
    assert seen[0] != seen[2] and seen[1] != seen[2] and seen[0] != seen[1]  # each adapter changes the tokens


# each architecture of the issue (Llama above), its adapter on every Linear it has; fp16 on Llama
CASES = {
    "qwen2-tied": (ALL, "fp32"),
    "mistral": (ALL, "fp32"),
    "gemma2-window": (ALL, "fp32"),
    "phi3-partial": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "fp32"),  # fused projections
    "gpt2": (["c_attn", "c_proj", "c_fc"], "fp32"),  # Conv1D: Gemm in the graphs, weights [in, out]
    "llama": (ALL, "fp16"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_architectures_swap_adapters(case: str, tmp_path: Path) -> None:
    targets, precision = CASES[case]
    ckpt = save_base(case, tmp_path / "ckpt")
    adapter = make_adapter(ckpt, tmp_path / "adapter", targets, seed=2)
    options = ExportOptions.from_flags(max_batch=4, parity_tokens=8, lora_slots=4, precision=Precision.parse(precision))
    assert export(ckpt, tmp_path / "out", options).parity.passed
    run = CliRunner().invoke(
        main, ["adapter", str(adapter), "--export", str(tmp_path / "out"), "--out", str(tmp_path / "a.onnx_adapter")]
    )
    assert run.exit_code == 0 and "parity passed" in run.output, run.output
    dtype = read(tmp_path / "out").lora.dtype  # type: ignore[union-attr]
    assert dtype == ("float16" if precision == "fp16" else "float32")
    if (
        precision == "fp16"
    ):  # fp16 graphs: kiln adapter's parity (fp16 tolerances) is the proof; greedy ties may flip against fp32 PEFT
        return
    other = make_adapter(
        ckpt, tmp_path / "other", targets[-2:], seed=5, r=2, scale=0.3
    )  # a second adapter on fewer modules (the MLP), another rank
    run = CliRunner().invoke(
        main,
        [
            "adapter",
            str(other),
            "--export",
            str(tmp_path / "out"),
            "--out",
            str(tmp_path / "b.onnx_adapter"),
            "--no-check",
        ],
    )
    assert run.exit_code == 0 and "parity" not in run.output, run.output
    seen = [
        _assert_tokens(tmp_path / "out", ckpt, a, f)
        for a, f in ((adapter, tmp_path / "a.onnx_adapter"), (other, tmp_path / "b.onnx_adapter"), (None, None))
    ]
    assert seen[0] != seen[2] and seen[1] != seen[2] and seen[0] != seen[1]


def test_genai_loads_kiln_s_adapter_files(slots: dict[str, Path]) -> None:
    """ONNX Runtime GenAI's own adapter API (og.Adapters, set_active_adapter per generator) on the
    export's model.onnx: each adapter's PEFT tokens, and with none the base model's."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a test dependency")
    ckpt, onnx_dir = slots["ckpt"], slots["out"] / "onnx"
    model = og.Model(str(onnx_dir))
    adapters = og.Adapters(model)
    for name in ("wide", "narrow"):
        adapters.load(str(slots[f"{name}_file"]), name)
    prompt = make_prompts(load_model(ckpt).spec, [7], seed=5)[0]
    eos = load_model(ckpt).spec.eos_token_id
    for name in ("wide", "narrow", None):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + STEPS, batch_size=1)
        generator = og.Generator(model, params)
        if name is not None:
            generator.set_active_adapter(adapters, name)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        got = generator.get_sequence(0)[len(prompt) :].tolist()
        want = hf_greedy(peft_of(ckpt, slots[name] if name else None), [prompt], STEPS)[0].tolist()
        want = want[: want.index(eos) + 1] if eos in want else want  # GenAI stops at the end token
        assert got == want and len(want) >= 4, (name, got, want)


def test_kiln_check_adapter_and_a_changed_slot_fails(slots: dict[str, Path], tmp_path: Path) -> None:
    """kiln check --adapter proves the adapter; the same check of an adapter whose tensors were
    changed after conversion (fed the wrong module's slot) would fail: shown by the runner directly."""
    run = CliRunner().invoke(main, ["check", str(slots["out"]), "--adapter", str(slots["narrow"])])
    assert run.exit_code == 0 and "parity passed" in run.output, run.output
    from kiln.exporter.check import check_dir
    from kiln.exporter.lora import adapter_file

    real = adapter_file.slot_tensors

    def swapped(adapter: Any, lora: Any, where: str) -> dict[str, np.ndarray]:
        tensors = real(adapter, lora, where)
        q, v = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
        tensors[f"{q}.lora_A"], tensors[f"{v}.lora_A"] = tensors[f"{v}.lora_A"], tensors[f"{q}.lora_A"]
        return tensors

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapter_file, "slot_tensors", swapped)
        assert not check_dir(slots["out"], adapter=slots["narrow"]).passed


def test_refusals(slots: dict[str, Path], tmp_path: Path) -> None:
    ckpt, out = slots["ckpt"], str(slots["out"])
    head = make_adapter(ckpt, tmp_path / "head", ["q_proj", "lm_head"], seed=4)
    assert (
        config_error("adapter", str(head), "--export", out)
        == f"--adapter {head}: the export has no LoRA slot for lm_head (slots: every Linear but the output head, or "
        "those --lora-targets names); merge this adapter with kiln export --adapter"
    )
    big = make_adapter(ckpt, tmp_path / "big", ["q_proj"], seed=4, r=16)
    assert (
        config_error("adapter", str(big), "--export", out)
        == f"--adapter {big}: its rank 16 exceeds the export's --lora-slots 8; export again with --lora-slots 16 or "
        "more"
    )
    assert (
        config_error("adapter", str(slots["wide"]), "--export", out)
        == f"{slots['wide_file']}: already exists; pass --force to replace it"
    )
    dora = make_adapter(ckpt, tmp_path / "dora", ["q_proj"], seed=4, use_dora=True)
    assert config_error("adapter", str(dora), "--export", out).startswith(
        f"--adapter {dora}: use_dora=True is not supported"
    )
    assert not list(tmp_path.glob("*.onnx_adapter")) and not list(tmp_path.glob(".*kiln-tmp"))
    bogus = tmp_path / "bogus.onnx_adapter"
    bogus.write_bytes(b"not an adapter")
    run = CliRunner().invoke(main, ["generate", out, "--ids", "5,6", "--adapter", str(bogus)])
    assert run.exit_code == 1 and f"--adapter {bogus}: not an ONNX Runtime adapter file" in run.output, run.output
    assert config_error(
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(tmp_path / "x"),
        "--lora-slots",
        "4",
        "--int8",
        "--calib-data",
        "synthetic",
    ) == (
        "--lora-slots with int8: slots are built on float and int4 (weight-only) bases only; int8 and fp8 "
        "quantize the activations the adapters would read"
    )
    assert config_error(
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(tmp_path / "x"),
        "--lora-slots",
        "4",
        "--adapter",
        str(slots["wide"]),
    ).startswith("--lora-slots with --adapter: either merge")
    assert config_error("export", "--model", "demo", "--out", str(tmp_path / "x"), "--lora-slots", "4").startswith(
        "--lora-slots: kiln writes LoRA slots on Hugging Face decoder checkpoints only"
    )
    assert config_error(
        "export",
        "--model",
        str(ckpt),
        "--out",
        str(tmp_path / "x"),
        "--lora-slots",
        "4",
        "--lora-targets",
        "q_proj,qproj",
    ) == (
        "--lora-targets: qproj names no Linear of the model that can take a slot; it has down_proj, gate_proj, "
        "k_proj, o_proj, q_proj, up_proj, v_proj"
    )
    assert (
        config_error("export", "--model", str(ckpt), "--out", str(tmp_path / "x"), "--lora-targets", "q_proj")
        == "--lora-targets only applies with --lora-slots RANK"
    )
    assert not (tmp_path / "x").exists()


def test_adapter_out_never_replaces_what_it_reads_or_a_user_file(slots: dict[str, Path], tmp_path: Path) -> None:
    """kiln adapter --out ... --force: never a file of the export, of the PEFT adapter or of the
    base checkpoint (found by an adversarial pass: each was overwritten), never a user's other
    file; each refused in one line before anything is computed, the file unchanged."""
    ckpt, out, adapter = slots["ckpt"], slots["out"], slots["narrow"]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    inside = {
        out / "onnx" / "weights.bin": out,
        out / "new.onnx_adapter": out,
        adapter / "adapter_model.safetensors": adapter,
        ckpt / "model.safetensors": ckpt,
    }
    for path, source in inside.items():
        before = path.read_bytes() if path.exists() else None
        message = config_error(
            "adapter", str(adapter), "--export", str(out), "--no-check", "--out", str(path), "--force"
        )
        assert message == f"{path}: inside {source}, which this command reads; --out names a file outside it"
        assert (path.read_bytes() if path.exists() else None) == before
    assert config_error(
        "adapter", str(adapter), "--export", str(out), "--no-check", "--out", str(notes), "--force"
    ) == (
        f"{notes}: --force replaces only an ONNX Runtime adapter file (*.onnx_adapter) kiln wrote, and this is "
        "another file; nothing was replaced"
    )
    assert notes.read_text() == "mine"


def test_adapter_never_writes_through_a_planted_temporary_name(slots: dict[str, Path], tmp_path: Path) -> None:
    """Issue 38, item 1: a link at the old fixed temporary name (``.NAME.partial``) made kiln adapter
    write the adapter into the file it pointed to and leave --out a link to it; a plain file there was
    deleted. Temporary files are now new, under a random name: neither is touched, --out is a file."""
    target = tmp_path / "adf"
    target.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    (target / ".q.onnx_adapter.partial").symlink_to(victim)
    (target / ".r.onnx_adapter.partial").write_text("also the user's")
    for name in ("q", "r"):
        run = CliRunner().invoke(
            main,
            [
                "adapter",
                str(slots["narrow"]),
                "--export",
                str(slots["out"]),
                "--no-check",
                "--out",
                str(target / f"{name}.onnx_adapter"),
            ],
        )
        assert run.exit_code == 0, run.output
        written = target / f"{name}.onnx_adapter"
        assert written.is_file() and not written.is_symlink()
        got, expected = (
            read_adapter_file(path, read(slots["out"]).lora, "test") for path in (written, slots["narrow_file"])
        )
        assert set(got) == set(expected) and all(np.array_equal(got[n], expected[n]) for n in expected)
    assert victim.read_text() == "the user's" and (target / ".q.onnx_adapter.partial").is_symlink()
    assert (target / ".r.onnx_adapter.partial").read_text() == "also the user's"
    assert sorted(p.name for p in target.iterdir()) == [
        ".q.onnx_adapter.partial",
        ".r.onnx_adapter.partial",
        "q.onnx_adapter",
        "r.onnx_adapter",
    ]


def test_lora_targets_slot_those_modules_only(slots: dict[str, Path], tmp_path: Path) -> None:
    """--lora-targets q_proj,v_proj: slots on those only; the narrow adapter (q_proj, v_proj)
    converts and generates PEFT's tokens, the wide one is refused by its first unslotted module."""
    out = tmp_path / "qv"
    assert export(
        slots["ckpt"],
        out,
        ExportOptions.from_flags(max_batch=4, parity_tokens=4, lora_slots=4, lora_targets=("q_proj", "v_proj")),
    ).parity.passed
    written = read(out).lora.slots  # type: ignore[union-attr]
    assert [s.module.rsplit(".", 2)[-1] for s in written] == ["q_proj", "v_proj"] * 2
    assert config_error("adapter", str(slots["wide"]), "--export", str(out), "--no-check").startswith(
        f"--adapter {slots['wide']}: the export has no LoRA slot for model.layers.0.mlp.down_proj"
    )
    run = CliRunner().invoke(
        main, ["adapter", str(slots["narrow"]), "--export", str(out), "--out", str(tmp_path / "n.onnx_adapter")]
    )
    assert run.exit_code == 0, run.output
    _assert_tokens(out, slots["ckpt"], slots["narrow"], tmp_path / "n.onnx_adapter")


def test_an_export_without_slots_is_refused(tmp_path: Path) -> None:
    from kiln.exporter.artifacts.manifest import read as read_manifest

    ckpt = save_base("llama", tmp_path / "ckpt")
    adapter = make_adapter(ckpt, tmp_path / "adapter", ["q_proj"], seed=2)
    export(ckpt, tmp_path / "plain", ExportOptions.from_flags(max_batch=2, parity_tokens=4))
    assert read_manifest(tmp_path / "plain").lora is None
    assert config_error("adapter", str(adapter), "--export", str(tmp_path / "plain")).startswith(
        f"--adapter {adapter}: {tmp_path / 'plain'} has no LoRA slots"
    )
    assert config_error("check", str(tmp_path / "plain"), "--adapter", str(adapter)).startswith(
        f"--adapter {adapter}: {tmp_path / 'plain'} has no LoRA slots"
    )


def test_bench_times_an_adapter_beside_rank_0(slots: dict[str, Path], tmp_path: Path) -> None:
    """kiln bench --adapter: the export's rank-0 row and the same graphs with the adapter bound
    (what the adapter's slots cost); timings are not asserted, only that both rows ran."""
    out, file = str(slots["out"]), str(slots["wide_file"])
    run = CliRunner().invoke(
        main,
        [
            "bench",
            out,
            "--adapter",
            file,
            "--runs",
            "3",
            "--no-torch",
            "--no-roofline",
            "--past",
            "8",
            "--prefill-seq",
            "8",
            "--json",
        ],
    )
    assert run.exit_code == 0, run.output
    result = json.loads(run.output[run.output.index("{") :])
    labels = ["kiln fp32 (out)", "kiln fp32 (out) + wide.onnx_adapter"]
    assert [d["label"] for d in result["directories"]] == labels and all(
        result["median_ms"][k][lab] > 0 for k in ("prefill", "decode") for lab in labels
    )
    plain = tmp_path / "plain"
    export(slots["ckpt"], plain, ExportOptions.from_flags(max_batch=2, parity_tokens=4))
    run = CliRunner().invoke(main, ["bench", str(plain), "--adapter", file, "--runs", "3", "--no-torch"])
    assert (
        run.exit_code == 1
        and f"--adapter {file}: no directory given is a kiln export with LoRA slots (kiln export --lora-slots RANK)"
        in run.output
    ), run.output


@pytest.mark.slow
def test_an_int4_base_with_float_adapters(slots: dict[str, Path], tmp_path: Path) -> None:
    """QLoRA-style serving: int4 (RTN) base weights, the adapter in float on the slots. kiln
    adapter's parity is against PEFT's model over the export's own int4 numbers (fp32 tolerance;
    the --target ort graphs' MatMulNBits at theirs);
    here the tokens are compared independently: kiln generate with the adapter equals PEFT's
    generate() over the dequantized int4 base, and without one the int4 base alone."""
    from kiln.exporter.parity.quantized import read_int4_weights, use_int4_weights
    from kiln.exporter.precision.kinds import Int4
    from kiln.exporter.precision.kinds.int4 import Int4Method
    from kiln.plugins.hf.decoder import HFDecoder

    ckpt, out = slots["ckpt"], tmp_path / "out"
    int4 = Precision.of(Int4(method=Int4Method.RTN, block=16))
    options = ExportOptions.from_flags(
        max_batch=4, parity_tokens=8, lora_slots=8, precision=int4, parity_agreement="record", target="ort"
    )  # MatMulNBits there
    assert export(ckpt, out, options).parity.passed
    run = CliRunner().invoke(
        main, ["adapter", str(slots["wide"]), "--export", str(out), "--out", str(tmp_path / "a.onnx_adapter")]
    )
    assert run.exit_code == 0 and "portable vs int4 weights" in run.output and "ort vs int4 weights" in run.output, (
        run.output
    )
    graphs = [out / read(out).graph(k).file for k in (GraphKind.PREFILL,)]
    (prompt,) = make_prompts(load_model(ckpt).spec, [9], seed=1)
    seen = []
    for adapter, file in ((slots["wide"], tmp_path / "a.onnx_adapter"), (None, None)):
        model = peft_of(ckpt, adapter)
        inner = model.base_model.model if adapter is not None else model  # the transformers model PEFT injected into
        assert use_int4_weights(
            HFDecoder(inner), read_int4_weights(graphs)
        )  # PEFT's LoRA layers keep calling their base_layer
        want = hf_greedy(model, [prompt], STEPS)[0].tolist()
        assert list(Generator(out, adapter=file).run(prompt, STEPS, stop_at_eos=False).tokens) == want
        seen.append(want)
    assert seen[0] != seen[1]


def test_non_finite_adapter_tensors_are_refused(slots: dict[str, Path], tmp_path: Path) -> None:
    """Issue 38, item 9: an adapter file holding one NaN passed the file checks and kiln generate printed
    ``0 0 0 ...`` with exit 0; kiln adapter --no-check wrote an adapter of infinities. Both refused in one line."""
    from kiln.exporter.lora.adapter_file import write_adapter_file

    out = str(slots["out"])
    tensors = read_adapter_file(slots["narrow_file"], read(slots["out"]).lora, "test")
    name = sorted(tensors)[0]
    poisoned = {**tensors, name: tensors[name].copy()}
    poisoned[name].flat[0] = np.nan
    nan_file = tmp_path / "nan.onnx_adapter"
    write_adapter_file(poisoned, nan_file)
    run = CliRunner().invoke(main, ["generate", out, "--ids", "5,6", "--adapter", str(nan_file)])
    assert run.exit_code == 1 and not run.stdout and "Traceback" not in run.stderr
    assert (
        run.stderr.strip()
        == f"error: generate: config: --adapter {nan_file}: {_slot_module(slots, name)}: holds NaN or infinite values"
    )
    huge = tmp_path / "huge"
    shutil.copytree(slots["narrow"], huge)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(huge / "adapter_model.safetensors"))
    key = next(k for k in sorted(weights) if k.endswith("lora_B.weight"))
    weights[key] = weights[key].clone().fill_(3e38)
    save_file(weights, str(huge / "adapter_model.safetensors"))
    target = tmp_path / "huge.onnx_adapter"
    message = config_error("adapter", str(huge), "--export", out, "--no-check", "--out", str(target))
    assert message.endswith(
        "'s tensors, scaled by weight x scaling, overflow the export's float32 slots"
    ) and message.startswith(f"--adapter {huge}: model.layers.")
    assert not target.exists()


def _slot_module(slots: dict[str, Path], name: str) -> str:
    return next(slot.module for slot in read(slots["out"]).lora.slots if name in (slot.a, slot.b))
