from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.plugins.native.config import NativeConfig, NormKind, PLEPlacement
from kiln_testing import TINY, tiny_config


def test_round_trip(tmp_path: Path) -> None:
    cfg = tiny_config(norm=NormKind.LAYERNORM, ple={"placement": PLEPlacement.AFTER_MLP, "bounded": True})
    cfg.save(tmp_path / "config.json")
    again = NativeConfig.load(tmp_path / "config.json")
    assert again == cfg
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == "kiln-ple-decoder"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 30}, "d_model (30) must be divisible by n_heads (4)"),
        ({"n_kv_heads": 3}, "n_heads (4) must be a multiple of n_kv_heads (3)"),
        ({"n_layers": 0}, "n_layers must be a positive integer, found 0"),
        ({"vocab_size": "101"}, "vocab_size must be a positive integer, found '101'"),
        ({"n_layers": True}, "n_layers must be a positive integer, found True"),
        ({"mlp": "relu"}, "mlp must be one of gelu, swiglu, found 'relu'"),
        ({"norm": "batchnorm"}, "norm must be one of layernorm, rmsnorm, found 'batchnorm'"),
        ({"position": "alibi"}, "position must be one of none, learned, rope, found 'alibi'"),
        ({"norm_eps": 0}, "norm_eps must be a float in (0, 1), found 0.0"),
        (
            {"ple": {"placement": "middle"}},
            "ple.placement must be one of before_attention, residual, after_mlp, found 'middle'",
        ),
        ({"ple": {"max_positions": -1}}, "ple.max_positions must be a positive integer, found -1"),
        ({"ple": {"colour": 1}}, "unknown ple keys ['colour']"),
        ({"eos_token_id": 500}, "eos_token_id must be a token id in [0, 101), found 500"),
        ({"tie_embeddings": "yes"}, "tie_embeddings must be true or false, found 'yes'"),
        ({"flash": True}, "unknown config keys ['flash']"),
    ],
)
def test_invalid_values_are_named(changes: dict[str, object], message: str) -> None:
    raw = {**tiny_config().to_dict(), **changes}
    with pytest.raises(ConfigError) as err:
        NativeConfig.from_dict(raw)
    assert message in str(err.value)


def test_missing_required_key() -> None:
    raw = {k: v for k, v in TINY.items() if k != "d_ff"}
    with pytest.raises(ConfigError, match=r"config is missing required keys \['d_ff'\]"):
        NativeConfig.from_dict(raw)


def test_rope_needs_even_head_dim() -> None:
    with pytest.raises(ConfigError, match="rope needs an even head_dim, found 9"):
        tiny_config(d_model=36, n_heads=4, n_kv_heads=4)
