"""Frozen dataclasses <-> JSON objects, for the records kiln writes (the manifest and its parts).

``to_json`` is ``dataclasses.asdict`` with fields marked ``omit_if_none`` left out when they are
None (keys that only some exports have); ``from_json`` rebuilds a record from parsed JSON by
its type hints and raises ``ArtifactError`` naming the first key that is missing or of the
wrong type, so a damaged or hand-edited file gets one clear line, never a ``KeyError``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, get_args, get_origin

from kiln.errors import ArtifactError

__all__ = ["OMIT_IF_NONE", "to_json", "from_json"]

T = TypeVar("T")
OMIT_IF_NONE: dict[str, Any] = {"omit_if_none": True}  # ``dataclasses.field(metadata=...)``


def to_json(record: Any) -> Any:
    """The JSON-ready form of a record (nested records, tuples as lists, dicts kept in order)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {
            f.name: to_json(getattr(record, f.name))
            for f in dataclasses.fields(record)
            if not (f.metadata.get("omit_if_none") and getattr(record, f.name) is None)
        }
    if isinstance(record, (list, tuple)):
        return [to_json(v) for v in record]
    if isinstance(record, dict):
        return {k: to_json(v) for k, v in record.items()}
    return record


def from_json(cls: type[T], data: Any, where: str = "") -> T:
    """``cls`` (a dataclass) from parsed JSON; an ``ArtifactError`` names what does not fit."""
    return typing.cast(T, _decode(cls, data, where or cls.__name__))


def _decode(hint: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _decode(option, value, where)
            except ArtifactError as exc:
                errors.append(str(exc))
        raise ArtifactError(errors[0].split(": ", 1)[-1] if errors else f"{where}: unexpected value {value!r}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ArtifactError(f"{where}: expected an object, found {type(value).__name__}")
        hints = typing.get_type_hints(hint)
        kwargs = {}
        for f in dataclasses.fields(hint):
            if f.name in value:
                kwargs[f.name] = _decode(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ArtifactError(f"{where}: missing key {f.name!r}")
        return typing.cast(Any, hint)(**kwargs)
    if origin is tuple:
        if not isinstance(value, list):
            raise ArtifactError(f"{where}: expected a list, found {type(value).__name__}")
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if item is None:
            return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
        return tuple(_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ArtifactError(f"{where}: expected an object, found {type(value).__name__}")
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ArtifactError(f"{where}: expected {getattr(hint, '__name__', hint)}, found {value!r}")
