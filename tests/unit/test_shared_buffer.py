"""Which nodes read a past's sequence length (``contract.shared_buffer``): what keeps a decode
graph off the shared in-place cache buffer, whose sequence length is its capacity."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from kiln.exporter.artifacts.facts import graph_facts
from kiln.exporter.contract.shared_buffer import reads_past_length


@pytest.mark.parametrize(
    ("op_type", "attributes", "reads"),
    [
        ("GroupQueryAttention", {}, False),  # by attention_mask's total
        ("Shape", {"start": 0, "end": 1}, False),  # the batch
        ("Shape", {"start": 1, "end": 2}, False),  # the heads
        ("Shape", {"start": 3}, False),  # the width
        ("Shape", {"start": 2, "end": 3}, True),  # the sequence
        ("Shape", {"start": -2, "end": -1}, True),  # the sequence, counted from the end
        ("Shape", {}, True),  # every dim
        ("Concat", {"axis": 2}, True),  # the portable graphs' cache update
    ],
)
def test_a_reader_of_the_sequence_axis_is_told(op_type: str, attributes: dict[str, int], reads: bool) -> None:
    assert reads_past_length(op_type, attributes) is reads


def _decode(start: int, end: int) -> onnx.ModelProto:
    """A decode graph whose past is read by GroupQueryAttention and by a Shape of [start, end)."""
    past = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", 2, "past", 8])
    out = helper.make_tensor_value_info("n", TensorProto.INT64, None)
    gqa = helper.make_node("GroupQueryAttention", ["q", "", "", "past_key_values.0.key"], ["o"], domain="com.microsoft")
    shape = helper.make_node("Shape", ["past_key_values.0.key"], ["n"], start=start, end=end)
    return helper.make_model(helper.make_graph([gqa, shape], "decode", [past], [out]))


@pytest.mark.parametrize(("start", "end", "kind"), [(0, 1, "shared"), (2, 3, "grown")])
def test_kiln_verify_reads_the_cache_kind_the_same_way(start: int, end: int, kind: str, tmp_path: Path) -> None:
    from kiln.exporter.artifacts.facts import _cache_kind

    path = tmp_path / "decode.onnx"
    onnx.save(_decode(start, end), path)
    assert _cache_kind(graph_facts(path)) == kind
