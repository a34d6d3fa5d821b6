"""ONNX Runtime GenAI runs kiln's model.onnx from the genai_config.json kiln writes.

The consumer is real: ``onnxruntime_genai`` loads the exported demo and generates greedily; its
tokens are compared with the PyTorch model's greedy tokens (``kiln.exporter.parity.greedy``
through ``TorchRunner``, which left-pads batches). GenAI pads a batch on the right and derives the
attention mask and position ids from the pad id (``src/models/position_inputs.cpp``), so the
batch case feeds GenAI right-padded prompts and PyTorch left-padded ones: the same tokens must
come out of both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

og = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is a test dependency (pip install onnxruntime-genai)"
)

from tokenizers import Tokenizer  # noqa: E402

from kiln.errors import ArtifactError  # noqa: E402
from kiln.exporter.artifacts.manifest import Manifest  # noqa: E402
from kiln.exporter.options import ExportOptions, Precision  # noqa: E402
from kiln.exporter.parity import greedy, make_prompts  # noqa: E402
from kiln.exporter.pipeline import export  # noqa: E402
from kiln.exporter.precision import TOLERANCES  # noqa: E402
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.runners import TorchRunner  # noqa: E402
from kiln.exporter.serving import write_genai_config  # noqa: E402
from kiln.exporter.serving.genai import genai_config  # noqa: E402
from kiln.plugins import LoadedModel, load_model  # noqa: E402

STEPS = 32
# The demo is trained on Python source (demo/checkpoint/heldout.txt is held-out stdlib code).
TEXT = "def read_config(path):\n    with open(path) as f:\n"


def _export(root: Path, options: ExportOptions) -> Path:
    out = root / "out"
    manifest = export("demo", out, options).manifest
    # kiln export writes both beside model.onnx and hashes them in the manifest
    assert {"onnx/genai_config.json", "onnx/tokenizer_config.json"} <= set(manifest.files)
    written = write_genai_config(out / "onnx", manifest)  # idempotent: rewriting gives the same files
    assert [p.name for p in written] == ["genai_config.json", "tokenizer_config.json"]
    from kiln.exporter.artifacts.hashing import sha256_file

    assert all(manifest.files[f"onnx/{p.name}"] == sha256_file(p) for p in written)
    return out


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("genai32"), ExportOptions.from_flags(parity_tokens=8))


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(
        tmp_path_factory.mktemp("genai16"), ExportOptions.from_flags(precision=Precision.FP16, parity_tokens=8)
    )


@pytest.fixture(scope="module")
def demo() -> tuple[LoadedModel, TorchRunner]:
    loaded = load_model("demo")
    return loaded, TorchRunner(loaded.module, loaded.spec.n_layers)


def _until_eos(tokens: Sequence[int], eos: int) -> list[int]:
    """Tokens up to and including the first end token (GenAI stops a sequence there)."""
    out: list[int] = []
    for token in tokens:
        out.append(int(token))
        if token == eos:
            break
    return out


def _genai_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], steps: int) -> list[list[int]]:
    """GenAI's greedy continuation of each prompt, given to it right-padded as it pads itself."""
    model = og.Model(str(model_dir))
    pad = json.loads((model_dir / "genai_config.json").read_text())["model"]["pad_token_id"]
    length = max(len(p) for p in prompts)
    ids = np.full((len(prompts), length), pad, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length + steps, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    return [generator.get_sequence(row)[length:].tolist() for row in range(len(prompts))]


def test_config_is_the_manifest(fp32_dir: Path) -> None:
    manifest = json.loads((fp32_dir / "manifest.json").read_text())
    config = json.loads((fp32_dir / "onnx" / "genai_config.json").read_text())
    assert config == genai_config(Manifest.from_json(manifest))
    model, decoder = config["model"], config["model"]["decoder"]
    assert model["type"] == "decoder" and decoder["filename"] == "model.onnx"
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (0, 0, 1)
    assert model["context_length"] == manifest["limits"]["max_context"] == config["search"]["max_length"] == 256
    assert model["vocab_size"] == 1024
    assert (decoder["head_size"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (32, 2, 4)
    assert (decoder["hidden_size"], decoder["num_attention_heads"]) == (128, 4)
    assert decoder["inputs"]["past_key_names"] % 3 == "past_key_values.3.key"
    assert decoder["outputs"]["present_value_names"] % 0 == "present.0.value"
    assert config["search"]["do_sample"] is False and config["search"]["past_present_share_buffer"] is False
    tok_config = json.loads((fp32_dir / "onnx" / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == (
        "<|endoftext|>",
        "<|endoftext|>",
        "<|pad|>",
    )
    og.Config(str(fp32_dir / "onnx"))  # GenAI's own parser accepts every key


def test_greedy_tokens_equal_pytorch(fp32_dir: Path, demo: tuple[LoadedModel, TorchRunner]) -> None:
    loaded, runner = demo
    spec = loaded.spec
    for prompt in make_prompts(spec, [9, 23], seed=11):
        ref, _ = greedy(runner, spec, [prompt], STEPS)
        expected = _until_eos(ref[0], spec.eos_token_id)
        got = _genai_greedy(fp32_dir / "onnx", [prompt], STEPS)[0]
        assert got == expected, f"prompt {prompt}"
        assert len(expected) == STEPS  # no early end token: all 32 tokens were compared


def test_batch_of_two_lengths_equals_left_padded_pytorch(fp32_dir: Path, demo: tuple[LoadedModel, TorchRunner]) -> None:
    loaded, runner = demo
    spec = loaded.spec
    prompts = make_prompts(spec, [7, 12], seed=3)
    ref, _ = greedy(runner, spec, prompts, STEPS)  # left-padded
    got = _genai_greedy(fp32_dir / "onnx", prompts, STEPS)  # right-padded, as GenAI pads
    for row in range(2):
        expected = _until_eos(ref[row], spec.eos_token_id)
        assert _until_eos(got[row], spec.eos_token_id) == expected, f"row {row}"
        assert len(expected) == STEPS
    # and each row alone gives the same tokens as in the batch
    assert _genai_greedy(fp32_dir / "onnx", [prompts[0]], STEPS)[0] == got[0]


def test_text_in_text_out_through_genai_tokenizer(fp32_dir: Path, demo: tuple[LoadedModel, TorchRunner]) -> None:
    loaded, runner = demo
    spec = loaded.spec
    model = og.Model(str(fp32_dir / "onnx"))
    tokenizer = og.Tokenizer(model)
    reference = Tokenizer.from_file(str(fp32_dir / "onnx" / "tokenizer.json"))
    assert (tokenizer.bos_token_id, list(tokenizer.eos_token_ids), tokenizer.pad_token_id) == (0, [0], 1)
    ids = tokenizer.encode(TEXT).tolist()
    assert ids == reference.encode(TEXT).ids and len(ids) > 5  # no BOS added, same BPE
    assert tokenizer.decode(np.array(ids, dtype=np.int32)) == TEXT

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + STEPS)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([ids], dtype=np.int32))
    stream = tokenizer.create_stream()
    pieces = []
    while not generator.is_done():
        generator.generate_next_token()
        pieces.append(stream.decode(int(generator.get_next_tokens()[0])))
    new = generator.get_sequence(0)[len(ids) :].tolist()
    text = tokenizer.decode(np.array(new, dtype=np.int32))

    ref, _ = greedy(runner, spec, [ids], STEPS)
    expected = _until_eos(ref[0], spec.eos_token_id)
    assert new == expected
    assert text == reference.decode(expected, skip_special_tokens=True) and text.strip()
    assert "".join(pieces) == text  # streaming detokenization agrees


def test_batch_text_is_right_padded_by_genai(fp32_dir: Path) -> None:
    tokenizer = og.Tokenizer(og.Model(str(fp32_dir / "onnx")))
    short, long = "x = 1\n", "def f(a, b):\n    return a + b\n"
    batch = tokenizer.encode_batch([short, long]).as_numpy()
    n = len(tokenizer.encode(short))
    assert batch.shape[1] == len(tokenizer.encode(long)) > n
    assert batch[0, :n].tolist() == tokenizer.encode(short).tolist()
    assert set(batch[0, n:].tolist()) == {1}  # pad id on the right


def test_fp16_agrees_up_to_near_ties(fp16_dir: Path, demo: tuple[LoadedModel, TorchRunner]) -> None:
    """fp16 graph in GenAI against fp32 PyTorch: every token equal, except that at the first step
    where they differ (if any) PyTorch's own logits must make it a near tie: the logit of GenAI's
    token within the fp16 logits tolerance (5e-2) of PyTorch's top logit. Comparison stops there,
    since the two continuations then have different prefixes."""
    loaded, runner = demo
    spec = loaded.spec
    tolerance = TOLERANCES["fp16"].logits_atol
    compared = 0
    for prompt in make_prompts(spec, [7, 12, 20], seed=3):
        ref, ref_logits = greedy(runner, spec, [prompt], STEPS)
        got = _genai_greedy(fp16_dir / "onnx", [prompt], STEPS)[0]
        expected = _until_eos(ref[0], spec.eos_token_id)
        for step, (want, have) in enumerate(zip(expected, got, strict=False)):
            if want != have:
                gap = float(ref_logits[step, 0, want] - ref_logits[step, 0, have])
                assert gap <= tolerance, (
                    f"prompt {prompt}: step {step} chose {have} over {want}, {gap:.3g} below PyTorch's top logit"
                )
                break
            compared += 1
        else:
            assert len(got) == len(expected)
    assert compared >= 2 * STEPS  # most tokens were compared, not cut short by a tie at once


@pytest.fixture(scope="module")
def int4_ort_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    options = ExportOptions.from_flags(
        precision=Precision.of(Int4(method=Int4Method.RTN)), target="ort", parity_tokens=8
    )
    return _export(tmp_path_factory.mktemp("genai-int4"), options)


def test_genai_generates_from_the_ort_int4_graph(int4_ort_dir: Path, demo: tuple[LoadedModel, TorchRunner]) -> None:
    """An --int4 --target ort export: GenAI runs model.ort.onnx (MatMulNBits bits=4) and generates
    exactly what kiln's own step loop generates through that graph (two prompts, batch 1 each)."""
    from kiln.exporter.contract.io import GraphKind
    from kiln.exporter.runners import OrtRunner

    config = json.loads((int4_ort_dir / "onnx" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "model.ort.onnx"
    og.Config(str(int4_ort_dir / "onnx"))
    loaded, _ = demo
    spec = loaded.spec
    prompts = make_prompts(spec, [9, 23], seed=5)
    with OrtRunner({GraphKind.UNIFIED: int4_ort_dir / "onnx" / "model.ort.onnx"}) as runner:
        for batch in ([prompts[0]], [prompts[1]]):
            ref, _ = greedy(runner, spec, batch, STEPS, unified=True)
            assert _genai_greedy(int4_ort_dir / "onnx", batch, STEPS)[0] == _until_eos(ref[0], spec.eos_token_id)


def test_missing_graph_or_names_are_one_clear_error(fp32_dir: Path, tmp_path: Path) -> None:
    manifest = json.loads((fp32_dir / "manifest.json").read_text())
    with pytest.raises(ArtifactError, match=r"model\.onnx does not exist"):
        write_genai_config(tmp_path, Manifest.from_json(manifest))
    broken = json.loads(json.dumps(manifest))
    broken["graphs"]["model"]["inputs"] = [
        t for t in broken["graphs"]["model"]["inputs"] if t["name"] != "past_key_values.2.value"
    ]
    with pytest.raises(
        ArtifactError, match=r"lacks \['past_key_values\.2\.value'\] that ONNX Runtime GenAI binds by name"
    ):
        genai_config(Manifest.from_json(broken))


def _manifest_of(loaded: LoadedModel) -> Manifest:
    """The manifest an export of ``loaded`` would write, as far as genai_config reads it (no export)."""
    import dataclasses

    from kiln.exporter.artifacts.build import kv_cache_info
    from kiln.exporter.contract.io import GraphKind, graph_io
    from kiln_testing import typed_manifest

    spec = loaded.spec
    io = graph_io(spec, GraphKind.UNIFIED)
    model = {
        k: getattr(spec, k)
        for k in (
            "n_layers",
            "n_kv_heads",
            "head_dim",
            "vocab_size",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "encoder_dim",
        )
    }
    graph = {
        "file": "onnx/model.onnx",
        "inputs": [t.to_dict() for t in io.inputs],
        "outputs": [t.to_dict() for t in io.outputs],
    }
    manifest = typed_manifest(
        {"family": spec.family, "config": spec.config, "model": model, "graphs": {"model": graph}}
    )
    return dataclasses.replace(manifest, kv_cache=kv_cache_info(spec, "float32"))  # its cache kind, as written


@pytest.mark.parametrize("case", sorted(__import__("kiln.plugins.hf.tiny", fromlist=["TINY"]).TINY))
def test_every_size_genai_config_states_is_the_models(case: str) -> None:
    """For every Hugging Face architecture's tiny model: the decoder sizes genai_config.json states
    are its config's (heads, hidden width, layers, vocabulary) and its cache's (the KV heads and
    head size of the tensors its own forward pass returns). It said num_attention_heads = the KV
    heads and hidden_size = their width, reading the native family's keys."""
    pytest.importorskip("transformers")
    import torch

    from kiln.plugins.hf import tiny_model

    loaded = tiny_model(case, seed=0)
    config = loaded.module.model.config
    if (cache := loaded.spec.cache) is not None:  # latent, state, hybrid, shared_kv: GenAI cannot run it, says so
        with pytest.raises(
            ArtifactError, match=f"genai: no genai_config.json for a {cache.kind} cache .*kiln generate"
        ):
            genai_config(_manifest_of(loaded))
        return
    genai = genai_config(_manifest_of(loaded))
    decoder = genai["model"]["decoder"]
    with torch.no_grad():
        one = torch.ones((1, 1), dtype=torch.int64)
        _, presents = loaded.module(one, one, torch.zeros((1, 1), dtype=torch.int64))
    _, kv_heads, _, head_size = presents[0][0].shape
    assert decoder["num_attention_heads"] == config.num_attention_heads
    assert decoder["hidden_size"] == config.hidden_size
    assert decoder["num_hidden_layers"] == config.num_hidden_layers == len(presents)
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (kv_heads, head_size)
    assert genai["model"]["vocab_size"] == config.vocab_size


def test_a_size_the_config_does_not_state_is_left_out(tmp_path: Path) -> None:
    """A family whose config names no heads or width: genai_config leaves them out (GenAI sizes
    its cache by head_size and num_key_value_heads) rather than state a guess; GenAI parses it."""
    import dataclasses

    loaded = load_model("demo")
    manifest = dataclasses.replace(_manifest_of(loaded), family="third-party", config={"layers": 4})
    decoder = genai_config(manifest)["model"]["decoder"]
    assert "num_attention_heads" not in decoder and "hidden_size" not in decoder
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (loaded.spec.n_kv_heads, loaded.spec.head_dim)
    (tmp_path / "genai_config.json").write_text(json.dumps(genai_config(manifest)))
    og.Config(str(tmp_path))
