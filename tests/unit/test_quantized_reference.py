"""parity.quantized: PyTorch computing with an export's int4 numbers (the second reference of an int4 export)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.int4.numbers import dequantize, rtn
from kiln.exporter.parity.quantized import Int4Weight, use_int4_weights


class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D: weight [K, N], ``x @ weight + bias``."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n))
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.proj = nn.Linear(32, 48)
        self.conv = Conv1D(48, 32)
        self.head = nn.Linear(32, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def _weight(module: str, k: int, n: int, seed: int) -> Int4Weight:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    q, scale = rtn(w, 16, np.dtype(np.float32))
    return Int4Weight(module, f"/{module}/weight/DequantizeLinear", q, scale)


def test_modules_compute_with_the_int4_numbers_and_free_their_own() -> None:
    model = Model()
    weights = [_weight("proj", 32, 48, 0), _weight("conv", 48, 32, 1), _weight("head", 32, 10, 2)]
    assert use_int4_weights(model, iter(weights)) == ["proj", "conv", "head"]
    x = torch.randn(3, 32)
    for module, weight, bias in (
        (model.proj, weights[0], model.proj.bias),
        (model.conv, weights[1], model.conv.bias),
        (model.head, weights[2], None),
    ):
        inputs = x if module is not model.conv else torch.randn(3, 48)
        want = inputs.numpy() @ dequantize(weight.q, weight.scale) + (bias.detach().numpy() if bias is not None else 0)
        np.testing.assert_allclose(module(inputs).detach().numpy(), want, rtol=1e-5, atol=1e-5)
    assert model.proj.weight.numel() == 0 and model.conv.weight.numel() == 0  # freed
    assert model.embed.weight.shape == (10, 32)  # tied to the head: kept, the embedding still reads it


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (
            _weight("missing", 32, 48, 0),
            "parity: /missing/weight/DequantizeLinear belongs to missing, which the model has no module of",
        ),
        (
            _weight("embed", 16, 32, 0),
            "cannot be mapped onto embed (Embedding, weight (10, 32)): only an nn.Linear's or a Conv1D's weight can be",
        ),
        (_weight("proj", 48, 32, 0), "int4 weight [K=48, N=32] cannot be mapped onto proj (Linear, weight (48, 32))"),
    ],
)
def test_a_weight_it_cannot_map_is_refused_by_name(weight: Int4Weight, message: str) -> None:
    with pytest.raises(ExportError) as err:
        use_int4_weights(Model(), [weight])
    assert message in str(err.value)


def test_no_int4_weight_is_refused() -> None:
    with pytest.raises(ExportError) as err:
        use_int4_weights(Model(), [])
    assert "the graphs hold no int4 weight" in str(err.value)
