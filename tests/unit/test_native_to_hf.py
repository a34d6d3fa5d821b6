"""benchmarks/native_to_hf.py: a native Llama-shaped checkpoint written as a Hugging Face Llama
gives transformers' logits equal to kiln's native model (what lets the GenAI builder run on the
low-bit study's trained model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kiln.plugins import load_model
from kiln_testing import tiny_config, write_checkpoint

transformers = pytest.importorskip("transformers")


def _benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ (not an installed package) imported from its file."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kiln_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_converter = _benchmark("native_to_hf")
hf_config, max_logit_difference, native_to_hf = (
    _converter.hf_config,
    _converter.max_logit_difference,
    _converter.native_to_hf,
)


def llama_like(**overrides: object) -> object:
    # GQA (4 query heads over 2 KV heads), SwiGLU, RMSNorm, RoPE, tied head, no PLE
    return tiny_config(
        ple={"enabled": False},
        rope_theta=500.0,
        norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
        **overrides,
    )


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["def f(x):\n    return x + 1\n"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>", "<|eos|>"]),
    )
    tok.save(str(path))


def test_logits_equal_and_tokenizer_named(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "native", llama_like(), seed=3)  # norms != 1: a swapped norm would show
    _tokenizer(ckpt / "tokenizer.json")
    out = native_to_hf(ckpt, tmp_path / "hf")
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(0))
    assert max_logit_difference(ckpt, out, ids) < 1e-5
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.num_key_value_heads, config.head_dim, config.rms_norm_eps, config.tie_word_embeddings) == (
        2,
        8,
        1e-6,
        True,
    )
    assert config.rope_parameters["rope_theta"] == 500.0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|eos|>", "<|pad|>")
    assert (
        tok("def f").input_ids
        == transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"))("def f").input_ids
    )


def test_comparison_sees_a_wrong_mapping(tmp_path: Path) -> None:
    """The equality above is not vacuous: SwiGLU's up and gate swapped in one layer (the one
    mapping a shape check cannot catch) moves the logits far beyond the tolerance."""
    ckpt = write_checkpoint(tmp_path / "native", llama_like(), seed=3)
    out = native_to_hf(ckpt, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    mlp = hf.model.layers[1].mlp
    with torch.no_grad():
        up = mlp.up_proj.weight.clone()
        mlp.up_proj.weight.copy_(mlp.gate_proj.weight)
        mlp.gate_proj.weight.copy_(up)
    ids = torch.arange(30)[None]
    with torch.no_grad():
        got = hf(input_ids=ids).logits
        want = load_model(ckpt).module(ids, torch.ones_like(ids), ids)[0]
    assert float((got - want).abs().max()) > 1e-2


def test_decode_with_cache_matches(tmp_path: Path) -> None:
    """Prefill then one cached step: the rotary position of the new token and the GQA cache agree."""
    ckpt = write_checkpoint(tmp_path / "native", llama_like(), seed=5)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        native_to_hf(ckpt, tmp_path / "hf"), attn_implementation="eager"
    ).eval()
    native = load_model(ckpt).module
    ids = torch.arange(3, 23)[None]
    with torch.no_grad():
        first = hf(input_ids=ids[:, :-1], use_cache=True)
        step = hf(input_ids=ids[:, -1:], past_key_values=first.past_key_values, use_cache=True).logits
        _, past = native(ids[:, :-1], torch.ones_like(ids[:, :-1]), torch.arange(19)[None])
        want = native(ids[:, -1:], torch.ones_like(ids), torch.tensor([[19]]), past)[0]
    assert torch.allclose(step, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"ple": {"enabled": True}}, "PLE"),
        ({"norm": "layernorm"}, "norm layernorm"),
        ({"mlp": "gelu"}, "mlp gelu"),
        ({"position": "learned"}, "position learned"),
    ],
)
def test_non_llama_configs_refused(overrides: dict[str, object], named: str) -> None:
    from kiln.plugins.native.config import NativeConfig

    base = llama_like().to_dict()  # type: ignore[attr-defined]
    base.update({k: v for k, v in overrides.items() if k != "ple"})
    if "ple" in overrides:
        base["ple"] = {**base["ple"], **overrides["ple"]}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=named):
        hf_config(NativeConfig.from_dict(base))
