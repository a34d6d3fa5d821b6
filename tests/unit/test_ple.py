from __future__ import annotations

import itertools

import pytest
import torch

from kiln.exporter.fold import check_folding
from kiln.exporter.options import PLEExtendMode
from kiln.plugins.native.build import random_model
from kiln.plugins.native.config import NormKind, NormPosition, PLEPlacement
from kiln.plugins.native.model import PLESubLayer
from kiln.plugins.native.ple import NATIVE_PLE, FoldedPLE, extend_ple, fold_ple, ple_sublayers
from kiln_testing import tiny_config


@pytest.mark.parametrize(
    ("norm", "position", "bounded", "projection"),
    list(itertools.product(NormKind, NormPosition, (False, True), (False, True))),
)
def test_folded_equals_unfolded_at_every_position(
    norm: NormKind, position: NormPosition, bounded: bool, projection: bool
) -> None:
    cfg = tiny_config(norm=norm, norm_position=position, ple={"bounded": bounded, "projection": projection})
    model = random_model(cfg, 3)
    folded = fold_ple(model)
    checks = check_folding(NATIVE_PLE, model, folded, tolerance=1e-5)
    assert [c.positions for c in checks] == [48, 48]
    assert all(c.max_abs_error <= 1e-5 for c in checks)
    # nothing of the PLE embedding, projection or split is left
    assert all(isinstance(m, FoldedPLE) for _, m in ple_sublayers(folded))
    assert not any(isinstance(m, PLESubLayer) for m in folded.modules())
    # the original model is untouched and shares its weights with the folded one
    assert all(isinstance(m, PLESubLayer) for _, m in ple_sublayers(model))
    assert folded.layers[0].attn.q_proj.weight is model.layers[0].attn.q_proj.weight


def test_fold_math_pre_norm_layernorm() -> None:
    cfg = tiny_config(norm=NormKind.LAYERNORM, ple={"bounded": True})
    sub = random_model(cfg, 0).layers[0].ple
    folded = fold_ple(random_model(cfg, 0)).layers[0].ple
    p = 5
    a, b = sub.ple.table.weight[p].split(32)
    gamma, beta = sub.norm.weight, sub.norm.bias
    torch.testing.assert_close(folded.scale[p], gamma * (1 + torch.tanh(a)))
    torch.testing.assert_close(folded.shift[p], beta * (1 + torch.tanh(a)) + b)


def test_folding_changes_outputs_when_tables_are_wrong() -> None:
    """The folding check can fail: corrupt one row and it must say so."""
    model = random_model(tiny_config(), 0)
    folded = fold_ple(model)
    with torch.no_grad():
        folded.layers[1].ple.shift[17] += 0.5
    from kiln.errors import ExportError

    with pytest.raises(ExportError, match="PLE folding of layers.1.ple differs from the unfolded sub-layer"):
        check_folding(NATIVE_PLE, model, folded)


@pytest.mark.parametrize("placement", list(PLEPlacement))
def test_each_placement_has_one_ple_per_layer(placement: PLEPlacement) -> None:
    model = random_model(tiny_config(ple={"placement": placement}), 0)
    assert [name for name, _ in ple_sublayers(model)] == ["layers.0.ple", "layers.1.ple"]
    assert model.layers[0].ple_placement is placement


def test_extend_clamp_and_interpolate() -> None:
    model = random_model(tiny_config(), 0)
    old = model.layers[0].ple.ple.table.weight.clone()  # [48, 64]
    extend_ple(model, 96, PLEExtendMode.CLAMP)
    new = model.layers[0].ple.ple.table.weight
    assert new.shape == (96, 64)
    torch.testing.assert_close(new[:48], old)
    torch.testing.assert_close(new[60], old[47])

    model = random_model(tiny_config(), 0)
    extend_ple(model, 95, PLEExtendMode.INTERPOLATE)  # row p samples old at p * 47 / 94 = p / 2
    new = model.layers[0].ple.ple.table.weight
    torch.testing.assert_close(new[0], old[0])
    torch.testing.assert_close(new[94], old[47])
    torch.testing.assert_close(new[2 * 10], old[10])
    torch.testing.assert_close(new[2 * 10 + 1], (old[10] + old[11]) / 2)
