"""TensorRT optimization profiles derived from an export's manifest (no TensorRT needed)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kiln.errors import ArtifactError, ConfigError
from kiln.exporter.artifacts.manifest import Limits
from kiln.exporter.contract.io import DECODER_KINDS, GraphKind, graph_io
from kiln.exporter.engine.options import GIB, MIB, BuildOptions, GraphSet, HardwareCompat, parse_size
from kiln.exporter.engine.profiles import ENGINE_GRAPHS, dim_ranges, engine_profile, engine_profiles
from kiln.plugins.native import spec_of
from kiln_testing import tiny_config, typed_manifest, with_std_target

TABLES = ((48, 32), (48, 32))  # (rows, d_model) of each PLE sub-layer's tables for --ple-tables input


def manifest(
    max_batch: int = 8, max_context: int = 48, last: bool = False, tables: tuple[tuple[int, int], ...] = ()
) -> dict[str, Any]:
    """The parts of manifest.json the engine stage reads, built as manifest.build builds them."""
    spec = spec_of(tiny_config())
    graphs = {}
    for kind in DECODER_KINDS:
        io = graph_io(spec, kind, last_logits_only=last, ple_tables=tables)
        graphs[kind.value] = {
            "file": f"onnx/{kind.value}.onnx",
            "inputs": [t.to_dict() for t in io.inputs],
            "outputs": [t.to_dict() for t in io.outputs],
        }
    return {"manifest_version": 2, "limits": {"max_batch": max_batch, "max_context": max_context}, "graphs": graphs}


def shapes(
    m: dict[str, Any], kind: GraphKind, options: BuildOptions | None = None
) -> dict[str, tuple[tuple[int, ...], ...]]:
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
    assert list(shapes(m, GraphKind.PREFILL)) == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "ple.0.scale",
        "ple.0.shift",
        "ple.1.scale",
        "ple.1.shift",
    ]


def test_logits_last_changes_no_input() -> None:
    for kind in ENGINE_GRAPHS:
        assert shapes(manifest(last=True), kind) == shapes(manifest(), kind)


@pytest.mark.parametrize(
    ("max_batch", "max_context", "last", "tables", "opt_batch", "opt_context"),
    list(itertools.product([1, 8], [2, 48], [False, True], [(), TABLES], [None, 1], [None, 2])),
)
def test_every_export_option(
    max_batch: int,
    max_context: int,
    last: bool,
    tables: tuple[tuple[int, int], ...],
    opt_batch: int | None,
    opt_context: int | None,
) -> None:
    """Every manifest input is in its profile, min <= opt <= max, and the dims obey the contract."""
    m = manifest(max_batch, max_context, last, tables)
    options = BuildOptions(opt_batch=opt_batch, opt_context=opt_context)
    for profile in engine_profiles(typed_manifest(m), options):
        specs = m["graphs"][profile.kind.value]["inputs"]
        assert [s.name for s in profile.inputs] == [s["name"] for s in specs]
        assert (
            profile.onnx == f"onnx/{profile.kind.value}.onnx" and profile.engine == f"engines/{profile.kind.value}.plan"
        )
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
        engine_profile(
            typed_manifest({"limits": {"max_batch": 1, "max_context": 8}, "graphs": {}}),
            GraphKind.PREFILL,
            BuildOptions(),
        )
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
    assert (
        HardwareCompat("ampere+") is HardwareCompat.AMPERE_PLUS and HardwareCompat("same-cc") is HardwareCompat.SAME_CC
    )


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4G", 4 * GIB), ("512M", 512 * MIB), ("1.5G", 1536 * MIB), ("2048", 2048), ("8GiB", 8 * GIB), ("64k", 64 * 1024)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


def test_parse_size_refuses_garbage() -> None:
    with pytest.raises(ConfigError, match="--workspace: expected a size such as 4G"):
        parse_size("lots")


# --- the --target onnx graphs (the static-cache contract, exporter/contract/static_cache.py) ------


def std_manifest(max_batch: int = 8, max_context: int = 48) -> dict[str, Any]:
    """A manifest with ``targets.onnx``, its graphs' I/O recorded as the export records it (``static_io``)."""
    return with_std_target(manifest(max_batch, max_context))


def std_shapes(
    m: dict[str, Any], kind: GraphKind, options: BuildOptions | None = None
) -> dict[str, tuple[tuple[int, ...], ...]]:
    profile = engine_profile(typed_manifest(m), kind, options or BuildOptions(), GraphSet.ONNX)
    assert (profile.onnx, profile.engine) == (f"onnx/{kind.value}.std.onnx", f"engines/{kind.value}.std.plan")
    return {s.name: (s.min, s.opt, s.max) for s in profile.inputs}


def test_std_prefill_profile() -> None:
    """Prefill takes the zeroed buffers too: max_context fixed, batch ranged; its ids as the portable prefill's."""
    got = std_shapes(std_manifest(), GraphKind.PREFILL)
    assert list(got) == ["input_ids", "attention_mask", "position_ids", *KV]
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert got[name] == shapes(manifest(), GraphKind.PREFILL)[name] == ((1, 1), (1, 24), (8, 48))
    for name in KV:  # [batch, n_kv_heads, max_context, head_dim]: only the batch moves
        assert got[name] == ((1, 2, 48, 8), (1, 2, 48, 8), (8, 2, 48, 8))


def test_std_decode_profile() -> None:
    got = std_shapes(std_manifest(), GraphKind.DECODE, BuildOptions(opt_batch=4, opt_context=40))
    assert list(got) == ["input_ids", "attention_mask", "position_ids", "write_indices", *KV]
    assert got["input_ids"] == got["position_ids"] == ((1, 1), (4, 1), (8, 1))
    assert got["attention_mask"] == ((1, 2), (4, 40), (8, 48))  # [batch, total_seq], up to max_context
    assert got["write_indices"] == ((1,), (4,), (8,))  # [batch]
    for name in KV:
        assert got[name] == ((1, 2, 48, 8), (4, 2, 48, 8), (8, 2, 48, 8))


@pytest.mark.parametrize(("max_batch", "max_context"), [(1, 2), (8, 48), (3, 64)])
def test_std_cache_dims_are_static(max_batch: int, max_context: int) -> None:
    for kind in ENGINE_GRAPHS:
        for name, (lo, mid, hi) in std_shapes(std_manifest(max_batch, max_context), kind).items():
            if name.startswith("past_key_values."):
                assert lo[1:] == mid[1:] == hi[1:] == (2, max_context, 8) and (lo[0], hi[0]) == (1, max_batch)


def test_std_profiles_need_the_target_and_the_contract() -> None:
    with pytest.raises(
        ArtifactError, match=r"no targets.onnx.graphs.prefill with its inputs; re-export with --target onnx"
    ):
        engine_profile(typed_manifest(manifest()), GraphKind.PREFILL, BuildOptions(), GraphSet.ONNX)
    m = std_manifest()
    m["targets"]["onnx"]["graphs"]["decode"]["inputs"][5]["shape"] = [
        "batch",
        2,
        "total_seq",
        8,
    ]  # a grown cache: not this contract
    with pytest.raises(
        ArtifactError,
        match=r"cache input past_key_values.0.value is \['batch', 2, 'total_seq', 8\], expected \[batch, n_kv_heads, "
        r"48, head_dim\]",
    ):
        engine_profile(typed_manifest(m), GraphKind.DECODE, BuildOptions(), GraphSet.ONNX)
    with pytest.raises(ValueError, match="not auto"):
        engine_profile(typed_manifest(m), GraphKind.DECODE, BuildOptions(), GraphSet.AUTO)
    assert [p.engine for p in engine_profiles(typed_manifest(m), BuildOptions())] == [
        "engines/prefill.plan",
        "engines/decode.plan",
    ]  # the default: portable


def test_graphs_option() -> None:
    assert BuildOptions().graphs is GraphSet.AUTO and BuildOptions().to_dict()["graphs"] == "auto"
    with pytest.raises(ConfigError, match="--graphs must be one of auto, portable, onnx"):
        BuildOptions(graphs="onnx")  # type: ignore[arg-type]
