"""The trace cache: a template's traced graph, kept on disk for the next export of the same
architecture (issue 24: the trace is most of a small export's time, ~8 s of a tiny model's 10).

What is cached is the exporter's own output for one template graph (``trace_graph`` on the meta
device), before any kiln pass: nodes with their module scopes, initializers without data. Its
meta-device initializers are written as placeholders (``UNBOUND``: an external tensor at a
location that is never a file), which ``passes.bind`` binds to the reference's tensors exactly as
it binds a fresh trace's; every later pass, and parity, runs as on a fresh trace.

The key is a digest of everything the trace reads: every argument of ``trace_graph``, the
template module's structure (each submodule's class, the digest of the file that defines it,
its attributes, its parameters' and buffers' names, shapes and dtypes; a config object's
attributes), and the versions of kiln's own source (a digest of every file of the package),
torch, onnx, onnx-ir, onnxscript and transformers. Any change is a new key: nothing is ever
invalidated in place. Entries are written atomically (a temporary file renamed), so concurrent
exports (the tests' workers) never read half an entry.

Where: ``$KILN_CACHE/trace`` (``KILN_CACHE=off``: no cache), else ``~/.cache/kiln/trace``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import torch

# onnx.load's error for bytes that are no model
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from torch import nn

from kiln.errors import ExportError
from kiln.inputs import check_input
from kiln.newfile import new_output

__all__ = ["UNBOUND", "TraceCache", "as_cached", "from_cached", "trace_cache"]

# the location of a cached initializer's placeholder (never a file; passes.bind knows it)
UNBOUND = "kiln-trace-cache-unbound"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_VERSIONED = ("torch", "onnx", "onnx-ir", "onnxscript", "transformers")
# a config's source or identity, not what it computes; transformers' GenerationConfig (a model's
# ``generation_config``) keeps ``hash(self)`` in ``_original_object_hash``, which differs in every
# process (hash randomisation): read, it made every Hugging Face key new (measured: no hit at all)
_WHERE_FROM = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "_original_object_hash"})


def trace_cache() -> TraceCache | None:
    """The cache ``KILN_CACHE`` names (default ``~/.cache/kiln``), or None when it is ``off``."""
    root = os.environ.get("KILN_CACHE")
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    return TraceCache(Path(root) if root else Path.home() / ".cache" / "kiln")


class TraceCache:
    def __init__(self, root: Path) -> None:
        self.directory = root / "trace"

    def key(self, module: nn.Module, arguments: Mapping[str, Any]) -> str:
        """The digest of everything a trace of ``module`` with ``arguments`` reads."""
        h = hashlib.sha256()
        for part in (_versions(), _stable(dict(arguments)), *_module_parts(module)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def get(self, key: str) -> ir.Model | None:
        path = self.directory / f"{key}.onnx"
        try:
            check_input(path, ExportError, None)  # onnx.load opens it by name: a FIFO there would never answer
            return from_cached(onnx.load(path, load_external_data=False))
        except (OSError, DecodeError, ValueError, ir.serde.SerdeError, ExportError):
            return None  # absent, unreadable or no file: traced again, and written again

    def put(self, key: str, proto: onnx.ModelProto) -> None:
        """``proto`` (``as_cached``'s) under ``key``. A cache that cannot be written is skipped
        silently: it only saves time."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with new_output(self.directory / f"{key}.onnx") as tmp:  # a failed write leaves no temporary behind
                tmp.write_bytes(proto.SerializeToString())
        except OSError:
            return


def as_cached(model: ir.Model) -> onnx.ModelProto:
    """The traced model's proto as the cache keeps it (the model itself is not changed). Every
    trace goes through it, cached or not, so the graphs of an export are the same bytes either
    way (value names, for one, are given when the proto is written)."""
    return _placeholder_proto(model)


def from_cached(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def _placeholder_proto(model: ir.Model) -> onnx.ModelProto:
    """The model's proto, each meta-device initializer written as an ``UNBOUND`` external tensor."""
    swapped: list[tuple[ir.Value, Any]] = []
    for value in model.graph.initializers.values():
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.device.type == "meta" and value.dtype is not None:
            swapped.append((value, value.const_value))
            shape = value.shape if value.shape is not None else ir.Shape(list(raw.shape))
            value.const_value = ir.ExternalTensor(UNBOUND, 0, 0, value.dtype, shape=shape, name=value.name or "")
    try:
        return ir.serde.serialize_model(model)
    finally:
        for value, original in swapped:
            value.const_value = original


@functools.cache
def _versions() -> str:
    versions = []
    for name in _VERSIONED:
        try:
            versions.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name}=absent")
    return ";".join(versions) + ";kiln=" + _kiln_source()


@functools.cache
def _kiln_source() -> str:
    """A digest of every Python file of kiln (any change to kiln's code is a new key)."""
    root = Path(__file__).resolve().parents[2]
    packages = [
        d for d in sorted(root.iterdir()) if (d / "__init__.py").is_file()
    ]  # not a checkout's .venv, tests or build outputs
    h = hashlib.sha256()
    for path in [*sorted(root.glob("*.py")), *(p for d in packages for p in sorted(d.rglob("*.py")))]:
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def _module_parts(module: nn.Module) -> list[str]:
    """One line per submodule: its name, class, its class's file digest, attributes and tensors."""
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        try:
            source = _file_digest(inspect.getsourcefile(cls) or "")
        except TypeError:
            source = "builtin"
        attrs = {
            k: v
            for k, v in vars(sub).items()
            if (not k.startswith("_") or k == "_attn_implementation") and k not in _WHERE_FROM
        }
        tensors = [
            (n, tuple(t.shape), str(t.dtype))
            for n, t in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False))
        ]
        parts.append(f"{name}|{cls.__module__}.{cls.__qualname__}|{source}|{_stable(attrs)}|{tensors}")
    return parts


def _stable(value: Any, depth: int = 0) -> str:
    """A repr that is the same in every process for the same value (no addresses, sets sorted,
    tensors by shape and dtype, a config object by its attributes)."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, Mapping):
        return (
            "{"
            + ",".join(
                f"{_stable(k, depth)}:{_stable(v, depth)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            )
            + "}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_stable(v, depth) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_stable(v, depth) for v in value)) + "}"
    # a function: its name and code's digest
    if isinstance(value, Callable) and not isinstance(value, type):  # type: ignore[arg-type]
        code = getattr(getattr(value, "__func__", value), "__code__", None)
        name = getattr(value, "__qualname__", type(value).__qualname__)
        digest = hashlib.sha256(code.co_code).hexdigest()[:16] if code else _ADDRESS.sub("", repr(value))
        return f"{name}:{digest}"
    if hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)) and depth < 2:
        attributes = {k: v for k, v in vars(value).items() if k not in _WHERE_FROM}
        return f"{type(value).__qualname__}({_stable(attributes, depth + 1)})"
    return _ADDRESS.sub("", repr(value))
