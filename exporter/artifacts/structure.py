"""What a manifest claims about an export's files, checked against the files themselves.

``kiln verify`` proves every file hashes as recorded; that alone does not make a directory safe
to run: a manifest edited by hand (hashes and all) can name a tokenizer outside the export, a
graph can read its weights from ``../../..``, a ``decode.onnx`` swapped for ``prefill.onnx`` hashes
fine, and a model section can claim a billion layers. ``structure_problems`` finds those:

- every path the manifest names (graphs, weights files, tokenizer, report) lies inside the
  export, without ``..``, and is one of the files it lists (hashed);
- every graph's external data is read from a listed file beside the graph, within its size;
- every graph's inputs and outputs are the ones the manifest records (a target's graphs: those
  of the portable graph of the same kind; LoRA slots after the contract's inputs), and the model's
  dims (layers, KV heads, head size, vocabulary) are the ones the graphs declare.

Links are reported by ``verify`` itself (a listed file is a regular file). Ranges that need no
graph (a limit that is not positive, a context of 10**400) are refused by ``manifest.read``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.exporter.artifacts.manifest import GraphEntry, Manifest, TensorEntry
from kiln.exporter.external_data import plain_name, tensors

__all__ = ["named_paths", "structure_problems", "inside"]

_PRESENT_KEY = re.compile(r"^present\.(\d+)\.key$")
_CACHE = re.compile(r"^(?:past_key_values|present)\.(\d+)\.(\w+)$")  # any cache tensor: its layer and name


def inside(path: str) -> bool:
    """True for a relative POSIX path that stays inside the directory it is relative to."""
    pure = PurePosixPath(path)
    return (
        bool(path)
        and "\\" not in path
        and not pure.is_absolute()
        and ".." not in pure.parts
        and pure.parts[:1] != (".",)
    )


def named_paths(manifest: Manifest) -> dict[str, str]:
    """Every file the manifest names outside ``files``, by where it names it."""
    named = {"weights.file": manifest.weights.file, "parity.report": manifest.parity.report}
    named |= {f"graphs.{kind}.file": entry.file for kind, entry in manifest.graphs.items()}
    if manifest.tokenizer is not None:
        named["tokenizer"] = manifest.tokenizer
    for name, target in (manifest.targets or {}).items():
        named[f"targets.{name}.weights.file"] = target.weights.file
        named |= {f"targets.{name}.graphs.{kind}.file": entry.file for kind, entry in target.graphs.items()}
    return named


def _path_problems(manifest: Manifest) -> list[str]:
    problems = []
    for where, path in named_paths(manifest).items():
        if not inside(path):
            problems.append(
                f"outside the export: {where} is {path!r} (a relative path inside the directory, without '..', "
                "is expected)"
            )
        elif path not in manifest.files:
            problems.append(f"unlisted: {where} names {path}, which manifest.files does not list (nor hash)")
    return problems


def structure_problems(directory: Path, manifest: Manifest) -> list[str]:
    """Every way the directory's graphs and the manifest's claims about them disagree (empty: none)."""
    problems = _path_problems(manifest)
    if problems:
        return problems  # graph files are read only from paths proved inside the export
    for entry in manifest.graphs.values():
        problems += _graph_problems(directory, manifest, entry.file, _with_lora(entry, manifest), with_dtypes=True)
    for target in (manifest.targets or {}).values():
        for kind, target_graph in target.graphs.items():
            portable = manifest.graphs.get(kind)
            if portable is None:
                problems.append(
                    f"graph {target_graph.file}: a target graph of kind {kind!r}, which the portable graphs do not have"
                )
                continue
            if (
                target_graph.inputs is not None and target_graph.outputs is not None
            ):  # a contract of its own (static cache)
                problems += _graph_problems(
                    directory,
                    manifest,
                    target_graph.file,
                    GraphEntry(target_graph.file, target_graph.inputs, target_graph.outputs),
                    with_dtypes=True,
                )
            else:
                problems += _graph_problems(
                    directory, manifest, target_graph.file, _with_lora(portable, manifest), with_dtypes=False
                )
    return problems + _dim_problems(manifest)


def _with_lora(entry: GraphEntry, manifest: Manifest) -> GraphEntry:
    """A portable graph's inputs with its LoRA slots' after them (``--lora-slots``: the manifest's
    ``lora``); a target's graphs of the portable contract (``--target ort``) keep the same slots."""
    if manifest.lora is None:
        return entry
    slots = [TensorEntry(name, manifest.lora.dtype, (d0, d1)) for name, (_, d0, d1) in manifest.lora.inputs().items()]
    return GraphEntry(entry.file, (*entry.inputs, *slots), entry.outputs, entry.passes)


def _graph_problems(directory: Path, manifest: Manifest, file: str, want: GraphEntry, with_dtypes: bool) -> list[str]:
    import onnx

    path = directory / file
    if not path.is_file() or path.is_symlink():
        return []  # verify reports it missing (or a link)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: any failure means "not a graph"
        return [f"graph {file}: not a readable ONNX model ({type(exc).__name__})"]
    problems = []
    for side, found, expected in (
        ("inputs", model.graph.input, want.inputs),
        ("outputs", model.graph.output, want.outputs),
    ):
        got, want_side = [_key(_entry(v), with_dtypes) for v in found], [_key(t, with_dtypes) for t in expected]
        if got != want_side:
            problems.append(
                f"graph {file}: its {side} are not the ones the manifest records ({_first_difference(got, want_side)})"
            )
    problem = _external_problem(directory, manifest, file, model)
    return problems + ([problem] if problem else [])


def _entry(value: Any) -> TensorEntry:
    import onnx

    tensor = value.type.tensor_type
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
    except (KeyError, TypeError, ValueError):
        dtype = f"elem_type {tensor.elem_type}"
    return TensorEntry(value.name, dtype, tuple(d.dim_param or d.dim_value for d in tensor.shape.dim))


def _key(tensor: TensorEntry, with_dtype: bool) -> tuple[Any, ...]:
    """What is compared of a graph input or output: a target's graphs may change dtypes."""
    return (tensor.name, tensor.dtype, tensor.shape) if with_dtype else (tensor.name, tensor.shape)


def _first_difference(got: list[Any], expected: list[Any]) -> str:
    for i, (g, e) in enumerate(zip(got, expected, strict=False)):
        if g != e:
            return f"#{i}: the graph has {g}, the manifest {e}"
    return f"the graph has {len(got)}, the manifest {len(expected)}"


def _external_problem(directory: Path, manifest: Manifest, file: str, model: Any) -> str | None:
    """The first external-data reference of a graph that does not read a listed file beside it,
    within its size."""
    import onnx

    folder = PurePosixPath(file).parent
    sizes: dict[str, int] = {}
    for tensor in tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        rel = (folder / location).as_posix()
        if not plain_name(location):
            return (
                f"graph {file}: tensor {tensor.name} reads external data from {location!r}, not from a file beside "
                "the graph"
            )
        if rel not in manifest.files:
            return (
                f"graph {file}: tensor {tensor.name} reads external data from {location}, which manifest.files does "
                "not list"
            )
        try:
            offset, length = int(info.get("offset", "0")), int(info.get("length", "-1"))
        except ValueError:
            return f"graph {file}: tensor {tensor.name} has a malformed external-data offset or length"
        if rel not in sizes:
            data = directory / rel
            if not data.is_file() or data.is_symlink():
                return None  # verify reports it missing (or a link)
            sizes[rel] = data.stat().st_size
        size = sizes[rel]
        if offset < 0 or offset > size or (length >= 0 and offset + length > size):
            return (
                f"graph {file}: tensor {tensor.name} reads bytes {offset}..{offset + max(length, 0)} of {location}, "
                f"which has {size}"
            )
    return None


def _dim_problems(manifest: Manifest) -> list[str]:
    """The model's numbers against the ones its graphs declare."""
    model, problems = manifest.model, _reads_problems(manifest)
    reading = {r.layer for r in manifest.kv_cache.reads or ()}  # a shared_kv cache's layers that carry none
    # a hybrid's layers without attention or state (Nemotron-H's MLP blocks) carry none either: not in kv_cache.tensors
    bare = set(range(model.n_layers)) - {t.layer for t in manifest.kv_cache.tensors or ()} - reading
    bare = bare if manifest.kv_cache.kind == "hybrid" else set()
    for kind, entry in manifest.graphs.items():
        names = [t.name for t in entry.inputs] + [t.name for t in entry.outputs]
        layers = {m.group(1) for n in names if (m := _CACHE.match(n))}
        if kind != "encoder" and len(layers) != model.n_layers - len(reading) - len(bare):
            problems.append(
                f"model.n_layers is {model.n_layers}"
                + (f" ({len(reading)} of them reading another's cache, kv_cache.reads)" if reading else "")
                + (f" ({len(bare)} of them carrying no cache, kv_cache.tensors)" if bare else "")
                + f", but graph {entry.file} carries the KV cache of {len(layers)} layers"
            )
        problems += [
            f"graph {entry.file} carries a cache for layer {i}, which kv_cache.reads says carries none"
            for i in sorted(reading & {int(n) for n in layers})
        ]
        for t in entry.outputs:
            if t.name == "logits" and t.shape and isinstance(t.shape[-1], int) and t.shape[-1] != model.vocab_size:
                problems.append(
                    f"model.vocab_size is {model.vocab_size}, but graph {entry.file} has {t.shape[-1]} logits"
                )
            if _PRESENT_KEY.match(t.name) and len(t.shape) == 4 and manifest.kv_cache.tensors is None:
                for what, value, dim in (
                    ("n_kv_heads", model.n_kv_heads, t.shape[1]),
                    ("head_dim", model.head_dim, t.shape[3]),
                ):
                    if isinstance(dim, int) and dim != value:
                        problems.append(f"model.{what} is {value}, but graph {entry.file} has {dim} in {t.name}")
        problems += _layout_problems(manifest, entry.file, [*entry.inputs, *entry.outputs])
    return sorted(set(problems))


def _layout_problems(manifest: Manifest, file: str, tensors: list[TensorEntry]) -> list[str]:
    """A cache of its own layout (``kv_cache.tensors``): every cache tensor of the graph is one it
    lists, of its heads and width."""
    if manifest.kv_cache.tensors is None:
        return []
    listed = {(t.layer, t.name): t for t in manifest.kv_cache.tensors}
    problems = []
    for t in tensors:
        named = _CACHE.match(t.name)
        if named is None or len(t.shape) != 4:
            continue
        want = listed.get((int(named.group(1)), named.group(2)))
        if want is None:
            problems.append(f"graph {file} has {t.name}, which kv_cache.tensors does not list")
        elif (t.shape[1], t.shape[3]) != (want.heads, want.width):
            problems.append(
                f"kv_cache.tensors gives {t.name} {want.heads} heads of {want.width}, but graph {file} has "
                f"{t.shape[1]} of {t.shape[3]}"
            )
        elif (want.length is not None or isinstance(t.shape[2], int)) and t.shape[2] != want.length:
            problems.append(
                f"kv_cache.tensors gives {t.name} a length of {want.length or want.span}, but graph {file} has "
                f"{t.shape[2]}"
            )
    return problems


def _reads_problems(manifest: Manifest) -> list[str]:
    """A shared_kv cache's ``kv_cache.reads``: each layer reads an earlier layer that carries its own
    keys and values (listed in ``kv_cache.tensors``) and carries none itself."""
    reads, listed = manifest.kv_cache.reads or (), {t.layer for t in manifest.kv_cache.tensors or ()}
    if reads and manifest.kv_cache.kind != "shared_kv":
        return [f"kv_cache.reads is for a shared_kv cache, not {manifest.kv_cache.kind or 'keys and values'}"]
    problems = []
    for r in reads:
        why = (
            "it is not an earlier layer"
            if r.reads >= r.layer
            else f"kv_cache.tensors lists no cache of layer {r.reads}"
            if r.reads not in listed
            else f"kv_cache.tensors lists a cache of layer {r.layer} itself"
            if r.layer in listed
            else None
        )
        if why:
            problems.append(f"kv_cache.reads has layer {r.layer} read layer {r.reads}, but {why}")
    return problems
