"""Where a graph's tensors keep their bytes: the external data files beside the graph.

One module below every stage that reads a graph's weights files (the parity runner sizing its
sessions, the Triton repository copying them, the structure checks of ``kiln verify``), so each
reads the same references the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.errors import ArtifactError

__all__ = ["external_files", "plain_name", "set_bytes", "tensors"]


def tensors(graph: Any) -> Iterator[Any]:
    """Every tensor a graph holds: initializers, sparse ones, Constant values, subgraphs'."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from tensors(sub)


def external_files(graph: Path, model: Any) -> dict[str, Path]:
    """The files ``graph``'s tensors read external data from (``model``: the graph, loaded
    without its data), by the location the graph names. An ``ArtifactError`` names the first
    location that is not a plain file name of a regular file beside the graph (a path, ``..``, a
    missing file, a link), so nothing outside the graph's directory is opened or sized. Only
    names are checked: ``kiln verify`` checks each tensor's byte range against the manifest."""
    import onnx  # a core dependency; only the graph's protobuf is read

    files: dict[str, Path] = {}
    for tensor in tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if location in files:
            continue
        path = graph.parent / location
        if not plain_name(location) or path.is_symlink() or not path.is_file():
            raise ArtifactError(
                f"{graph.name}: tensor {tensor.name} reads external data from {location!r}, which is not a file "
                "beside the graph"
            )
        files[location] = path
    return files


def set_bytes(graphs: Iterable[Path]) -> int:
    """The bytes of a graph set's files and of every external data file they read, each file once
    (the graphs of a set share theirs): what a runtime holds when the set's sessions are open."""
    import onnx

    files: set[Path] = set()
    for graph in graphs:
        files |= {
            graph.resolve(),
            *(
                path.resolve()
                for path in external_files(graph, onnx.load(str(graph), load_external_data=False)).values()
            ),
        }
    return sum(path.stat().st_size for path in files)


def plain_name(location: str) -> bool:
    """Whether an external-data ``location`` names a file in the graph's own directory (no
    path, no ``..``), the only form kiln writes and reads."""
    return (
        bool(location)
        and "\\" not in location
        and PurePosixPath(location).name == location
        and location not in (".", "..")
    )
