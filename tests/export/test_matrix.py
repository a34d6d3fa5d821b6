"""Every family option exported and checked for FP32 tensor and generation parity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.exporter.option_groups import ParityOptions
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln_testing import tiny_config, write_checkpoint

MATRIX: dict[str, dict[str, Any]] = {
    "default-swiglu-rmsnorm-pre-rope-gqa-tied": {},
    "gelu-layernorm-learned-bias-untied": dict(
        mlp="gelu", norm="layernorm", position="learned", bias=True, tie_embeddings=False
    ),
    "post-layernorm-rope-ple-before-attention": dict(
        norm_position="post", norm="layernorm", ple={"placement": "before_attention"}
    ),
    "post-rmsnorm-nopos-ple-after-mlp-bounded": dict(
        norm_position="post", position="none", ple={"placement": "after_mlp", "bounded": True}
    ),
    "projected-ple-mha-gelu": dict(n_kv_heads=4, mlp="gelu", ple={"projection": True}),
    "bounded-projected-mqa": dict(n_kv_heads=1, ple={"bounded": True, "projection": True}),
    "no-ple-learned-layernorm": dict(ple={"enabled": False}, position="learned", norm="layernorm"),
    "pre-layernorm-swiglu-bias-after-mlp": dict(norm="layernorm", bias=True, ple={"placement": "after_mlp"}),
    "cross-attention-gelu-learned-mqa": dict(cross_attention=True, mlp="gelu", position="learned", n_kv_heads=1),
}


def _config(changes: dict[str, Any]) -> Any:
    from kiln.plugins.native.config import NativeConfig

    base = tiny_config().to_dict()
    ple = {**base["ple"], **changes.get("ple", {})}
    return NativeConfig.from_dict({**base, **changes, "ple": ple})


@pytest.mark.parametrize("name", list(MATRIX))
def test_export_parity(name: str, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", _config(MATRIX[name]), seed=len(name))
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4))
    parity = result.parity
    assert parity.passed, parity.failures()
    assert {t.graph for t in parity.tensors} == {"prefill", "decode", "model"}
    assert max(t.max_abs for t in parity.tensors if t.output == "logits") <= 1e-4
    gens = {(g.path, g.batch) for g in parity.generation}
    assert gens == {("prefill+decode", 1), ("model", 1), ("prefill+decode", 3), ("model", 3)}
    for g in parity.generation:
        assert g.token_match_rate == 1.0 or g.ties > 0
        # the default --parity-tokens (32) fits the 48-token context after the 12-token prompt
        assert g.steps == ParityOptions().tokens == 32 and len(g.per_step_max_abs) == 32
    assert (tmp_path / "out" / "reports" / "parity.png").stat().st_size > 1000


def test_matrix_covers_every_option() -> None:
    """The matrix above must keep exercising each value of each family option."""
    from kiln.plugins.native.config import MLPKind, NormKind, NormPosition, PLEPlacement, PositionKind

    configs = [_config(c) for c in MATRIX.values()]
    assert {c.mlp for c in configs} == set(MLPKind)
    assert {c.norm for c in configs} == set(NormKind)
    assert {c.norm_position for c in configs} == set(NormPosition)
    assert {c.position for c in configs} == set(PositionKind)
    assert {c.ple.placement for c in configs if c.ple.enabled} == set(PLEPlacement)
    assert {c.ple.bounded for c in configs} == {True, False}
    assert {c.cross_attention for c in configs} == {True, False}
    assert {c.ple.projection for c in configs} == {True, False}
    assert {c.ple.enabled for c in configs} == {True, False}
    assert {c.tie_embeddings for c in configs} == {True, False}
    assert {c.bias for c in configs} == {True, False}
    assert {c.n_kv_heads == c.n_heads for c in configs} == {True, False}
