from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import CheckpointError, ConfigError
from kiln.plugins import load_model
from kiln.plugins.native.build import random_model
from kiln_testing import edit_config, tiny_config, write_checkpoint


def test_loads_and_matches_weights(tiny_ckpt: Path) -> None:
    loaded = load_model(tiny_ckpt)
    want = random_model(tiny_config(), 0)
    for name, tensor in want.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[name], tensor), name
    assert loaded.spec.family == "native" and loaded.spec.n_kv_heads == 2 and loaded.spec.head_dim == 8


def test_missing_and_unexpected_keys_are_all_named(tiny_ckpt: Path) -> None:
    state = load_file(tiny_ckpt / "model.safetensors")
    del state["layers.0.attn.q_proj.weight"], state["final_norm.weight"]
    state["layers.9.extra"] = torch.zeros(2)
    save_file(state, tiny_ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    msg = str(err.value)
    assert "missing keys ['final_norm.weight', 'layers.0.attn.q_proj.weight']" in msg
    assert "unexpected keys ['layers.9.extra']" in msg


def test_shape_mismatch_is_named_from_the_header(tiny_ckpt: Path) -> None:
    state = load_file(tiny_ckpt / "model.safetensors")
    state["layers.1.mlp.fc2.weight"] = torch.zeros(32, 65)
    save_file(state, tiny_ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    assert str(err.value) == (
        f"checkpoint: {tiny_ckpt / 'model.safetensors'}: weights do not match the config: "
        "layers.1.mlp.fc2.weight has shape [32, 65], the config needs [32, 64]"
    )


def test_non_finite_values_are_all_named(tiny_ckpt: Path) -> None:
    state = load_file(tiny_ckpt / "model.safetensors")
    state["layers.0.attn.k_proj.weight"][0, 0] = float("nan")
    state["embed.weight"][3, 3] = float("inf")
    save_file(state, tiny_ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    msg = str(err.value)
    assert "layers.0.attn.k_proj.weight has 1 non-finite values (NaN or Inf)" in msg
    assert "embed.weight has 1 non-finite values" in msg


def test_integer_weights_refused(tiny_ckpt: Path) -> None:
    state = load_file(tiny_ckpt / "model.safetensors")
    state["final_norm.weight"] = torch.ones(32, dtype=torch.int32)
    save_file(state, tiny_ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="final_norm.weight has dtype I32, expected a floating-point tensor"):
        load_model(tiny_ckpt)


def test_truncated_safetensors(tiny_ckpt: Path) -> None:
    path = tiny_ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_model(tiny_ckpt)


def test_config_contradicting_weights(tiny_ckpt: Path) -> None:
    edit_config(tiny_ckpt, d_ff=96)
    with pytest.raises(
        CheckpointError, match=r"layers.0.mlp.fc1.weight has shape \[64, 32\], the config needs \[96, 32\]"
    ):
        load_model(tiny_ckpt)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            {"d_model": 10**7},
            "embed.weight has shape [101, 32], the config needs [vocab_size, d_model] = [101, 10000000]",
        ),
        (
            {"vocab_size": 10**9},
            "embed.weight has shape [101, 32], the config needs [vocab_size, d_model] = [1000000000, 32]",
        ),
        ({"n_layers": 10**6}, "config.json says n_layers=1000000, the weights hold 2 layers (layers.0 to layers.1)"),
    ],
    ids=["d_model", "vocab_size", "n_layers"],
)
def test_absurd_sizes_are_refused_from_the_header_at_once(
    tiny_ckpt: Path, changes: dict[str, int], problem: str
) -> None:
    """The weights' header against the config before any module is built: no allocation of the
    config's sizes (these took 8-86 s to end in an allocator traceback)."""
    load_model(tiny_ckpt)  # imports done
    edit_config(tiny_ckpt, **changes)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    assert time.perf_counter() - start < 0.5
    assert (
        str(err.value) == f"checkpoint: {tiny_ckpt / 'model.safetensors'}: weights do not match the config: {problem}"
    )


def test_every_other_size_is_compared_on_a_meta_template(tiny_ckpt: Path) -> None:
    """Sizes past the embedding and the depth: the header against a template on the meta device
    (no memory), every mis-shaped tensor named, the list cut after five."""
    edit_config(tiny_ckpt, d_ff=10**7)
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    assert str(err.value) == (
        f"checkpoint: {tiny_ckpt / 'model.safetensors'}: weights do not match the config: "
        "layers.0.mlp.fc1.weight has shape [64, 32], the config needs"
        " [10000000, 32]; layers.0.mlp.fc2.weight has shape [32, 64], the config needs [32, 10000000]; "
        "layers.0.mlp.gate.weight has shape [64, 32],"
        " the config needs [10000000, 32]; layers.1.mlp.fc1.weight has shape [64, 32], the config needs "
        "[10000000, 32]; layers.1.mlp.fc2.weight has shape"
        " [32, 64], the config needs [32, 10000000]; and 1 more"
    )


def test_a_dimension_past_32_bits_is_a_config_error(tiny_ckpt: Path) -> None:
    edit_config(tiny_ckpt, d_model=10**400)
    with pytest.raises(ConfigError) as err:
        load_model(tiny_ckpt)
    assert str(err.value) == (
        f"config: {tiny_ckpt / 'config.json'}: d_model must be at most 2**31 - 1 (TensorRT's and ONNX Runtime "
        "GenAI's dimensions are 32-bit),"
        " found an integer of about 401 digits"
    )


def test_invalid_config_value_names_the_file(tiny_ckpt: Path) -> None:
    edit_config(tiny_ckpt, n_heads=5)
    with pytest.raises(ConfigError, match=r"config.json: d_model \(32\) must be divisible by n_heads \(5\)"):
        load_model(tiny_ckpt)


def test_unknown_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architecture": "resnet"}')
    with pytest.raises(CheckpointError, match="unknown architecture 'resnet'; supported families: hf, native"):
        load_model(tmp_path)


def test_missing_weights_and_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(tmp_path)
    tiny_config().save(tmp_path / "config.json")
    with pytest.raises(
        CheckpointError, match="no weights file; expected one of model.safetensors, model.pt, pytorch_model.bin"
    ):
        load_model(tmp_path)


def test_pt_state_dict_is_loaded_without_pickle_code(tmp_path: Path) -> None:
    cfg = tiny_config()
    cfg.save(tmp_path / "config.json")
    torch.save(random_model(cfg, 0).state_dict(), tmp_path / "model.pt")
    assert load_model(tmp_path).spec.n_layers == 2


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    tiny_config().save(tmp_path / "config.json")
    with open(tmp_path / "model.pt", "wb") as f:
        pickle.dump({"embed.weight": _Payload(marker)}, f)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    message = str(err.value)
    assert message.startswith(
        f"checkpoint: {tmp_path / 'model.pt'}: refused to load: this pickle would build objects other than tensors,"
    )
    assert "unpickling anything but tensors can run code from the file, which kiln never does" in message
    assert (
        "\n" not in message and "Weights only load failed" not in message
    )  # kiln's words, not torch's cut mid-sentence
    assert not marker.exists()


def test_pickled_module_refusal_names_it_and_its_conversion_works(tmp_path: Path) -> None:
    """A whole nn.Module saved with torch.save: the refusal names its class, and the one-line
    conversion the message gives makes a checkpoint kiln loads, with the same weights."""
    cfg = tiny_config()
    cfg.save(tmp_path / "config.json")
    model = random_model(cfg, 3)
    torch.save(model, tmp_path / "model.pt")
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    message = str(err.value)
    assert f"this pickle would build an object of {type(model).__module__}.{type(model).__name__}," in message
    assert f"kiln then reads {tmp_path / 'model.safetensors'}" in message
    command = message.split("python -c ", 1)[1]
    subprocess.run([sys.executable, "-c", shlex.split(command)[0]], check=True, cwd=tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.files[-1] == tmp_path / "model.safetensors"
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[name], tensor), name


def test_tied_head_saved_under_either_name(tmp_path: Path) -> None:
    cfg = tiny_config()
    model = random_model(cfg, 1)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "embed.weight"}
    write_checkpoint(tmp_path, cfg)
    save_file(state, tmp_path / "model.safetensors")  # lm_head.weight instead of embed.weight
    loaded = load_model(tmp_path)
    assert torch.equal(loaded.module.embed.weight, model.embed.weight)


@pytest.mark.parametrize("field", ["weights_file", "tokenizer_file"])
def test_config_paths_are_never_followed(tiny_ckpt: Path, field: str) -> None:
    """kiln reads no file name from a config: the weights are model.safetensors (or model.pt /
    pytorch_model.bin) and the tokenizer tokenizer.json, inside the checkpoint directory. A config
    that tries to point elsewhere is refused as an unknown key."""
    edit_config(tiny_ckpt, **{field: "../../outside/secret.safetensors"})
    with pytest.raises(ConfigError, match=rf"unknown config keys \['{field}'\]"):
        load_model(tiny_ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_link_out_of_the_checkpoint_is_refused(tiny_ckpt: Path, tmp_path: Path, name: str) -> None:
    """A symlink in the checkpoint directory that leads outside it is never followed (its file
    would be read, and copied into the export): one line saying what links where and what to do."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    source = tiny_ckpt / name
    if not source.exists():
        source.write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}')
    (outside / name).write_bytes(source.read_bytes())
    source.unlink()
    source.symlink_to(outside / name)
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    assert str(err.value) == (
        f"checkpoint: {source} links to {outside / name}, outside {tiny_ckpt}: kiln reads nothing from outside "
        "the checkpoint;"
        f" copy the file in (rm {source} && cp {outside / name} {source})"
    )


def test_links_inside_the_checkpoint_are_followed(tiny_ckpt: Path) -> None:
    (tiny_ckpt / "weights").mkdir()
    (tiny_ckpt / "model.safetensors").rename(tiny_ckpt / "weights" / "v1.safetensors")
    (tiny_ckpt / "model.safetensors").symlink_to("weights/v1.safetensors")
    assert load_model(tiny_ckpt).spec.n_layers == 2


@pytest.mark.parametrize(
    ("text", "reason"),
    [("not json", "expected ident at line 1 column 2"), ('{"hello": 1}', "expected `,` or `}` at line 1 column 9")],
)
def test_a_tokenizer_that_is_none_is_refused_at_load(tiny_ckpt: Path, text: str, reason: str) -> None:
    """A malformed or wrong-schema tokenizer.json is named when the checkpoint loads (it was
    found only after trace and parity, under a temporary path, or shipped and broke kiln generate)."""
    (tiny_ckpt / "tokenizer.json").write_text(text)
    (tiny_ckpt / "model.safetensors").write_bytes(b"\x00" * 64)  # never read: the tokenizer is refused first
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt)
    assert str(err.value) == (
        f"checkpoint: {tiny_ckpt / 'tokenizer.json'}: not a tokenizer the tokenizers library loads ({reason}); "
        "replace it with the model's own"
        " tokenizer.json, or remove it to export without one"
    )
