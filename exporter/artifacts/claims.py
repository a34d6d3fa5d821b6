"""The manifest's claims against what its graphs are (``facts``): ``kiln verify``'s last check.

Every field that changes how an export is run or judged is compared with the graphs' facts, and
a disagreement is one line naming the field, the manifest's value and what the graphs say:
``precision`` and ``targets.<name>.precision`` (the tolerances ``kiln check`` judges by; of the set,
then of each of its graphs), ``kv_cache.dtype``, ``targets.<name>.kv_cache`` (the loop ``kiln generate``
and ``bench`` run, and the ones its target writes at all), ``limits.max_context`` (a static cache's
capacity, the rows of the tables indexed by position), ``export.logits`` and ``export.ple.tables``. The fields no graph
states are checked for what they must be: ``export.ple.extend_mode`` and ``parity.agreement`` one
of their values, ``tokenizer`` a tokenizer's JSON that no other field names.

Only a directory whose files ``structure`` passed is compared (its graph files inside it, their I/O
as recorded), so every problem here is a claim the graphs contradict, not a missing file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.errors import ConfigError
from kiln.exporter.artifacts.facts import SetFacts, facts_of, graph_precision
from kiln.exporter.artifacts.manifest import Manifest, TargetWeights, WeightsInfo
from kiln.exporter.artifacts.structure import named_paths
from kiln.exporter.contract.io import CacheUpdate
from kiln.exporter.options import PLEExtendMode, Precision
from kiln.exporter.targets import PORTABLE, names, target

__all__ = ["claim_problems"]

_KV_LAYOUT = ("BNSH", ("batch", "n_kv_heads", "seq", "head_dim"))  # every graph's cache tensors (contract.io)
_TENSORS_LAYOUT = (
    "BNSH",
    ("batch", "heads", "seq", "width"),
)  # a cache of its own tensors (kv_cache.tensors: each its heads and width)
_GRAPH_KINDS = frozenset({"fp16", "int8", "int4", "fp8"})  # what facts._quantized and the float type find
_TOKENIZER_BYTES = 1 << 28  # no tokenizer.json comes near (the largest of the Hub's, Gemma 3's, is 33 MB)
_WHY = {
    "precision": "their QuantizeLinear, DequantizeLinear and MatMulNBits, and their float type",
    "kv_dtype": "the dtype of their past and present tensors",
    "kv_cache": "their decode step's cache inputs and attention",
    "logits": "the positions of their prefill logits",
    "ple_tables": "their ple.{i}.scale/.shift inputs, or none",
    "capacity": "the slots of their static KV cache",
    "positions": "the rows of the tables they index by position",
}


def claim_problems(directory: Path, manifest: Manifest) -> list[str]:
    """Every way the manifest's claims and its graphs disagree (empty: none); a graph file that is
    missing or a link is reported by ``verify``, and nothing is compared then."""
    if missing := [
        kind for kind in ("prefill", "decode", "model") if kind not in manifest.graphs
    ]:  # as the schema requires
        return [f"graphs lacks {', '.join(missing)}; every export has a prefill, a decode and a unified graph"]
    sets = {PORTABLE: {kind: Path(entry.file) for kind, entry in manifest.graphs.items()}}
    for name, entry in (manifest.targets or {}).items():
        sets[name] = {kind: Path(graph.file) for kind, graph in entry.graphs.items()}
    paths = [directory / file for files in sets.values() for file in files.values()]
    if not all(path.is_file() and not path.is_symlink() for path in paths):
        return []
    facts = facts_of(sets, directory)
    found: dict[str, str] = {}  # by field: one all sets state (export.logits) is named once, by the first set it fails
    for name, each in facts.items():
        for field, problem in _set_problems(manifest, name, each):
            found.setdefault(field, problem)
    context = _context_problem(manifest.limits.max_context, facts)
    recorded = [*_opset_problems(manifest, facts[PORTABLE]), *_weights_problems(directory, manifest)]
    return [
        *found.values(),
        *context,
        *recorded,
        *_choice_problems(manifest),
        *_tokenizer_problems(directory, manifest),
    ]


def _opset_problems(manifest: Manifest, portable: SetFacts) -> list[str]:
    """``export.opset``: the portable graphs' opset is the one asked for, or the precision's minimum
    (int4's DequantizeLinear blocks need 21)."""
    try:
        expected = Precision.parse(manifest.precision).graph_opset(manifest.export.opset)
    except (ConfigError, ValueError, TypeError):  # a precision or opset out of range: the checks above name it
        return []
    found = {g.opset for g in portable.graphs.values()}
    if found != {expected}:
        return [
            f"export.opset is {manifest.export.opset!r}, but the portable graphs are of opset "
            f"{', '.join(map(str, sorted(found)))}"
        ]
    return []


def _weights_problems(directory: Path, manifest: Manifest) -> list[str]:
    """``weights.bytes`` (and each target's) is its file's size, as the export wrote it."""
    entries: list[tuple[str, WeightsInfo | TargetWeights]] = [("weights", manifest.weights)]
    entries += [(f"targets.{n}.weights", t.weights) for n, t in (manifest.targets or {}).items()]
    problems = []
    for field, entry in entries:
        path = directory / entry.file
        size = path.stat().st_size if path.is_file() and not path.is_symlink() else None
        if size is not None and entry.bytes != size:
            problems.append(f"{field}.bytes is {entry.bytes!r}, but {entry.file} holds {size} bytes")
    return problems


def _label(name: str) -> str:
    return "the portable graphs" if name == PORTABLE else f"the --target {name} graphs"


def _said(field: str, value: Any, name: str, fact: Any, why: str, bound: str = "") -> tuple[str, str]:
    return field, f"{field} is {value!r}, but {_label(name)} say {bound}{fact!r} ({why})"


def _set_problems(manifest: Manifest, name: str, facts: SetFacts) -> list[tuple[str, str]]:
    """One graph set's facts against the manifest's fields for it and the export's shared ones,
    as ``(field, problem)``."""
    entry = (manifest.targets or {}).get(name) if name != PORTABLE else None
    problems = []
    field, precision = ("precision", manifest.precision)
    if entry is not None:
        field, precision = f"targets.{name}.precision", entry.precision
    if not _known(precision):
        problems.append((field, f"{field} is {precision!r}, not a precision this kiln knows"))
    elif _visible(precision) != _visible(facts.precision):
        problems.append(_said(field, precision, name, facts.precision, _WHY["precision"]))
    else:
        problems += _graph_precision_problem(field, precision, name, facts)
    if entry is None and facts.kv_dtype is not None and manifest.kv_cache.dtype != facts.kv_dtype:
        problems.append(_said("kv_cache.dtype", manifest.kv_cache.dtype, name, facts.kv_dtype, _WHY["kv_dtype"]))
    if entry is not None and facts.kv_cache is not None and entry.kv_cache != facts.kv_cache:
        problems.append(_said(f"targets.{name}.kv_cache", entry.kv_cache, name, facts.kv_cache, _WHY["kv_cache"]))
    problems += _cache_kind_problems(manifest, name, facts)
    if facts.logits is not None and manifest.export.logits != facts.logits:
        problems.append(_said("export.logits", manifest.export.logits, name, facts.logits, _WHY["logits"]))
    ple = manifest.export.ple
    if ple is not None and ple.tables != facts.ple_tables:
        problems.append(_said("export.ple.tables", ple.tables, name, facts.ple_tables, _WHY["ple_tables"]))
    return problems


def _graph_precision_problem(field: str, precision: str, name: str, facts: SetFacts) -> list[tuple[str, str]]:
    """The set's precision graph by graph, the first graph that disagrees (their union of kinds can
    hide a graph of another precision among the right ones): a graph with a cache shows every kind
    the claim leaves a trace of and no other; one without (an encoder: no cache to show fp16, maybe
    no MatMul quantized) shows no other."""
    claimed = _visible(precision)
    for graph in facts.graphs.values():
        shown = _visible(graph_precision(graph))
        if shown != claimed and (graph.kv_dtypes or not shown <= claimed):
            said = f"{graph.file}, of {_label(name)}, says {graph_precision(graph)!r}"
            why = "its QuantizeLinear, DequantizeLinear and MatMulNBits, and its float type"
            return [(field, f"{field} is {precision!r}, but {said} ({why})")]
    return []


def _known(precision: str) -> bool:
    try:
        Precision.parse(precision)
    except (ConfigError, ValueError, TypeError):
        return False
    return True


def _visible(precision: str) -> frozenset[str]:
    """The kinds of a precision name that leave a trace in graphs (their nodes or float type): a kind
    registered without one (the precision seam's toy) is neither claimed nor contradicted by them."""
    return frozenset(part for part in precision.split("+") if part in _GRAPH_KINDS)


def _cache_kind_problems(manifest: Manifest, name: str, facts: SetFacts) -> list[tuple[str, str]]:
    """A graph set whose cache is one its writer never writes (its graphs are another's): the
    portable graphs grow theirs, a target writes the kinds it declares (``Target.kv_caches``)."""
    allowed: tuple[str, ...]
    if name == PORTABLE:
        field, allowed = "graphs", (CacheUpdate.GROWN.value,)
        claim = "graphs: the portable graphs always grow their cache ('grown')"
    else:
        field = f"targets.{name}.kv_cache"
        try:
            allowed = tuple(kind.value for kind in target(name).kv_caches)
        except ConfigError:
            return [(f"targets.{name}", f"targets.{name}: not a target kiln writes ({', '.join(names())})")]
        value = (manifest.targets or {})[name].kv_cache
        claim = f"{field} is {value!r}, but --target {name} writes only {' or '.join(map(repr, allowed))} caches"
    if facts.kv_cache is None or facts.kv_cache in allowed:
        return []
    problem = f"{claim}, and {_label(name)} ({facts.files}) say {facts.kv_cache!r}: they are another target's graphs"
    return [(f"{field} (its writer)", problem)]


def _context_problem(max_context: int, facts: dict[str, SetFacts]) -> list[str]:
    """``limits.max_context`` against a static cache's capacity (every step writes inside it),
    then against the rows of the tables a position indexes (a position past them is out of bounds)."""
    for name, each in facts.items():
        if each.capacity is not None and max_context != each.capacity:
            return [_said("limits.max_context", max_context, name, each.capacity, _WHY["capacity"])[1]]
    for name, each in facts.items():
        if each.positions is not None and max_context > each.positions:
            return [_said("limits.max_context", max_context, name, each.positions, _WHY["positions"], "at most ")[1]]
    return []


def _choice_problems(manifest: Manifest) -> list[str]:
    """The fields no graph states, among the values they may have."""
    problems = []
    ple = manifest.export.ple
    modes = [m.value for m in PLEExtendMode]
    if ple is not None and ple.extend_mode is not None and ple.extend_mode not in modes:
        choices = f"{', '.join(modes)} (or null: the trained table)"
        problems.append(f"export.ple.extend_mode is {ple.extend_mode!r}, not one of {choices}")
    layout = _KV_LAYOUT if manifest.kv_cache.tensors is None else _TENSORS_LAYOUT
    if (manifest.kv_cache.layout, tuple(manifest.kv_cache.dims)) != layout:  # what a host allocates by
        problems.append(
            f"kv_cache.layout and .dims are {manifest.kv_cache.layout!r} {list(manifest.kv_cache.dims)!r}, not "
            f"the graphs' {layout[0]} {list(layout[1])}"
        )
    if not manifest.checkpoint.files:  # kiln check matches the checkpoint it loads against these hashes
        problems.append("checkpoint.files is empty; an export records the hash of every checkpoint file it read")
    for name, digest in manifest.checkpoint.files.items():
        if not (isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest)):
            problems.append(f"checkpoint.files[{name!r}] is {digest!r}, not a sha256 digest")
    if manifest.checkpoint.dtype not in ("float32", "bfloat16", "float16"):
        problems.append(f"checkpoint.dtype is {manifest.checkpoint.dtype!r}, not one of float32, bfloat16, float16")
    if manifest.parity.agreement not in (None, "gate", "record"):
        problems.append(f"parity.agreement is {manifest.parity.agreement!r}, not one of gate, record (or absent)")
    return problems


def _tokenizer_problems(directory: Path, manifest: Manifest) -> list[str]:
    """The tokenizer must be a tokenizers JSON (``tokenizer.json``: an object with its ``model`` and
    ``added_tokens``), not a file another field names (a weights file, a graph)."""
    rel = manifest.tokenizer
    if rel is None:
        return []
    others = {path: where for where, path in named_paths(manifest).items() if where != "tokenizer"}
    if rel in others:
        return [f"tokenizer is {rel!r}, which {others[rel]} names: a tokenizer.json is expected"]
    path = directory / rel
    if not path.is_file() or path.is_symlink():
        return []  # verify reports it missing (or a link)
    if PurePosixPath(rel).suffix != ".json" or path.stat().st_size > _TOKENIZER_BYTES:
        return [f"tokenizer is {rel!r}, not a tokenizer.json (a JSON file of at most {_TOKENIZER_BYTES >> 20} MiB)"]
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, OSError):
        data = None
    shaped = isinstance(data, dict) and isinstance(data.get("model"), dict)
    if not shaped or not isinstance(data.get("added_tokens"), list):
        return [f"tokenizer is {rel!r}, not a tokenizer.json (a JSON object with its model and added_tokens)"]
    return []
