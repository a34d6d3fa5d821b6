"""Directories of ONNX decoder graphs that ``kiln bench`` can time: kiln's own exports and other
tools' (Optimum's ``model.onnx``, ONNX Runtime GenAI's builder output with ``genai_config.json``).

Each becomes a :class:`DecoderDir`: which file serves prefill, which serves a decode step, how
its inputs are named (GenAI's config says), and whether past and present share one KV buffer.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from kiln.errors import BenchError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.contract.io import CacheUpdate, GraphKind, kv_pairs
from kiln.exporter.external_data import plain_name
from kiln.inputs import check_input
from kiln.jsonfile import read_json_object

__all__ = ["DecoderDir", "open_decoder_dir", "open_decoder_dirs", "shares_kv_buffer"]

GRAPH_MAX_BYTES = 1 << 31  # protobuf's limit: an ONNX graph file is at most 2 GiB (larger weights are external data)


@dataclasses.dataclass(frozen=True)
class DecoderDir:
    path: Path
    tool: str  # "kiln", "genai" (ONNX Runtime GenAI builder) or "onnx" (HF-style names: Optimum, ...)
    prefill: Path  # graph timed on the prompt
    decode: Path  # graph timed on one new token with a past (may be the same file)
    roles: dict[str, str]  # input name -> input_ids / attention_mask / position_ids, where names differ
    shared_kv_buffer: bool  # past and present are one buffer of fixed capacity (GenAI past_present_share_buffer)
    present_to_past: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # shared buffer: output -> the input it aliases
    manifest: Manifest | None = None  # kiln exports only
    named_dims: tuple[tuple[str, int], ...] = ()  # symbolic dims with a known size (see graph_feeds.Sizes.named)
    target: str | None = None  # kiln exports: "ort" for the --target ort graphs, None for the portable ones
    adapter: Path | None = None  # kiln exports with --lora-slots: an adapter file of kiln adapter, bound to every run

    @property
    def label(self) -> str:
        if self.adapter is not None:
            return f"{dataclasses.replace(self, adapter=None).label} + {self.adapter.name}"
        if self.manifest is not None and self.target is not None:
            return f"kiln {self.target} {(self.manifest.targets or {})[self.target].precision} ({self.path.name})"
        if self.manifest is not None:
            return f"kiln {self.manifest.precision} ({self.path.name})"
        return f"{self.tool} ({self.path.name})"


def open_decoder_dirs(path: Path) -> list[DecoderDir]:
    """``open_decoder_dir``, plus, for a kiln export with ``--target ort`` graphs, those graphs
    as a second entry (they are timed beside the portable ones of the same directory)."""
    first = open_decoder_dir(path)
    if first.manifest is None:
        return [first]
    targets = first.manifest.targets or {}
    extra = []
    for name, t in sorted(targets.items()):
        # a decode graph that writes its KV in place when past and present are one buffer is
        # timed that way, as a serving loop (kiln generate --target ort) runs it
        shared = shares_kv_buffer(first.manifest, name)
        aliases = {present: past for past, present in kv_pairs(first.manifest.model.n_layers)} if shared else {}
        decode, prefill = path / t.graphs["decode"].file, path / t.graphs["prefill"].file
        extra.append(
            dataclasses.replace(
                first, prefill=prefill, decode=decode, target=name, shared_kv_buffer=shared, present_to_past=aliases
            )
        )
    return [first, *extra]


def open_decoder_dir(path: Path) -> DecoderDir:
    """Recognise a directory by what it holds: manifest.json (kiln; verified first),
    genai_config.json (GenAI builder), or model.onnx with Hugging Face-style names. Each is known
    by its name (``exists``, not ``is_file``): one that is a FIFO or a device is refused by what it
    is, not passed over for the next kind, nor opened by ONNX Runtime (an open that never returns)."""
    if not path.is_dir():
        raise BenchError(f"{path}: not a directory")
    if os.path.lexists(path / "manifest.json"):  # a link too: the manifest's reader refuses one by name
        from kiln.exporter.artifacts.verify import require_verified

        manifest = require_verified(path)
        prefill, decode = (path / manifest.graph(kind).file for kind in (GraphKind.PREFILL, GraphKind.DECODE))
        return DecoderDir(path, "kiln", prefill, decode, {}, False, manifest=manifest)
    if (path / "genai_config.json").exists():
        return _genai_dir(path)
    graphs = sorted(path.glob("*.onnx"))
    graph = path / "model.onnx" if (path / "model.onnx").exists() else (graphs[0] if len(graphs) == 1 else None)
    if graph is not None:  # Optimum: model.onnx; its ORTQuantizer: model_quantized.onnx
        return DecoderDir(path, "onnx", _graph_file(graph), graph, {}, False)
    if len(graphs) > 1:
        raise BenchError(
            f"{path}: several .onnx files and no model.onnx ({', '.join(g.name for g in graphs)}); which one is "
            "the decoder?"
        )
    raise BenchError(
        f"{path}: no manifest.json, genai_config.json or model.onnx; expected a kiln export directory "
        "or an ONNX decoder directory (Optimum, ONNX Runtime GenAI builder)"
    )


_MAX_LAYERS = 4096  # the manifest schema's bound on n_layers: a config past it is not a decoder kiln can time


def _genai_dir(path: Path) -> DecoderDir:
    """A GenAI builder directory, every field of its config that bench uses checked first: a wrong type is
    one ``BenchError`` naming the field (not a TypeError), the graph a plain file in ``path`` (a
    ``filename`` of ``../../other/model.onnx`` timed a graph elsewhere), the layer count bounded."""
    where = f"{path}/genai_config.json"
    config = read_json_object(path / "genai_config.json", BenchError, f"{path}: unreadable genai_config.json")
    model = _field(config, "model", dict, where)
    decoder = _field(model, "decoder", dict, where, "model.")
    filename = _field(decoder, "filename", str, where, "model.decoder.")
    if not plain_name(filename):
        raise BenchError(f"{where}: model.decoder.filename {filename!r} is not a file name in {path}")
    graph = path / filename
    if not graph.exists():
        raise BenchError(f"{where} names {filename}, which does not exist")
    _graph_file(graph)
    names = _strings(decoder.get("inputs", {}), where, "model.decoder.inputs")
    roles: dict[str, str] = {names[r]: r for r in ("input_ids", "attention_mask", "position_ids") if r in names}
    search = _field(config, "search", dict, where) if "search" in config else {}
    shared = search.get("past_present_share_buffer", False) is True
    pairs = _shared_pairs(decoder, names, where) if shared else {}
    named = (("kv_cache_dim", _count(decoder, "head_size", where, 65536)),) if "head_size" in decoder else ()
    return DecoderDir(path, "genai", graph, graph, roles, shared, present_to_past=pairs, named_dims=named)


def _graph_file(graph: Path) -> Path:
    """``graph``, once ``inputs.check_input`` has found it a regular file ONNX Runtime may open by
    name (another tool's directory is not verified as a kiln export is)."""
    check_input(graph, BenchError, GRAPH_MAX_BYTES, what="an ONNX graph file")
    return graph


def _field(data: dict[str, Any], key: str, kind: type, where: str, prefix: str = "") -> Any:
    value = data.get(key)
    if not isinstance(value, kind):
        raise BenchError(
            f"{where}: {prefix}{key} must be {'an object' if kind is dict else 'a string'}, found {_shown(value)}"
        )
    return value


def _strings(value: object, where: str, name: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise BenchError(f"{where}: {name} must map names to strings, found {_shown(value)}")
    return value


def _count(decoder: dict[str, Any], key: str, where: str, most: int) -> int:
    value = decoder.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
        raise BenchError(f"{where}: model.decoder.{key} must be an integer from 1 to {most}, found {_shown(value)}")
    return value


def _shared_pairs(decoder: dict[str, Any], names: dict[str, str], where: str) -> dict[str, str]:
    """The present output -> past input names of a shared KV buffer, layer by layer (``%d`` patterns)."""
    outputs = _strings(decoder.get("outputs", {}), where, "model.decoder.outputs")
    pairs: dict[str, str] = {}
    for layer in range(_count(decoder, "num_hidden_layers", where, _MAX_LAYERS)):
        for kind in ("key", "value"):
            present, past = outputs.get(f"present_{kind}_names"), names.get(f"past_{kind}_names")
            if present and past:
                try:
                    pairs[present % layer] = past % layer
                except (TypeError, ValueError):
                    raise BenchError(f"{where}: {present!r} and {past!r} are not name patterns with one %d") from None
    return pairs


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shares_kv_buffer(manifest: Manifest, target: str) -> bool:
    """True when the export's ``target`` graphs carry the cache in one buffer that past and
    present are both bound to, written in place (its ``kv_cache`` contract: ``CacheUpdate``
    shared, or static: the graphs' own static buffers)."""
    entry = (manifest.targets or {}).get(target)
    return entry is not None and entry.kv_cache in (CacheUpdate.SHARED.value, CacheUpdate.STATIC.value)
