"""The ``state`` cache layout (``plugins/cache_layout.py``, issue 43: Mamba2): a recurrent state of
fixed sizes per layer in the graph I/O (prefill returns it, decode and the unified graph read and
return it; no dim but batch varies), the empty past a prompt starts from (zeros of the fixed
shape), the trace's example inputs and dynamic dims, and a length given to the wrong span refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.exporter.contract.io import GraphKind, carried_cache, graph_io
from kiln.exporter.contract.steps import empty_past
from kiln.exporter.trace.torch_export import _dynamic_shapes, example_inputs
from kiln.plugins.base import DecoderSpec
from kiln.plugins.cache_layout import CacheLayout, CacheTensor, Span

KERNEL, CONV, HEADS, HEAD_DIM, SIZE = 4, 160, 8, 16, 16
STATE = DecoderSpec(
    family="t",
    n_layers=2,
    n_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    vocab_size=11,
    max_context=16,
    cache=CacheLayout.state(2, (KERNEL, CONV), (HEADS, HEAD_DIM, SIZE)),
)
SHAPES = {"conv": (1, KERNEL, CONV), "ssm": (HEADS, HEAD_DIM, SIZE)}


def _caches(kind: GraphKind) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]]]:
    io, cache = graph_io(STATE, kind), ("past_key_values.", "present.")
    return {t.name: t.dims for t in io.inputs if t.name.startswith(cache)}, {
        t.name: t.dims for t in io.outputs if t.name.startswith(cache)
    }


def test_every_graph_returns_the_state_and_only_prefill_takes_none() -> None:
    fixed = {f"{i}.{n}": ("batch", *shape) for i in range(2) for n, shape in SHAPES.items()}
    for kind in (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.UNIFIED):
        inputs, outputs = _caches(kind)
        assert outputs == {f"present.{k}": v for k, v in fixed.items()}, (kind, outputs)
        want = {} if kind is GraphKind.PREFILL else {f"past_key_values.{k}": v for k, v in fixed.items()}
        assert inputs == want, (kind, inputs)
    assert carried_cache(STATE) == [(f"past_key_values.{i}.{n}", f"present.{i}.{n}") for i in range(2) for n in SHAPES]


def test_an_empty_past_is_the_zero_state_and_nothing_grows() -> None:
    past = empty_past(STATE, 3, np.dtype(np.float16))
    assert {k: v.shape for k, v in past.items()} == {
        f"past_key_values.{i}.{n}": (3, *shape) for i in range(2) for n, shape in SHAPES.items()
    }
    assert all(v.dtype == np.float16 and not v.any() for v in past.values())
    assert STATE.cache_layout.per_token() == 0


def test_the_trace_gets_the_fixed_shapes_and_a_dynamic_batch_only() -> None:
    io = graph_io(STATE, GraphKind.UNIFIED)
    args = example_inputs(io, GraphKind.UNIFIED, STATE.vocab_size)
    cache = args[-1]
    assert isinstance(cache, list) and [tuple(t.shape[1:]) for t in cache] == [SHAPES["conv"], SHAPES["ssm"]] * 2
    dims = _dynamic_shapes(GraphKind.UNIFIED, io, max_batch=4, max_context=16)[-1]
    assert isinstance(dims, list) and [sorted(d) for d in dims] == [[0]] * 4, dims


def test_a_length_is_for_a_state_span_only() -> None:
    with pytest.raises(ValueError, match="conv: a fixed length is for a state span only"):
        CacheTensor("conv", 1, CONV, Span.STATE)
    with pytest.raises(ValueError, match="key: a fixed length is for a state span only"):
        CacheTensor("key", 1, CONV, Span.SEQUENCE, 4)
    with pytest.raises(ValueError, match="the cache layout describes 3 layers, the decoder has 2"):
        dataclasses.replace(STATE, cache=CacheLayout.state(3, (KERNEL, CONV), (HEADS, HEAD_DIM, SIZE)))


# a hybrid (GraniteMoeHybrid): layer 0 Mamba2, layer 1 attention (2 KV heads of 8), layer 2 Mamba2
HYBRID = dataclasses.replace(
    STATE,
    n_layers=3,
    n_kv_heads=2,
    head_dim=8,
    cache=CacheLayout.hybrid(["state", "kv", "state"], (2, 8), (KERNEL, CONV), (HEADS, HEAD_DIM, SIZE)),
)


def test_a_hybrid_carries_each_layers_own_tensors() -> None:
    inputs, outputs = _caches_of(HYBRID, GraphKind.DECODE)
    assert inputs == {
        **{f"past_key_values.{i}.{n}": ("batch", *s) for i in (0, 2) for n, s in SHAPES.items()},
        **{f"past_key_values.1.{n}": ("batch", 2, "past_seq", 8) for n in ("key", "value")},
    }, inputs
    assert outputs["present.1.key"] == ("batch", 2, "total_seq", 8) and outputs["present.2.ssm"] == (
        "batch",
        *SHAPES["ssm"],
    )
    assert HYBRID.cache_layout.kind == "hybrid" and HYBRID.cache_layout.per_token() == 2 * 2 * 8  # the keys grow only
    past = empty_past(HYBRID, 1, np.dtype(np.float32))
    assert past["past_key_values.1.value"].shape == (1, 2, 0, 8) and past["past_key_values.0.conv"].shape == (
        1,
        1,
        4,
        160,
    )
    io = graph_io(HYBRID, GraphKind.UNIFIED)
    dims = _dynamic_shapes(GraphKind.UNIFIED, io, max_batch=4, max_context=16)[-1]
    assert isinstance(dims, list) and [sorted(d) for d in dims] == [[0], [0], [0, 2], [0, 2], [0], [0]], dims


def _caches_of(
    spec: DecoderSpec, kind: GraphKind
) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]]]:
    io, cache = graph_io(spec, kind), ("past_key_values.", "present.")
    return {t.name: t.dims for t in io.inputs if t.name.startswith(cache)}, {
        t.name: t.dims for t in io.outputs if t.name.startswith(cache)
    }
