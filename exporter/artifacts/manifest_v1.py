"""Reading a version-1 manifest as version 2 (what ``manifest.read`` does with one).

Version 1 named what the passes did in fixed fields: a graph's ``int8_nodes``, ``int4_nodes``,
``fp8_nodes``, ``fp32_nodes``, ``fp32_ple_tables``; an ``--target ort`` graph's
``fused_attention_layers``, ``compact_decode_mask``, ``fused_rms_norms``, ... and the target's
``int8``/``int4`` MatMulNBits formats. Version 2 records each pass's report under its name
(``passes.reports``) and gives every target its own ``kv_cache`` contract and ``record``. The
upgrade moves each v1 field to the report it became, so ``kiln verify``, ``check``, ``generate``
and ``bench`` read a v1 export unchanged (its files and hashes are untouched).
"""

from __future__ import annotations

from typing import Any

from kiln.errors import ArtifactError

__all__ = ["upgrade_v1"]

# v1 portable-graph field -> (v2 report, its key)
_GRAPH_FIELDS = {
    "int8_nodes": ("int8", "nodes"),
    "int4_nodes": ("int4", "nodes"),
    "fp8_nodes": ("fp8", "nodes"),
    "fp32_nodes": ("fp16", "fp32_nodes"),
    "fp32_ple_tables": ("fp16", "fp32_ple_tables"),
}
# v1 ORT-graph field -> (v2 report, its key)
_ORT_FIELDS = {
    "fused_attention_layers": ("attention", "layers"),
    "compact_decode_mask": ("decode_mask", "compact"),
    "local_window_layers": ("decode_mask", "local_window_layers"),
    "fused_rms_norms": ("rms_norm", "fused"),
    "fused_skip_norms": ("skip_rms_norm", "fused"),
    "packed_matmuls": ("pack", "matmuls"),
    "int8_nodes": ("nbits_int8", "nodes"),
    "int4_nodes": ("nbits_int4", "nodes"),
    "moe_layers": ("moe", "layers"),
    "moe_not_fused": ("moe", "not_fused"),
}


def _moved(graph: dict[str, Any], fields: dict[str, tuple[str, str]], where: str) -> dict[str, Any]:
    if not isinstance(graph, dict):
        raise ArtifactError(f"{where}: expected an object, found {type(graph).__name__}")
    out = {k: v for k, v in graph.items() if k not in fields}
    passes: dict[str, dict[str, Any]] = {}
    for field, (report, key) in fields.items():
        if field in graph:
            passes.setdefault(report, {})[key] = graph[field]
    if passes:
        out["passes"] = passes
    return out


def _ort_target(entry: dict[str, Any], n_layers: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or not isinstance(entry.get("graphs"), dict):
        raise ArtifactError(f"{where}: expected an object with graphs")
    graphs = {}
    for kind, graph in entry["graphs"].items():
        graphs[kind] = moved = _moved(graph, _ORT_FIELDS, f"{where}.graphs.{kind}")
        if kind == "model":  # v1 wrote placeholders there for rewrites that never run on it
            for report in ("attention", "decode_mask"):
                moved.get("passes", {}).pop(report, None)
    decode = entry["graphs"].get("decode", {})
    fused = decode.get("fused_attention_layers", []) if isinstance(decode, dict) else []
    shared = isinstance(n_layers, int) and isinstance(fused, list) and sorted(fused) == list(range(n_layers))
    record = {name: entry[name] for name in ("int8", "int4") if entry.get(name) is not None}
    out = {
        "precision": entry.get("precision"),
        "kv_cache": "shared" if shared else "grown",
        "graphs": graphs,
        "weights": entry.get("weights"),
    }
    return out | ({"record": record} if record else {})


def _version_2_field(data: dict[str, Any]) -> str | None:
    """The first field of ``data`` that only version 2 has (a graph's ``passes``, a target other
    than ``ort``, a target's ``kv_cache`` or ``record``), or None."""
    graphs = data.get("graphs")
    for kind, graph in graphs.items() if isinstance(graphs, dict) else ():
        if isinstance(graph, dict) and "passes" in graph:
            return f"graphs.{kind}.passes"
    targets = data.get("targets")
    for name, entry in targets.items() if isinstance(targets, dict) else ():
        if name != "ort":
            return f"targets.{name}"
        found = [key for key in ("kv_cache", "record") if isinstance(entry, dict) and key in entry]
        if found:
            return f"targets.{name}.{found[0]}"
    return None


def upgrade_v1(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` (a parsed version-1 manifest) in version 2's layout; refused when it holds what
    only version 2 writes (a version 2 manifest relabelled 1 would be upgraded into nonsense: its
    ``--target onnx`` graphs run as a grown cache)."""
    field = _version_2_field(data)
    if field is not None:
        raise ArtifactError(
            f"{where}: manifest_version is 1, but {field} is a version 2 field (its data is version 2's);"
            " the manifest is damaged or was edited: re-export"
        )
    out = dict(data, manifest_version=2)
    graphs = data.get("graphs")
    if isinstance(graphs, dict):
        out["graphs"] = {kind: _moved(g, _GRAPH_FIELDS, f"{where}: graphs.{kind}") for kind, g in graphs.items()}
    targets = data.get("targets")
    if isinstance(targets, dict):
        n_layers = data.get("model", {}).get("n_layers") if isinstance(data.get("model"), dict) else None
        out["targets"] = {name: _ort_target(t, n_layers, f"{where}: targets.{name}") for name, t in targets.items()}
    return out
