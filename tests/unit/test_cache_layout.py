"""The cache layout of the I/O contract (``plugins/cache_layout.py``, issue 43): the default one,
derived from ``n_kv_heads``/``head_dim``, gives every family the graph I/O it always had; a latent
layout (multi-head latent attention) gives each cache tensor its own heads and width in the graph
I/O, the carried pairs and the empty past."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.exporter.contract.io import GraphKind, carried_cache, graph_io, kv_pairs
from kiln.exporter.contract.steps import empty_past
from kiln.plugins.base import DecoderSpec
from kiln.plugins.cache_layout import CacheLayout, CacheTensor, Span

SPEC = DecoderSpec(family="t", n_layers=2, n_kv_heads=3, head_dim=8, vocab_size=11, max_context=16)
LATENT = dataclasses.replace(SPEC, cache=CacheLayout.latent(2, 32, 4))


def _caches(spec: DecoderSpec, kind: GraphKind) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]]]:
    io, cache = graph_io(spec, kind), ("past_key_values.", "present.")
    return {t.name: t.dims for t in io.inputs if t.name.startswith(cache)}, {
        t.name: t.dims for t in io.outputs if t.name.startswith(cache)
    }


def test_the_default_layout_is_keys_and_values_of_the_kv_heads() -> None:
    assert SPEC.cache_layout == CacheLayout("kv", ((CacheTensor("key", 3, 8), CacheTensor("value", 3, 8)),) * 2)
    inputs, outputs = _caches(SPEC, GraphKind.DECODE)
    assert inputs == {
        f"past_key_values.{i}.{n}": ("batch", 3, "past_seq", 8) for i in range(2) for n in ("key", "value")
    }
    assert outputs == {f"present.{i}.{n}": ("batch", 3, "total_seq", 8) for i in range(2) for n in ("key", "value")}
    assert carried_cache(SPEC) == kv_pairs(2)
    cross = dataclasses.replace(SPEC, encoder_dim=5)
    assert carried_cache(cross) == kv_pairs(2, cross=True)
    assert [t.span for t in cross.cache_layout.layers[0]] == [Span.SEQUENCE, Span.SEQUENCE, Span.ENCODER, Span.ENCODER]
    prefill_in, prefill_out = _caches(cross, GraphKind.PREFILL)
    assert (
        prefill_in == {}
        and prefill_out["present.1.cross_value"] == ("batch", 3, "encoder_seq", 8)
        and prefill_out["present.1.key"] == ("batch", 3, "seq", 8)
    )
    decode_in, decode_out = _caches(cross, GraphKind.DECODE)
    assert (
        decode_in["past_key_values.0.cross_key"] == ("batch", 3, "encoder_seq", 8)
        and "present.0.cross_key" not in decode_out
    )


def test_a_latent_layout_gives_each_tensor_its_own_width() -> None:
    inputs, outputs = _caches(LATENT, GraphKind.UNIFIED)
    assert inputs == {
        f"past_key_values.{i}.{n}": ("batch", 1, "past_seq", w)
        for i in range(2)
        for n, w in (("key", 32), ("value", 4))
    }
    assert outputs == {
        f"present.{i}.{n}": ("batch", 1, "total_seq", w) for i in range(2) for n, w in (("key", 32), ("value", 4))
    }
    assert carried_cache(LATENT) == kv_pairs(2)  # the same names: transformers caches the latent in the key slot
    assert {k: v.shape for k, v in empty_past(LATENT, 3, np.dtype(np.float16)).items()} == {
        f"past_key_values.{i}.{n}": (3, 1, 0, w) for i in range(2) for n, w in (("key", 32), ("value", 4))
    }
    assert (LATENT.cache_layout.per_token(), SPEC.cache_layout.per_token()) == (2 * (32 + 4), 2 * 2 * 3 * 8)


def test_a_layout_of_another_layer_count_is_refused() -> None:
    with pytest.raises(ValueError, match="the cache layout describes 3 layers, the decoder has 2"):
        dataclasses.replace(SPEC, cache=CacheLayout.latent(3, 32, 4))
