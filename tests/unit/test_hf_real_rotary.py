"""Llama 4's complex rotary and kiln's real-arithmetic rewrite of it (``plugins.hf.real_rotary``,
what torch.export traces) compute the same rotation, and the rewrite is patched in only while
a graph is traced."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="Llama 4's rotary is transformers' code")

import torch
from transformers.models.llama4 import modeling_llama4

from kiln.plugins.hf.real_rotary import real_apply_rotary, real_freqs, real_rotary, rewrites_for

_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}  # attention_scaling != 1
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}


def _rotary(rope: dict[str, Any]) -> Any:
    config = transformers.Llama4TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        rope_parameters=rope,
    )
    return modeling_llama4.Llama4TextRotaryEmbedding(config)


@pytest.mark.parametrize("rope", [_LLAMA3, _YARN], ids=["llama3", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_real_rotation_equals_the_complex_one(rope: dict[str, Any], dtype: torch.dtype) -> None:
    rotary, generator = _rotary(rope), torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 40, heads, 16, generator=generator).to(dtype) for heads in (4, 2))
    positions = torch.stack(
        [torch.arange(40), torch.arange(40) + 100]
    )  # two rows, past the yarn/llama3 original context
    want_q, want_k = modeling_llama4.apply_rotary_emb(q, k, rotary(q, positions))
    freqs = real_freqs(rotary, q, positions)
    assert freqs.shape == (2, 40, 8, 2) and not freqs.is_complex(), freqs.shape
    got_q, got_k = real_apply_rotary(q, k, freqs)
    assert (got_q.dtype, got_k.dtype) == (dtype, dtype)
    atol = 1e-6 if dtype == torch.float32 else 0.0  # fp16: both round the same float32 product to the same half
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert rope is _LLAMA3 or abs(float(rotary.attention_scaling) - 1.0) > 0.1  # yarn's scaling is really exercised


def test_a_wrong_pairing_is_not_equal() -> None:
    """The check above can fail: rotating the two halves (Llama's layout) instead of adjacent pairs differs."""
    rotary = _rotary(_LLAMA3)
    x = torch.randn(1, 8, 2, 16, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8)[None]
    want, _ = modeling_llama4.apply_rotary_emb(x, x, rotary(x, positions))
    halves = x.reshape(1, 8, 2, 2, 8).transpose(-1, -2).reshape(1, 8, 2, 16)
    got, _ = real_apply_rotary(halves, halves, real_freqs(rotary, x, positions))
    assert not torch.allclose(got, want, atol=1e-3)


def test_the_patch_is_in_place_inside_only() -> None:
    forward, apply = modeling_llama4.Llama4TextRotaryEmbedding.forward, modeling_llama4.apply_rotary_emb
    with pytest.raises(RuntimeError, match="inside"), real_rotary():
        assert (
            modeling_llama4.Llama4TextRotaryEmbedding.forward is real_freqs
            and modeling_llama4.apply_rotary_emb is real_apply_rotary
        )
        raise RuntimeError("inside")
    assert (modeling_llama4.Llama4TextRotaryEmbedding.forward, modeling_llama4.apply_rotary_emb) == (forward, apply)


def test_eager_runs_and_other_models_keep_transformers_code() -> None:
    """Outside torch.export nothing is patched (kiln's PyTorch reference is transformers' own code),
    and a model without Llama 4's rotary is never patched."""
    llama4 = torch.nn.ModuleList([_rotary(_LLAMA3)])
    with rewrites_for(llama4)():
        assert modeling_llama4.apply_rotary_emb is not real_apply_rotary
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=16
        )
    )
    assert not isinstance(rewrites_for(llama)(), type(real_rotary()))


def test_torch_export_traces_the_real_rotation() -> None:
    """Under torch.export the rewrite is entered: the traced program holds no complex tensor, and
    computes what transformers' complex code does."""

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rotary = _rotary(_LLAMA3)
            self.enter = rewrites_for(self)

        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            with self.enter():  # the module's own global names, looked up at call time (as Llama 4's attention does)
                rotated: torch.Tensor = modeling_llama4.apply_rotary_emb(
                    x, x, modeling_llama4.Llama4TextRotaryEmbedding.forward(self.rotary, x, positions)
                )[0]
            return rotated

    x, positions = torch.randn(1, 12, 2, 16, generator=torch.Generator().manual_seed(2)), torch.arange(12)[None]
    program = torch.export.export(Probe(), (x, positions))
    complex_values = [
        n.name for n in program.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_complex()
    ]
    assert complex_values == [], complex_values
    want = modeling_llama4.apply_rotary_emb(x, x, Probe().rotary(x, positions))[0]
    torch.testing.assert_close(program.module()(x, positions), want, rtol=0, atol=1e-6)
