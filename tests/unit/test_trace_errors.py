"""A failed trace says its cause in one line: the root of the exception chain (torch.onnx's own
first line, "Failed to export ... Next steps:", names none), colour codes stripped, and what was
traced (``exporter/trace/torch_export.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.errors import ExportError
from kiln.exporter.contract.io import GraphKind, graph_io
from kiln.exporter.trace.torch_export import root_cause, trace_graph
from kiln.plugins.base import DecoderSpec


class _DataDependent(nn.Module):
    """A decoder whose forward branches on a value of its input: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, list[object]]:
        if int(input_ids.sum()) > 3:
            return self.embed(input_ids), []
        return -self.embed(input_ids), []


def test_the_root_cause_in_one_line_without_colour_codes() -> None:
    try:
        try:
            raise ValueError("\x1b[1mshape mismatch\x1b[0m in layer 3\nsecond line")
        except ValueError as inner:
            raise RuntimeError("Failed to export the model. \x1b[96mThis is step 1/3\x1b[0m. Next steps:") from inner
    except RuntimeError as exc:
        assert root_cause(exc) == "ValueError: shape mismatch in layer 3"
    assert root_cause(KeyError()) == "KeyError"


def test_a_failed_trace_names_the_model_and_the_cause() -> None:
    spec = DecoderSpec(family="native", n_layers=1, n_kv_heads=1, head_dim=4, vocab_size=16, max_context=32)
    io = graph_io(spec, GraphKind.UNIFIED, last_logits_only=False)
    with pytest.raises(ExportError) as err:
        trace_graph(
            _DataDependent(),
            GraphKind.UNIFIED,
            io,
            n_layers=1,
            vocab=16,
            opset=18,
            last_logits_only=False,
            max_batch=2,
            max_context=32,
        )
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "\x1b" not in message, message
    assert "tracing the model graph of _DataDependent failed: GuardOnDataDependentSymNode: " in message, message
    assert "data-dependent expression" in message and "Next steps" not in message, message
