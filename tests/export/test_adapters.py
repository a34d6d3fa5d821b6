"""``kiln export --adapter``: PEFT LoRA adapters merged into a Hugging Face checkpoint at export.

Each architecture's tiny model is saved by transformers; an adapter is made by PEFT itself
(``get_peft_model``, its lora_A/lora_B then set to random values large enough to change the
greedy tokens: asserted, so a merge that did nothing would fail) and saved with
``save_pretrained``. The export's own parity check runs against PEFT's model of base + adapters;
the tests also compare the graphs' greedy tokens with PEFT's ``generate()`` directly, batch 1 and
a left-padded batch. Two weighted adapters are compared with PEFT's ``add_weighted_adapter(...,
combination_type="cat")``, a path of PEFT's other than the one parity uses (each adapter active,
scaled by ``set_scale``). The refusals: ``test_adapter_refusals.py``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)
peft = pytest.importorskip("peft", reason="--adapter needs peft (pip install -e .[hf])")

import torch
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kiln.cli import main
from kiln.errors import CheckpointError, ParityError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import Adapter, ExportOptions, LoraOptions, Precision
from kiln.exporter.parity import greedy, left_pad, make_prompts
from kiln.exporter.pipeline import export
from kiln.exporter.runners import OrtRunner
from kiln.plugins import load_model
from kiln_testing import hf_model, make_adapter, save_base

STEPS = 16
_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]
# the case of each architecture, and the modules its adapter targets (every linear layer kiln maps)
CASES = {
    "llama": [*_ATTN, *_MLP, "lm_head"],
    "qwen2-tied": [*_ATTN, *_MLP],  # tied embeddings: lm_head is the embedding's weight (refused as a target)
    "mistral": [*_ATTN, *_MLP],
    "gemma2-window": [*_ATTN, *_MLP],
    "phi3-partial": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused projections
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D: weights [in, out], PEFT's fan_in_fan_out
}


def _generate(model: Any, ids: np.ndarray, mask: np.ndarray, steps: int) -> np.ndarray:
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


def peft_model(ckpt: Path, adapters: list[tuple[Path, float]]) -> Any:
    """PEFT's model of base + adapters as a user builds it: one adapter as loaded; several (or a
    weight) through ``add_weighted_adapter(combination_type="cat")``, their exact weighted sum."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(hf_model(ckpt), str(adapters[0][0]), adapter_name="a0")
        for i, (path, _) in enumerate(adapters[1:], 1):
            model.load_adapter(str(path), adapter_name=f"a{i}")
    if len(adapters) > 1 or adapters[0][1] != 1.0:
        model.add_weighted_adapter(
            [f"a{i}" for i in range(len(adapters))], [w for _, w in adapters], "mix", combination_type="cat"
        )
        model.set_adapter("mix")
    return model.eval()


def assert_tokens(
    out: Path, ckpt: Path, adapters: list[tuple[Path, float]], different_from: list[list[tuple[Path, float]]]
) -> None:
    """The export's greedy tokens equal PEFT's generate() (batch 1, a left-padded batch), and
    PEFT's differ from the base's and from each of ``different_from``'s (so the test can fail)."""
    spec = load_model(ckpt).spec
    graphs = {k: out / "onnx" / f"{k.value}.onnx" for k in (GraphKind.PREFILL, GraphKind.DECODE)}
    base, wanted, others = hf_model(ckpt), peft_model(ckpt, adapters), [peft_model(ckpt, o) for o in different_from]
    for lengths in ([9], [9, 5]):
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        ids, mask, _ = left_pad(prompts, 0)
        want = _generate(wanted, ids, mask, STEPS)
        with OrtRunner(graphs) as runner:
            got, _ = greedy(runner, spec, prompts, STEPS)
        np.testing.assert_array_equal(got, want, err_msg=f"{lengths}")
        for other in [base, *others]:
            assert not np.array_equal(want, _generate(other, ids, mask, STEPS)), (
                f"the adapter does not change the tokens of {lengths}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_export_generates_as_peft(case: str, tmp_path: Path) -> None:
    ckpt = save_base(case, tmp_path / "ckpt")
    adapter = make_adapter(ckpt, tmp_path / "adapter", CASES[case], seed=2)
    result = export(
        ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, adapters=(Adapter(adapter),))
    )
    assert result.parity.passed, result.parity.failures()
    (entry,) = result.manifest.checkpoint.adapters or ()
    assert (entry.path, entry.weight, entry.rank, entry.alpha, entry.use_rslora) == (str(adapter), 1.0, 4, 8.0, False)
    assert entry.target_modules == tuple(sorted(CASES[case]))
    assert_tokens(tmp_path / "out", ckpt, [(adapter, 1.0)], [])


@pytest.mark.slow
def test_two_weighted_adapters_are_peft_s_weighted_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two adapters of other ranks and scalings (the second rank-stabilised), weights 0.7 and
    -0.5, given on the command line as DIR:WEIGHT from the directory they are relative to."""
    ckpt = save_base("llama", tmp_path / "ckpt")
    first = make_adapter(ckpt, tmp_path / "first", [*_ATTN, *_MLP], seed=2)
    second = make_adapter(
        ckpt,
        tmp_path / "second",
        ["q_proj", "v_proj", "down_proj"],
        seed=3,
        r=2,
        lora_alpha=4,
        use_rslora=True,
        scale=0.2,
    )
    monkeypatch.chdir(tmp_path)
    run = CliRunner().invoke(
        main,
        [
            "export",
            "--model",
            "ckpt",
            "--adapter",
            "first:0.7",
            "--adapter",
            "second:-0.5",
            "--out",
            "out",
            "--max-batch",
            "4",
            "--parity-tokens",
            "8",
        ],
    )
    assert run.exit_code == 0, run.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    schema = json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    assert not [e.message for e in Draft202012Validator(schema).iter_errors(manifest)]
    recorded = manifest["checkpoint"]["adapters"]
    assert [(a["path"], a["weight"], a["rank"], a["alpha"], a["use_rslora"]) for a in recorded] == [
        ("first", 0.7, 4, 8.0, False),
        ("second", -0.5, 2, 4.0, True),
    ]
    assert recorded[1]["target_modules"] == ["down_proj", "q_proj", "v_proj"] and recorded[1]["resolved"] == str(
        second.absolute()
    )
    import hashlib

    assert recorded[0]["files"] == {
        name: hashlib.sha256((first / name).read_bytes()).hexdigest()
        for name in ("adapter_config.json", "adapter_model.safetensors")
    }
    both = [(first, 0.7), (second, -0.5)]
    assert_tokens(tmp_path / "out", ckpt, both, different_from=[[(first, 1.0)], [(first, 0.7)]])
    assert check_dir(tmp_path / "out").passed  # kiln check rebuilds PEFT's model from the manifest
    (second / "adapter_config.json").write_text(
        (second / "adapter_config.json").read_text().replace('"lora_alpha": 4', '"lora_alpha": 5')
    )
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoint: --adapter second: adapter files \['adapter_config.json'\] differ from the ones",
    ):
        check_dir(tmp_path / "out")


def test_parity_is_against_peft_not_the_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge that changes nothing must fail the export's own parity (its reference is PEFT's
    model, not the merged weights), and leave no output directory."""
    import kiln.plugins.hf.adapter as adapter_module

    ckpt = save_base("llama", tmp_path / "ckpt")
    adapter = make_adapter(ckpt, tmp_path / "adapter", ["q_proj", "v_proj"], seed=2)
    monkeypatch.setattr(adapter_module, "merge", lambda model, adapters: None)
    with pytest.raises(ParityError, match="exported graphs differ from PyTorch"):
        export(
            ckpt,
            tmp_path / "out",
            ExportOptions.from_flags(max_batch=2, parity_tokens=4, adapters=(Adapter(adapter, 0.5),)),
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16),
        ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort"),
    ],
    ids=["fp16", "ort"],
)
def test_precisions_and_targets_export_the_merged_model(options: ExportOptions, tmp_path: Path) -> None:
    """What follows the merge sees a plain model: fp16 graphs and --target ort's pass their parity against PEFT's
    model."""
    ckpt = save_base("llama", tmp_path / "ckpt")
    adapter = make_adapter(ckpt, tmp_path / "adapter", [*_ATTN, *_MLP], seed=2)
    result = export(
        ckpt, tmp_path / "out", dataclasses.replace(options, lora=LoraOptions(adapters=(Adapter(adapter, 0.5),)))
    )
    assert result.parity.passed, result.parity.failures()
    assert [a.weight for a in result.manifest.checkpoint.adapters or ()] == [0.5]


@pytest.mark.slow
def test_the_readme_s_adapter_example_runs_as_written(tmp_path: Path) -> None:
    """The README's tour marks its adapter lines ``# needs:`` (the hf extra, which Set up's first
    command does not install), so ``test_readme`` skips them; here they run as written."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [
        line.strip().split("  #")[0].strip()
        for line in readme.splitlines()
        if line.startswith("    ") and "build/lora" in line
    ]
    assert [line.split()[:2] for line in lines] == [
        ["python", "-m"],
        ["kiln", "export"],
        ["kiln", "export"],
        ["kiln", "adapter"],
        ["kiln", "generate"],
    ], lines
    for line in lines:
        args = shlex.split(line)
        command = [sys.executable, *args[1:]] if args[0] == "python" else [sys.executable, "-m", "kiln.cli", *args[1:]]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    manifest = json.loads((tmp_path / "build" / "lora" / "out" / "manifest.json").read_text())
    assert [a["path"] for a in manifest["checkpoint"]["adapters"]] == ["build/lora/adapter"]
    assert (
        tmp_path / "build" / "lora" / "adapter.onnx_adapter"
    ).is_file()  # kiln adapter's file, which kiln generate read
    assert json.loads((tmp_path / "build" / "lora" / "slots" / "manifest.json").read_text())["lora"]["max_rank"] == 16


@pytest.mark.slow
def test_a_bf16_checkpoint_keeps_its_merged_weights_in_fp32(tmp_path: Path) -> None:
    """W + delta rounded back to bf16 would miss fp32 parity against PEFT's model (by bf16's
    rounding): fp32 parity passing on a bf16 checkpoint with a merged adapter is what shows the
    merged modules stay fp32 (their dtypes are not inspected here), and PEFT's tokens are kiln's."""
    hf_model(save_base("llama", tmp_path / "fp32")).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    adapter = make_adapter(ckpt, tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"], seed=2)
    result = export(
        ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, adapters=(Adapter(adapter),))
    )
    assert result.parity.passed, result.parity.failures()
    assert result.manifest.checkpoint.dtype == "bfloat16"
    assert_tokens(tmp_path / "out", ckpt, [(adapter, 1.0)], [])
