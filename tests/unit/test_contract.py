from __future__ import annotations

import numpy as np

from kiln.exporter.contract.io import GraphKind, carried_cache, graph_io
from kiln.exporter.contract.steps import right_pad
from kiln.exporter.parity import left_pad
from kiln.exporter.parity.driver import parity_plan
from kiln.plugins.native import spec_of
from kiln_testing import tiny_config


def test_graph_io_names_and_dims() -> None:
    spec = spec_of(tiny_config())
    prefill = graph_io(spec, GraphKind.PREFILL)
    assert prefill.input_names == ["input_ids", "attention_mask", "position_ids"]
    assert prefill.output_names == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert prefill.outputs[1].dims == ("batch", 2, "seq", 8)
    decode = graph_io(spec, GraphKind.DECODE)
    assert decode.input_names[3:] == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert decode.inputs[0].dims == ("batch", 1)
    assert decode.inputs[1].dims == ("batch", "total_seq")
    assert decode.inputs[3].dims == ("batch", 2, "past_seq", 8)
    assert decode.outputs[0].dims == ("batch", 1, 101)
    assert decode.outputs[1].dims == ("batch", 2, "total_seq", 8)
    unified = graph_io(spec, GraphKind.UNIFIED)
    assert unified.inputs[0].dims == ("batch", "seq") and unified.outputs[0].dims == ("batch", "seq", 101)
    last = graph_io(spec, GraphKind.PREFILL, last_logits_only=True)
    assert last.outputs[0].dims == ("batch", 1, 101)
    assert graph_io(spec, GraphKind.UNIFIED, last_logits_only=True).outputs[0].dims == ("batch", "seq", 101)
    tables = graph_io(spec, GraphKind.DECODE, ple_tables=((48, 32), (48, 32)))
    assert tables.input_names[-4:] == ["ple.0.scale", "ple.0.shift", "ple.1.scale", "ple.1.shift"]


def test_cross_attention_graph_io() -> None:
    spec = spec_of(tiny_config(cross_attention=True))
    assert spec.encoder_dim == 32
    prefill = graph_io(spec, GraphKind.PREFILL, kv_dtype="float16")
    assert prefill.input_names == ["input_ids", "attention_mask", "position_ids", "encoder_hidden_states"]
    assert prefill.inputs[3].dims == ("batch", "encoder_seq", 32) and prefill.inputs[3].dtype == "float16"
    assert prefill.output_names[1:5] == [
        "present.0.key",
        "present.0.value",
        "present.0.cross_key",
        "present.0.cross_value",
    ]
    assert prefill.outputs[3].dims == ("batch", 2, "encoder_seq", 8)
    for kind in (GraphKind.DECODE, GraphKind.UNIFIED):
        io = graph_io(spec, kind)
        assert io.input_names[3:7] == [
            "past_key_values.0.key",
            "past_key_values.0.value",
            "past_key_values.0.cross_key",
            "past_key_values.0.cross_value",
        ]
        assert io.inputs[4].dims == ("batch", 2, "past_seq", 8) and io.inputs[5].dims == ("batch", 2, "encoder_seq", 8)
        assert io.output_names == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert carried_cache(spec)[:4] == [
        ("past_key_values.0.key", "present.0.key"),
        ("past_key_values.0.value", "present.0.value"),
        ("past_key_values.0.cross_key", "present.0.cross_key"),
        ("past_key_values.0.cross_value", "present.0.cross_value"),
    ]
    assert len(carried_cache(spec_of(tiny_config()))) == 4


def test_left_pad_positions() -> None:
    ids, mask, pos = left_pad([[5, 6, 7], [9]], pad_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 1, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert ids.dtype == mask.dtype == pos.dtype == np.int64


def test_padding_to_a_length() -> None:
    ids, mask, pos = left_pad([[5, 6]], pad_id=1, length=4)  # one row, padded: what parity runs at --max-batch 1
    assert (ids.tolist(), mask.tolist(), pos.tolist()) == ([[1, 1, 5, 6]], [[0, 0, 1, 1]], [[0, 0, 0, 1]])
    assert left_pad([[5, 6, 7]], pad_id=1, length=2)[0].tolist() == [[5, 6, 7]]  # never shorter than the longest
    ids, mask = right_pad([[5, 6]], pad_id=0, length=3)
    assert (ids.tolist(), mask.tolist()) == ([[5, 6, 0]], [[1, 1, 0]])


def test_parity_plan_fits_the_context() -> None:
    single, padded, steps = parity_plan(max_context=256, max_batch=8, tokens=64)
    assert single == [12] and padded == [12, 8, 5] and steps == 64
    single, padded, steps = parity_plan(max_context=20, max_batch=2, tokens=64)
    assert single == [5] and len(padded) == 2 and steps == 15 and max(padded) + steps <= 20
    single, padded, steps = parity_plan(max_context=256, max_batch=1, tokens=64)
    assert single == [12] and padded == [8] and steps == 64  # batch 1: a shorter prompt, padded to 12 by run_parity
    assert parity_plan(max_context=8, max_batch=1, tokens=4) == ([2], [1], 4)
