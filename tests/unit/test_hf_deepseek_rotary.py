"""DeepSeek-V2's complex rotary and kiln's real-arithmetic rewrite of it (``plugins.hf.deepseek_rotary``,
what torch.export traces) compute the same rotation of ``[B, H, S, D]`` queries and keys, and the
rewrite is patched in only while a graph is traced."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="DeepSeek-V2's rotary is transformers' code")

import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

from kiln.plugins.hf.deepseek_rotary import deepseek_rewrites_for, real_apply_rotary_bhsd, real_deepseek_rotary
from kiln.plugins.hf.real_rotary import real_freqs

_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}  # attention_scaling != 1
_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def _rotary(rope: dict[str, Any]) -> Any:
    config = transformers.DeepseekV2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_rope_head_dim=8,
        head_dim=8,
        rope_parameters=rope,
    )
    return v2.DeepseekV2RotaryEmbedding(config)


@pytest.mark.parametrize("rope", [_DEFAULT, _YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_real_rotation_equals_the_complex_one(rope: dict[str, Any], dtype: torch.dtype) -> None:
    rotary, generator = _rotary(rope), torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, heads, 40, 8, generator=generator).to(dtype) for heads in (4, 1)
    )  # the queries' heads, the one shared rope key
    positions = torch.stack([torch.arange(40), torch.arange(40) + 100])  # two rows, past yarn's original context
    want_q, want_k = v2.apply_rotary_emb(q, k, rotary(q, positions))
    freqs = real_freqs(rotary, q, positions)
    assert freqs.shape == (2, 40, 4, 2) and not freqs.is_complex(), freqs.shape
    got_q, got_k = real_apply_rotary_bhsd(q, k, freqs)
    assert (got_q.shape, got_k.shape, got_q.dtype) == (q.shape, k.shape, dtype)
    atol = 1e-6 if dtype == torch.float32 else 0.0  # fp16: both round the same float32 product to the same half
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert rope is _DEFAULT or abs(float(rotary.attention_scaling) - 1.0) > 0.1  # yarn's scaling is really exercised


def test_a_wrong_layout_is_not_equal() -> None:
    """The check above can fail: the rotation read as [B, S, H, D] (Llama 4's layout) differs."""
    rotary = _rotary(_DEFAULT)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8)[None]
    want, _ = v2.apply_rotary_emb(x, x, rotary(x, positions))
    swapped, _ = real_apply_rotary_bhsd(x.transpose(1, 2), x.transpose(1, 2), real_freqs(rotary, x, positions)[:, :4])
    assert swapped.transpose(1, 2).shape != want.shape or not torch.allclose(swapped.transpose(1, 2), want, atol=1e-3)


def test_the_patch_is_in_place_inside_only_and_only_when_exporting() -> None:
    forward, apply = v2.DeepseekV2RotaryEmbedding.forward, v2.apply_rotary_emb
    with pytest.raises(RuntimeError, match="inside"), real_deepseek_rotary():
        assert v2.DeepseekV2RotaryEmbedding.forward is real_freqs and v2.apply_rotary_emb is real_apply_rotary_bhsd
        raise RuntimeError("inside")
    assert (v2.DeepseekV2RotaryEmbedding.forward, v2.apply_rotary_emb) == (forward, apply)
    with deepseek_rewrites_for(
        torch.nn.Sequential(_rotary(_DEFAULT))
    )():  # eager, not exporting: transformers' own code
        assert v2.apply_rotary_emb is apply
