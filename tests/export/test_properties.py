"""Property tests: random valid family configs export with FP32 parity; random invalid configs
fail with a KilnError, never a traceback from deep inside torch or onnx."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import KilnError
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln.plugins import load_model
from kiln.plugins.native.config import (
    MLPKind,
    NativeConfig,
    NormKind,
    NormPosition,
    PLEConfig,
    PLEPlacement,
    PositionKind,
)
from kiln_testing import write_checkpoint


@st.composite
def valid_configs(draw: st.DrawFn) -> NativeConfig:
    n_kv = draw(st.sampled_from([1, 2]))
    n_heads = n_kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    context = draw(st.integers(min_value=16, max_value=40))
    return NativeConfig(
        vocab_size=draw(st.integers(min_value=20, max_value=80)),
        d_model=n_heads * head_dim,
        n_layers=draw(st.integers(min_value=1, max_value=2)),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_ff=draw(st.sampled_from([8, 24])),
        mlp=draw(st.sampled_from(list(MLPKind))),
        norm=draw(st.sampled_from(list(NormKind))),
        norm_position=draw(st.sampled_from(list(NormPosition))),
        position=draw(st.sampled_from(list(PositionKind))),
        ple=PLEConfig(
            enabled=draw(st.booleans()),
            max_positions=context + draw(st.integers(min_value=0, max_value=8)),
            placement=draw(st.sampled_from(list(PLEPlacement))),
            bounded=draw(st.booleans()),
            projection=draw(st.booleans()),
        ),
        tie_embeddings=draw(st.booleans()),
        bias=draw(st.booleans()),
        max_context=context,
    )


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=valid_configs(), seed=st.integers(min_value=0, max_value=1000))
def test_random_valid_configs_export_with_parity(cfg: NativeConfig, seed: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", cfg, seed)
        result = export(ckpt, Path(tmp) / "out", ExportOptions.from_flags(max_batch=3, parity_tokens=12))
        assert result.parity.passed, result.parity.failures()
        assert all(g.first_divergence is None for g in result.parity.generation)


_BAD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=0),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)
_FIELDS = [
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "mlp",
    "norm",
    "norm_eps",
    "norm_position",
    "position",
    "rope_theta",
    "tie_embeddings",
    "bias",
    "max_context",
    "ple",
    "eos_token_id",
]


@settings(max_examples=60, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(_FIELDS), _BAD_VALUES, min_size=1, max_size=3))
def test_random_invalid_configs_fail_with_kiln_error(changes: dict[str, Any]) -> None:
    cfg = NativeConfig(
        vocab_size=30,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=8,
        max_context=16,
        ple=PLEConfig(max_positions=16),
    )
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", cfg)
        raw = {**json.loads((ckpt / "config.json").read_text()), **changes}
        (ckpt / "config.json").write_text(json.dumps(raw))
        try:
            load_model(ckpt)
        except KilnError:
            return
        # a change can still be valid and consistent with the weights (bias=False as before,
        # rope_theta=1.5); then the config is taken as written: no value coerced (True for 1,
        # 1 for 1.0) or dropped
        loaded = NativeConfig.load(ckpt / "config.json").to_dict()
        assert {k: json.dumps(loaded[k]) for k in changes} == {k: json.dumps(v) for k, v in changes.items()}
