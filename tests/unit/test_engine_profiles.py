"""TensorRT optimization profiles derived from an export's manifest (no TensorRT needed)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from kiln_testing import tiny_config, typed_manifest

from kiln.errors import ArtifactError, ConfigError
from kiln.exporter.engine.options import GIB, MIB, BuildOptions, HardwareCompat, parse_size
from kiln.exporter.engine.profiles import ENGINE_GRAPHS, dim_ranges, engine_profile, engine_profiles
from kiln.exporter.artifacts.manifest import Limits
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind, graph_io
from kiln.plugins.native import spec_of

TABLES = ((48, 32), (48, 32))  # (rows, d_model) of each PLE sub-layer's tables for --ple-tables input


def manifest(max_batch: int = 8, max_context: int = 48, last: bool = False, tables: tuple[tuple[int, int], ...] = ()) -> dict[str, Any]:
    """The parts of manifest.json the engine stage reads, built as manifest.build builds them."""
    spec = spec_of(tiny_config())
    graphs = {}
    for kind in DECODER_KINDS:
        io = graph_io(spec, kind, last_logits_only=last, ple_tables=tables)
        graphs[kind.value] = {"file": f"onnx/{kind.value}.onnx", "inputs": [t.to_dict() for t in io.inputs], "outputs": [t.to_dict() for t in io.outputs]}
    return {"manifest_version": 2, "limits": {"max_batch": max_batch, "max_context": max_context}, "graphs": graphs}


def shapes(m: dict[str, Any], kind: GraphKind, options: BuildOptions | None = None) -> dict[str, tuple[tuple[int, ...], ...]]:
    profile = engine_profile(typed_manifest(m), kind, options or BuildOptions())
    return {s.name: (s.min, s.opt, s.max) for s in profile.inputs}


KV = ("past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value")


def test_prefill_profile_defaults() -> None:
    assert shapes(manifest(), GraphKind.PREFILL) == {
        "input_ids": ((1, 1), (1, 24), (8, 48)),
        "attention_mask": ((1, 1), (1, 24), (8, 48)),
        "position_ids": ((1, 1), (1, 24), (8, 48)),
    }


def test_decode_profile_defaults() -> None:
    got = shapes(manifest(), GraphKind.DECODE)
    assert got["input_ids"] == got["position_ids"] == ((1, 1), (1, 1), (8, 1))
    assert got["attention_mask"] == ((1, 2), (1, 24), (8, 48))  # total_seq = past_seq + 1
    for name in KV:  # [batch, n_kv, past_seq, head_dim], past_seq in [1, max_context - 1]
        assert got[name] == ((1, 2, 1, 8), (1, 2, 23, 8), (8, 2, 47, 8))
    assert list(got) == ["input_ids", "attention_mask", "position_ids", *KV]


def test_opt_point_options() -> None:
    options = BuildOptions(opt_batch=4, opt_context=40)
    prefill, decode = (shapes(manifest(), kind, options) for kind in ENGINE_GRAPHS)
    assert prefill["input_ids"] == ((1, 1), (4, 40), (8, 48))
    assert decode["attention_mask"] == ((1, 2), (4, 40), (8, 48))
    assert decode["past_key_values.0.key"] == ((1, 2, 1, 8), (4, 2, 39, 8), (8, 2, 47, 8))


@pytest.mark.parametrize(("opt_context", "prefill_opt", "past_opt"), [(1, 1, 1), (2, 2, 1), (48, 48, 47)])
def test_opt_context_edges(opt_context: int, prefill_opt: int, past_opt: int) -> None:
    options = BuildOptions(opt_context=opt_context)
    assert shapes(manifest(), GraphKind.PREFILL, options)["input_ids"][1] == (1, prefill_opt)
    decode = shapes(manifest(), GraphKind.DECODE, options)
    assert decode["past_key_values.1.value"][1] == (1, 2, past_opt, 8)
    assert decode["attention_mask"][1] == (1, past_opt + 1)


def test_smallest_limits() -> None:
    m = manifest(max_batch=1, max_context=2)
    assert shapes(m, GraphKind.PREFILL)["attention_mask"] == ((1, 1), (1, 2), (1, 2))
    decode = shapes(m, GraphKind.DECODE)
    assert decode["past_key_values.0.key"] == ((1, 2, 1, 8),) * 3
    assert decode["attention_mask"] == ((1, 2),) * 3


def test_ple_tables_as_inputs_get_their_fixed_shape() -> None:
    m = manifest(tables=TABLES)
    for kind in ENGINE_GRAPHS:
        got = shapes(m, kind)
        for name in ("ple.0.scale", "ple.0.shift", "ple.1.scale", "ple.1.shift"):
            assert got[name] == ((48, 32),) * 3
    assert list(shapes(m, GraphKind.PREFILL)) == ["input_ids", "attention_mask", "position_ids", "ple.0.scale", "ple.0.shift", "ple.1.scale", "ple.1.shift"]


def test_logits_last_changes_no_input() -> None:
    for kind in ENGINE_GRAPHS:
        assert shapes(manifest(last=True), kind) == shapes(manifest(), kind)


@pytest.mark.parametrize(
    ("max_batch", "max_context", "last", "tables", "opt_batch", "opt_context"),
    list(itertools.product([1, 8], [2, 48], [False, True], [(), TABLES], [None, 1], [None, 2])),
)
def test_every_export_option(max_batch: int, max_context: int, last: bool, tables: tuple[tuple[int, int], ...], opt_batch: int | None, opt_context: int | None) -> None:
    """Every manifest input is in its profile, min <= opt <= max, and the dims obey the contract."""
    m = manifest(max_batch, max_context, last, tables)
    options = BuildOptions(opt_batch=opt_batch, opt_context=opt_context)
    for profile in engine_profiles(typed_manifest(m), options):
        specs = m["graphs"][profile.kind.value]["inputs"]
        assert [s.name for s in profile.inputs] == [s["name"] for s in specs]
        assert profile.onnx == f"onnx/{profile.kind.value}.onnx" and profile.engine == f"engines/{profile.kind.value}.plan"
        for shape, spec in zip(profile.inputs, specs, strict=True):
            assert shape.dtype == spec["dtype"]
            assert all(lo <= mid <= hi for lo, mid, hi in zip(shape.min, shape.opt, shape.max, strict=True))
            for i, dim in enumerate(spec["shape"]):
                if isinstance(dim, int):
                    assert shape.min[i] == shape.opt[i] == shape.max[i] == dim
                elif dim == "batch":
                    assert (shape.min[i], shape.max[i]) == (1, max_batch)
                elif dim == "past_seq":
                    assert (shape.min[i], shape.max[i]) == (1, max_context - 1)
                else:  # seq (prefill) or total_seq (decode: past_seq + 1)
                    low = 2 if profile.kind is GraphKind.DECODE else 1
                    assert (shape.min[i], shape.max[i]) == (low, max_context)


def test_opt_point_beyond_limits_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--opt-batch 9 is larger than the export's max_batch 8"):
        engine_profiles(typed_manifest(manifest()), BuildOptions(opt_batch=9))
    with pytest.raises(ConfigError, match=r"--opt-context 49 is larger than the export's max_context 48"):
        engine_profiles(typed_manifest(manifest()), BuildOptions(opt_context=49))


def test_unknown_dim_and_bad_manifest_are_refused() -> None:
    m = manifest()
    m["graphs"]["decode"]["inputs"][0]["shape"] = ["batch", "beam"]
    with pytest.raises(ArtifactError, match=r"input input_ids has dim 'beam'; expected an int or one of"):
        engine_profile(typed_manifest(m), GraphKind.DECODE, BuildOptions())
    with pytest.raises(ArtifactError, match="no graphs.prefill"):
        engine_profile(typed_manifest({"limits": {"max_batch": 1, "max_context": 8}, "graphs": {}}), GraphKind.PREFILL, BuildOptions())
    with pytest.raises(ArtifactError, match=r"limits.max_context must be an integer of at least 2"):
        engine_profile(typed_manifest(manifest(max_context=1)), GraphKind.PREFILL, BuildOptions())
    with pytest.raises(ArtifactError, match="only prefill and decode"):
        dim_ranges(GraphKind.UNIFIED, Limits(max_batch=1, max_context=8), BuildOptions())


def test_build_options_validation() -> None:
    assert BuildOptions().workspace == 4 * GIB and BuildOptions().opt_level == 3
    assert BuildOptions().hardware_compat is HardwareCompat.NONE
    with pytest.raises(ConfigError, match="--opt-level must be between 0 and 5, found 6"):
        BuildOptions(opt_level=6)
    with pytest.raises(ConfigError, match="--workspace must be at least 1M"):
        BuildOptions(workspace=1000)
    with pytest.raises(ConfigError, match="--opt-batch must be at least 1, found 0"):
        BuildOptions(opt_batch=0)
    with pytest.raises(ConfigError, match="--opt-context must be at least 1, found 0"):
        BuildOptions(opt_context=0)
    assert HardwareCompat("ampere+") is HardwareCompat.AMPERE_PLUS and HardwareCompat("same-cc") is HardwareCompat.SAME_CC


@pytest.mark.parametrize(("text", "nbytes"), [("4G", 4 * GIB), ("512M", 512 * MIB), ("1.5G", 1536 * MIB), ("2048", 2048), ("8GiB", 8 * GIB), ("64k", 64 * 1024)])
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


def test_parse_size_refuses_garbage() -> None:
    with pytest.raises(ConfigError, match="--workspace: expected a size such as 4G"):
        parse_size("lots")
