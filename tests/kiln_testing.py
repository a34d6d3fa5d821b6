"""Test helpers: tiny checkpoints written in-process with a seed (importable from every tier)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save_model

from kiln.exporter.artifacts.manifest import Manifest
from kiln.plugins.native import spec_of
from kiln.plugins.native.build import random_model
from kiln.plugins.native.config import NativeConfig, PLEConfig
from kiln.plugins.native.model import PLEDecoder

TINY = dict(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_context=48)


def tiny_config(**overrides: Any) -> NativeConfig:
    """The tiny test model with some fields changed; ``ple`` may be a dict of PLEConfig fields."""
    fields = {**TINY, **overrides}
    fields["ple"] = PLEConfig(**{"max_positions": 48, **fields.get("ple", {})})
    return NativeConfig(**fields)


def write_checkpoint(
    directory: Path, cfg: NativeConfig, seed: int = 0, edit: Callable[[PLEDecoder], None] | None = None
) -> Path:
    """A random native checkpoint; ``edit`` changes the model's weights in place before it is saved."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save(directory / "config.json")
    model = random_model(cfg, seed)
    if edit is not None:
        edit(model)
    save_model(model, str(directory / "model.safetensors"))
    return directory


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def typed_manifest(data: dict[str, Any]) -> Manifest:
    """A ``Manifest`` from the parts of manifest.json a test writes (graphs, limits, files...);
    every other field gets a placeholder of the right type."""
    spec = spec_of(tiny_config())
    base: dict[str, Any] = {
        "manifest_version": 2,
        "family": "native",
        "checkpoint": {"reference": None, "files": {}, "dtype": "float32"},
        "config": {},
        "model": {
            "n_layers": spec.n_layers,
            "n_kv_heads": spec.n_kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            "encoder_dim": None,
        },
        "precision": "fp32",
        "kv_cache": {"layout": "BNSH", "dims": ["batch", "n_kv_heads", "seq", "head_dim"], "dtype": "float32"},
        "limits": {"max_batch": 8, "max_context": 48},
        "export": {"opset": 19, "keep_fp32": [], "calibration": None, "logits": "all", "ple": None},
        "graphs": {},
        "weights": {"file": "onnx/weights.bin", "tensors": 0, "bytes": 0},
        "tokenizer": None,
        "parity": {"passed": True, "report": "reports/parity.json"},
        "tools": {},
        "files": {},
    }
    merged = {**base, **data}
    merged["graphs"] = {k: {"outputs": [], **g} for k, g in merged["graphs"].items()}
    return Manifest.from_json(merged)


def with_std_target(m: dict[str, Any], kv_dtype: str = "float32") -> dict[str, Any]:
    """``m`` (a manifest dict of the tiny native model, with its limits) with ``targets.onnx``: the
    ``--target onnx`` graphs' I/O recorded as the export records it (``contract.static_cache.static_io``)."""
    from kiln.exporter.contract.io import DECODER_KINDS
    from kiln.exporter.contract.static_cache import static_io

    spec = spec_of(tiny_config())
    graphs = {}
    for kind in DECODER_KINDS:
        io = static_io(spec, kind, max_context=m["limits"]["max_context"], kv_dtype=kv_dtype)
        graphs[kind.value] = {
            "file": f"onnx/{kind.value}.std.onnx",
            "inputs": [t.to_dict() for t in io.inputs],
            "outputs": [t.to_dict() for t in io.outputs],
        }
    m["targets"] = {
        "onnx": {
            "precision": "fp32",
            "kv_cache": "static",
            "graphs": graphs,
            "weights": {"file": "onnx/weights.std.bin", "bytes": 0},
        }
    }
    return m


def _io_graph(graph: dict[str, Any], opset: int | None = None) -> bytes:
    """An ONNX model with exactly a manifest graph entry's inputs and outputs and no nodes: what
    kiln verify reads of a graph (tests of code that never runs it, such as the engine build
    against a stand-in TensorRT)."""
    import onnx
    from onnx import helper

    def values(entries: list[dict[str, Any]]) -> list[Any]:
        return [
            helper.make_tensor_value_info(e["name"], helper.np_dtype_to_tensor_dtype(np.dtype(e["dtype"])), e["shape"])
            for e in entries
        ]

    opsets = [helper.make_opsetid("", opset)] if opset is not None else None
    model = helper.make_model(
        helper.make_graph([], "placeholder", values(graph["inputs"]), values(graph.get("outputs", []))),
        opset_imports=opsets,
    )
    return bytes(onnx.ModelProto.SerializeToString(model))


def placeholder_export(directory: Path, m: dict[str, Any]) -> Path:
    """A directory that passes kiln verify: a graph with the manifest's I/O for each of its graphs,
    placeholder weights and report files, and the manifest hashing them all."""
    from kiln.exporter.artifacts import manifest as manifest_mod
    from kiln.exporter.artifacts.hashing import hash_tree

    typed = typed_manifest(m)  # the placeholders of the fields m leaves out
    targets = [
        entry for entry in (m.get("targets") or {}).values()
    ]  # a target's graphs and weights too (--target onnx's static contract)
    for graph in m["graphs"].values():  # kiln verify holds export.opset to the portable graphs'
        (directory / graph["file"]).parent.mkdir(parents=True, exist_ok=True)
        (directory / graph["file"]).write_bytes(_io_graph(graph, typed.export.opset))
    for graph in (g for entry in targets for g in entry["graphs"].values()):
        (directory / graph["file"]).parent.mkdir(parents=True, exist_ok=True)
        (directory / graph["file"]).write_bytes(_io_graph(graph))
    for rel in (typed.weights.file, typed.parity.report, *(entry["weights"]["file"] for entry in targets)):
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(b"placeholder")
    m["weights"] = {
        **dataclasses.asdict(typed.weights),
        "bytes": len(b"placeholder"),
    }  # verify holds the sizes to the files
    for entry in targets:
        entry["weights"] = {**entry["weights"], "bytes": len(b"placeholder")}
    m["checkpoint"] = {
        **dataclasses.asdict(typed.checkpoint),
        "files": dict(typed.checkpoint.files) or {"model.safetensors": "0" * 64},
    }
    m["files"] = hash_tree(directory)
    manifest_mod.write(directory, typed_manifest(m))
    return directory


class RecordedProgress:
    """A ``Progress`` that records every stage (description -> [total, steps advanced], a
    description seen twice adds up) and every note."""

    def __init__(self) -> None:
        self.stages: dict[str, list[int]] = {}
        self.notes: list[str] = []

    @contextlib.contextmanager
    def stage(self, description: str, total: int = 1) -> Iterator[Any]:
        counts = self.stages.setdefault(description, [0, 0])
        counts[0] += total

        class Stage:
            def advance(self, steps: int = 1) -> None:
                counts[1] += steps

        yield Stage()

    def note(self, message: str) -> None:
        self.notes.append(message)


def downgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A version-2 manifest in version 1's layout (what the previous kiln wrote): the inverse of
    ``upgrade_v1``, which ``test_downgrade_inverts_the_upgrade`` proves on the fixtures."""
    out = dict(data, manifest_version=1)
    fields = {
        ("int8", "nodes"): "int8_nodes",
        ("int4", "nodes"): "int4_nodes",
        ("fp8", "nodes"): "fp8_nodes",
        ("fp16", "fp32_nodes"): "fp32_nodes",
        ("fp16", "fp32_ple_tables"): "fp32_ple_tables",
    }
    out["graphs"] = {kind: _flat(g, fields) for kind, g in data["graphs"].items()}
    if data.get("targets"):
        ort = data["targets"]["ort"]
        graphs = {kind: _ort_graph(kind, g) for kind, g in ort["graphs"].items()}
        entry = {
            "precision": ort["precision"],
            "int8": (ort.get("record") or {}).get("int8"),
            "graphs": graphs,
            "weights": ort["weights"],
        }
        if "int4" in (ort.get("record") or {}):
            entry["int4"] = ort["record"]["int4"]
        out["targets"] = {"ort": entry}
    return out


def _flat(graph: dict[str, Any], fields: dict[tuple[str, str], str]) -> dict[str, Any]:
    out = {k: v for k, v in graph.items() if k != "passes"}
    for (report, key), field in fields.items():
        if key in graph.get("passes", {}).get(report, {}):
            out[field] = graph["passes"][report][key]
    return out


def _ort_graph(kind: str, graph: dict[str, Any]) -> dict[str, Any]:
    passes = graph.get("passes", {})
    out = {
        "file": graph["file"],
        "fused_attention_layers": passes.get("attention", {}).get("layers", []),
        "compact_decode_mask": passes.get("decode_mask", {}).get("compact", False),
        "fused_rms_norms": passes.get("rms_norm", {}).get("fused", 0),
        "fused_skip_norms": passes.get("skip_rms_norm", {}).get("fused", 0),
        "packed_matmuls": passes.get("pack", {}).get("matmuls", []),
        "int8_nodes": passes.get("nbits_int8", {}).get("nodes", []),
    }
    optional = {
        "int4_nodes": ("nbits_int4", "nodes"),
        "moe_layers": ("moe", "layers"),
        "moe_not_fused": ("moe", "not_fused"),
        "local_window_layers": ("decode_mask", "local_window_layers"),
    }
    out |= {field: passes[r][k] for field, (r, k) in optional.items() if k in passes.get(r, {})}
    return out


HEAVY = ("torch", "onnxruntime", "transformers")

_PROBE = """
import json, sys
from kiln.cli import main
code = 0
try:
    main({args!r}, standalone_mode=False)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
except BaseException:
    code = -1
print(json.dumps([code, sorted(m for m in {heavy!r} if m in sys.modules)]))
"""


def heavy_imports(*args: str) -> tuple[int, list[str]]:
    """The exit code of ``kiln ARGS`` run in a fresh interpreter (-1: an exception that is no exit)
    and the heavy modules (``HEAVY``) it imported."""
    probe = _PROBE.format(args=list(args), heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    code, imported = json.loads(done.stdout.strip().splitlines()[-1])
    return int(code), list(imported)


def config_error(*args: str) -> str:
    """The one-line ``config`` refusal of ``kiln ARGS`` (exit code 1, no traceback), without its prefix."""
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: config: "), line
    return line.removeprefix("error: config: ")


def exact(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern matching ``message`` whole."""
    return "^" + re.escape(message) + "$"


def run_graph(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An onnx-ir model run once by ONNX Runtime (CPU): its outputs by name."""
    import onnx_ir as ir
    import onnxruntime as ort

    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def save_base(case: str, directory: Path, **overrides: Any) -> Path:
    """A tiny Hugging Face model of ``TINY[case]`` saved by transformers (safetensors) in ``directory``."""
    from kiln.plugins.hf import tiny_model

    tiny_model(case, seed=1, **overrides).module.model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_model(ckpt: Path) -> Any:
    """transformers' own model of a saved checkpoint (fp32, eager attention, as kiln loads it)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def make_adapter(ckpt: Path, directory: Path, targets: list[str], seed: int, scale: float = 0.1, **config: Any) -> Path:
    """A LoRA adapter of ``ckpt`` made by PEFT (``LoraConfig`` r=4, alpha=8 unless ``config``
    says otherwise), its lora_A/lora_B random N(0, scale) (not PEFT's zero B), saved by PEFT."""
    import warnings

    import peft
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2: PEFT sets fan_in_fan_out itself, and says so
        model = peft.get_peft_model(
            hf_model(ckpt), peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": targets, **config})
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an lm_head target: PEFT saves its base weight too, and says so
        model.save_pretrained(directory)
    return directory


def peft_of(ckpt: Path, adapter: Path | None) -> Any:
    """PEFT's model of ``ckpt`` with the adapter directory ``adapter`` (transformers' own model of
    ``ckpt`` when None), in eval mode."""
    import warnings

    import peft

    model = hf_model(ckpt)
    if adapter is None:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(model, str(adapter)).eval()


def hf_greedy(model: Any, prompts: list[list[int]], steps: int) -> Any:
    """``model.generate()``'s greedy tokens after ``prompts``, left-padded with 0 (no end token)."""
    import numpy as np
    import torch

    from kiln.exporter.parity import left_pad

    ids, mask, _ = left_pad(prompts, 0)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return np.asarray(out[:, ids.shape[1] :].numpy())


def assert_kiln_generate(ckpt: Path, out: Path, prompt: list[int], steps: int) -> None:
    """``kiln generate`` on the export ``out`` gives transformers' greedy ``generate()`` tokens of
    ``ckpt`` after ``prompt`` (``steps`` new tokens, no end token)."""
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    ids = ",".join(map(str, prompt))
    args = ["generate", str(out), "--ids", ids, "--max-new-tokens", str(steps), "--ignore-eos", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == hf_greedy(hf_model(ckpt), [prompt], steps)[0].tolist()


def assert_greedy_equals_hf(ckpt: Path, out: Path, steps: int, ort: bool = False, unified: bool = True) -> list[Any]:
    """kiln's ORT runner on the export ``out``'s prefill + decode graphs (``--target ort``'s too with ``ort``;
    the unified graph alone with ``unified``), on one prompt and on a left-padded batch of two, gives
    transformers' greedy ``generate()`` tokens of ``ckpt`` (a padded row's cache or state must stay its
    unpadded row's); returns ``(prompts, tokens)`` of each batch."""
    import numpy as np

    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.parity import greedy, make_prompts
    from kiln.exporter.runners import OrtRunner
    from kiln.plugins import load_model

    onnx_dir = out / "onnx"
    split = (GraphKind.PREFILL, GraphKind.DECODE)
    sets = [({k: onnx_dir / f"{k.value}{s}.onnx" for k in split}, False) for s in ("", ".ort")[: 1 + ort]]
    sets += [({GraphKind.UNIFIED: onnx_dir / "model.onnx"}, True)] if unified else []
    spec, hf = load_model(ckpt).spec, hf_model(ckpt)
    batches = []
    for lengths in ([9], [9, 5]):
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        want = hf_greedy(hf, [list(map(int, p)) for p in prompts], steps)
        for graphs, one in sets:
            with OrtRunner(graphs) as runner:
                got, _ = greedy(runner, spec, prompts, steps, unified=one)
            np.testing.assert_array_equal(got, want, err_msg=f"{lengths} {sorted(map(str, graphs.values()))}")
        batches.append((prompts, want))
    return batches


def assert_int4_generation(ckpt: Path, out: Path, steps: int, **options: Any) -> Any:
    """``ckpt`` exported ``--target ort --int4 --int4-method rtn`` (RTN: no calibration) into ``out``
    and proved against PyTorch computing with the int4 numbers its graphs hold (``parity.quantized``):
    an int4 model's tokens are not the float checkpoint's ``generate()``'s, so that model, not the
    checkpoint's, is the reference. Its parity passes (against that model on both graph sets;
    agreement with the checkpoint's model recorded, not gating) and so does ``kiln check``; the
    portable graphs' greedy tokens through kiln's ORT runner (int4 weights dequantized in float)
    equal that model's for batch 1 and a left-padded batch; ``kiln generate``'s tokens on both graph
    sets (its sessions run int4 MatMuls on int8 activations: ONNX Runtime's ``accuracy_level`` 4)
    are each that model's argmax at its prefix, or a tie within int8's tolerance, as parity judges
    the ``--target ort`` set. ``steps`` tokens; the export's result is returned."""
    import numpy as np

    from kiln.exporter.check import check_dir
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.options import ExportOptions, Precision
    from kiln.exporter.parity import greedy, make_prompts
    from kiln.exporter.parity.generation import judge
    from kiln.exporter.parity.quantized import read_int4_weights, use_int4_weights
    from kiln.exporter.pipeline import export
    from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
    from kiln.exporter.runners import OrtRunner, TorchRunner
    from kiln.plugins import load_model
    from kiln.runtime.generate import Generator

    rtn = Precision.of(Int4(method=Int4Method.RTN))
    result = export(
        ckpt, out, ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort", precision=rtn, **options)
    )
    quantized = json.loads((out / "reports" / "parity.json").read_text()).get("quantized") or {}
    assert result.parity.passed and quantized.get("passed"), result.parity.failures()
    assert {g["target"] for g in quantized["generation"]} == {None, "ort"}, quantized["generation"]
    assert check_dir(out).passed
    graphs = {kind: out / "onnx" / f"{kind.value}.onnx" for kind in (GraphKind.PREFILL, GraphKind.DECODE)}
    loaded = load_model(ckpt)
    use_int4_weights(loaded.module, read_int4_weights(graphs.values()))
    reference, spec = TorchRunner(loaded.module, loaded.spec.n_layers), loaded.spec
    for lengths in ([9], [9, 5]):
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        with OrtRunner(graphs) as runner:
            got, _ = greedy(runner, spec, prompts, steps)
        np.testing.assert_array_equal(got, greedy(reference, spec, prompts, steps)[0], err_msg=f"{lengths}")
    prompt = make_prompts(spec, [9], seed=1)[0]
    for target in (None, "ort"):
        run = Generator(out, target=target).run(prompt, steps, stop_at_eos=False, keep_logits=True)
        assert run.logits is not None
        _, want = greedy(reference, spec, [prompt], steps, forced=np.array([run.tokens]))
        judged = judge([prompt], want, run.logits[:, None, :], Precision.INT8.tolerance, unified=False, length=None)
        assert judged.first_divergence is None, (target, judged)
    return result


def rtn_linears(model: Any, block: int = 128, head: tuple[str, ...] = ("lm_head", "proj_out")) -> list[str]:
    """``model``'s ``nn.Linear`` weights, but its LM head's (``head``: kept float by --int4's default
    policy), replaced in place by their int4 round-to-nearest values as ``--int4 --int4-method rtn``
    computes them (``block`` along K, or the largest smaller power of two that divides it): an
    int4 reference built from the checkpoint's own weights, never read back from a graph. The
    modules changed."""
    import torch

    from kiln.exporter.int4.numbers import dequantize, layer_block, rtn

    changed = []
    for name, sub in model.named_modules():
        if isinstance(sub, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in head:
            weight = sub.weight.detach().float().numpy().T  # [K, N], as the graphs' MatMuls read it
            k_block = layer_block(weight.shape[0], block)
            assert k_block is not None, f"{name}: K={weight.shape[0]} has no int4 block"
            q, scale = rtn(weight, k_block, np.dtype(np.float32))
            sub.weight.data = torch.from_numpy(np.ascontiguousarray(dequantize(q, scale).T))
            changed.append(name)
    return changed


def hf_seq2seq(ckpt: Path) -> Any:
    """transformers' own encoder-decoder of a saved checkpoint (its config's architecture class: BART,
    T5, Whisper...; fp32, eager attention, as kiln loads it)."""
    import torch
    import transformers

    arch = transformers.AutoConfig.from_pretrained(ckpt).architectures[0]
    return getattr(transformers, arch).from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def seq2seq_generate(hf: Any, ids: np.ndarray, mask: np.ndarray, steps: int) -> np.ndarray:
    """transformers' greedy generate() of a text encoder-decoder with its own cache and none of the
    generation config's logits processors (forced first/last tokens, banned words): the model's own
    argmax; the tokens after the decoder's start token."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=steps,
            do_sample=False, num_beams=1, eos_token_id=None, forced_eos_token_id=None, forced_bos_token_id=None,
            bad_words_ids=None, pad_token_id=0,
        )  # fmt: skip
    return np.asarray(out[:, 1:].numpy())


def whisper_generate(hf: Any, features: np.ndarray, steps: int) -> np.ndarray:
    """transformers' greedy Whisper generate() on log-mel ``features`` (it returns the tokens after
    the decoder's start); the end token does not stop it."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            input_features=torch.from_numpy(features), max_new_tokens=steps, do_sample=False, num_beams=1,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return np.asarray(out.numpy())
