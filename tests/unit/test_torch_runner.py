"""``computes_in_fp32`` (``runners.torch_runner``): a bf16 module computes exactly what its fp32
copy computes, either with its weights converted once in place (when their fp32 copy fits the
budget) or lent in fp32 one module call at a time (when it does not: the weights stay bf16)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kiln.exporter.runners.torch_runner import computes_in_fp32


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as many LMs' heads are
        self.register_buffer("shift", torch.linspace(-1, 1, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(ids)) + self.shift))


@pytest.mark.parametrize(
    ("budget", "kept"), [(None, torch.float32), (0, torch.bfloat16)], ids=["converted once", "lent per call"]
)
def test_a_bf16_module_computes_its_fp32_copy_exactly(budget: int | None, kept: torch.dtype) -> None:
    low = Tiny().to(torch.bfloat16)
    want = copy.deepcopy(low).float()
    ids = torch.tensor([[1, 5, 9, 15]])
    module = computes_in_fp32(copy.deepcopy(low), budget=budget)
    with torch.no_grad():
        got, expected = module(ids), want(ids)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert {p.dtype for p in module.parameters()} == {kept}
    assert module.head.weight is module.embed.weight  # the tie survives the conversion
