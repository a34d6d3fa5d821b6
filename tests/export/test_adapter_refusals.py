"""``kiln export --adapter`` refuses, in one line and before anything is written, what it cannot
merge exactly: another PEFT type, DoRA and the other fields that make an adapter more than B @ A,
LoRA on embeddings, a tied weight, an adapter of another base (shapes, or its named base), and
missing files. Each export below fails at load, before the trace: no output directory is left."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)
peft = pytest.importorskip("peft", reason="--adapter needs peft (pip install -e .[hf])")

from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.options import Adapter, ExportOptions
from kiln.exporter.pipeline import export
from kiln_testing import exact, hf_model, make_adapter, save_base


def _refused(ckpt: Path, adapter: Path, out: Path, message: str, weight: float = 1.0) -> None:
    with pytest.raises(ConfigError, match=exact(f"config: --adapter {adapter}: {message}")):
        export(ckpt, out, ExportOptions.from_flags(max_batch=2, parity_tokens=4, adapters=(Adapter(adapter, weight),)))
    assert not out.exists()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_base("llama", tmp_path_factory.mktemp("base") / "ckpt")


def _ia3(ckpt: Path, directory: Path) -> Path:
    config = peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    peft.get_peft_model(hf_model(ckpt), config).save_pretrained(directory)
    return directory


def _edit(directory: Path, **changes: object) -> Path:
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return directory


def _without(directory: Path, name: str, renamed: str | None = None) -> Path:
    """``directory`` without its file ``name`` (moved to ``renamed``, when given)."""
    if renamed is None:
        (directory / name).unlink()
    else:
        (directory / name).rename(directory / renamed)
    return directory


def _scaled(directory: Path, key: str, value: float) -> Path:
    """``directory``'s adapter with every value of its tensor ending in ``key`` set to ``value``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    name = next(k for k in sorted(tensors) if k.endswith(key))
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


QKV = ["q_proj", "v_proj"]
REFUSALS: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "ia3": (_ia3, "peft_type 'IA3' is not supported: kiln merges LoRA adapters only (peft_type 'LORA')"),
    "dora": (
        lambda c, d: make_adapter(c, d, QKV, seed=2, use_dora=True),
        "use_dora=True is not supported (DoRA rescales every column of the merged weight by a learned "
        "magnitude): kiln merges plain LoRA, W + s * B @ A per module",
    ),
    "modules_to_save": (
        lambda c, d: make_adapter(c, d, QKV, seed=2, modules_to_save=["lm_head"]),
        "modules_to_save=['lm_head'] is not supported (whole modules saved beside the LoRA weights): kiln merges "
        "plain LoRA, W + s * B @ A per module",
    ),
    "rank_pattern": (
        lambda c, d: make_adapter(c, d, QKV, seed=2, rank_pattern={"q_proj": 2}),
        "rank_pattern={'q_proj': 2} is not supported (per-module ranks): kiln merges plain LoRA, W + s * B @ A "
        "per module",
    ),
    "bias": (
        lambda c, d: make_adapter(c, d, QKV, seed=2, bias="all"),
        "bias='all' is not supported (trained biases of the base): kiln merges plain LoRA, bias 'none'",
    ),
    "embedding": (
        lambda c, d: make_adapter(c, d, ["embed_tokens"], seed=2),
        "adapter_model.safetensors holds 'base_model.model.model.embed_tokens.lora_embedding_A' (LoRA on an "
        "embedding), which kiln does not merge",
    ),
    "base name": (
        lambda c, d: _edit(make_adapter(c, d, QKV, seed=2), base_model_name_or_path="meta-llama/Llama-3.2-1B"),
        "its base_model_name_or_path 'meta-llama/Llama-3.2-1B' is not this checkpoint (ckpt): kiln compares the "
        "last path components;"
        " export it onto its own base, or empty base_model_name_or_path in adapter_config.json if this is that "
        "model under another name",
    ),
    "nan": (
        lambda c, d: _scaled(make_adapter(c, d, QKV, seed=2), "layers.0.self_attn.v_proj.lora_A.weight", float("nan")),
        "model.layers.0.self_attn.v_proj's lora_A holds NaN or infinite values",
    ),
    "overflow": (  # finite halves whose product is not: refused before the trace (it failed parity after it)
        lambda c, d: _scaled(
            _scaled(make_adapter(c, d, QKV, seed=2), "layers.1.self_attn.q_proj.lora_A.weight", 1e30),
            "layers.1.self_attn.q_proj.lora_B.weight",
            1e30,
        ),
        "model.layers.1.self_attn.q_proj's merged update (weight x scaling x B @ A) overflows float32",
    ),
    "no directory": (lambda c, d: d, "no such directory (an adapter is the directory PEFT's save_pretrained writes)"),
    "no config": (
        lambda c, d: _without(make_adapter(c, d, QKV, seed=2), "adapter_config.json"),
        "no adapter_config.json",
    ),
    "pickled": (
        lambda c, d: _without(make_adapter(c, d, QKV, seed=2), "adapter_model.safetensors", "adapter_model.bin"),
        "no adapter_model.safetensors (adapter_model.bin is pickled, which kiln does not read: save it again "
        "with safe_serialization=True)",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_by_name(case: str, ckpt: Path, tmp_path: Path) -> None:
    make, message = REFUSALS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = make(ckpt, tmp_path / "adapter")
    _refused(ckpt, adapter, tmp_path / "out", message)


def test_adapter_of_another_base_is_refused_by_its_shapes(ckpt: Path, tmp_path: Path) -> None:
    """An adapter of a base with a wider MLP (its named base has the same directory name)."""
    other = save_base("llama", tmp_path / "other" / "ckpt", intermediate_size=96)
    adapter = make_adapter(other, tmp_path / "adapter", ["q_proj", "down_proj"], seed=2)
    message = (
        "model.layers.0.mlp.down_proj has lora_A [4, 96] and lora_B [64, 4], the base's weight needs [r, 128] and "
        "[64, r] (an adapter of another base?)"
    )
    _refused(ckpt, adapter, tmp_path / "out", message)


def test_an_adapter_of_a_tied_weight_is_refused(tmp_path: Path) -> None:
    """Qwen2's tied lm_head is the embedding's weight: merging into it would change the embedding too."""
    tied = save_base("qwen2-tied", tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = make_adapter(tied, tmp_path / "adapter", ["q_proj", "lm_head"], seed=2)
    _refused(
        tied,
        adapter,
        tmp_path / "out",
        "lm_head.weight is tied to model.embed_tokens.weight: merging into it would change both",
    )


def test_other_families_and_weights_are_refused(tiny_ckpt: Path, ckpt: Path, tmp_path: Path) -> None:
    adapter = make_adapter(ckpt, tmp_path / "adapter", QKV, seed=2)
    with pytest.raises(
        ConfigError,
        match=exact(
            "config: --adapter: kiln merges LoRA adapters into Hugging Face decoder checkpoints only; "
            f"{tiny_ckpt} is a native checkpoint"
        ),
    ):
        export(
            tiny_ckpt,
            tmp_path / "out",
            ExportOptions.from_flags(max_batch=2, parity_tokens=4, adapters=(Adapter(adapter),)),
        )
    assert not (tmp_path / "out").exists()
    run = CliRunner().invoke(
        main, ["export", "--model", str(ckpt), "--adapter", f"{adapter}:nan", "--out", str(tmp_path / "out")]
    )
    assert run.exit_code == 1 and "Traceback" not in run.stderr, run.output
    assert (
        run.stderr.strip().splitlines()[-1]
        == f"error: config: --adapter {adapter}: its weight must be a finite number, found nan"
    )
    assert not (tmp_path / "out").exists()
