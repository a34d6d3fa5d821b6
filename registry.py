"""One shape for kiln's three registries: the targets (``exporter.targets``), the precision kinds
(``exporter.precision.kinds.registry``) and the model families (``plugins``).

A ``Registry`` maps a name to an entry point, ``"module:attribute"``, imported only when that name
is first asked: the CLI reads the names, and the flags the light declarations declare, without
importing onnx or torch. Its entries are kiln's own (``builtin``, in their order), those a program
or a test adds (``register``), then third-party packages' entry points of its group
(``kiln.targets``, ``kiln.precisions``, ``kiln.plugins``), read when the names are first asked.
What an entry must load to is the registry's ``accept`` (the object, or None: not one); anything
else is one error that names the entry point.

``Flag`` is one CLI option an entry declares (a kind's, a target's): ``cli_options`` makes it a
click option, whose value fills the field ``field`` of whatever holds that entry's options; an
on/off flag that writes a precision's numbers another way says so (``Writes``: ``kiln plugins``
asks it where that precision's own flags are refused, ``exporter.support``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, Generic, TypeVar

from kiln.errors import ConfigError, KilnError

__all__ = ["Flag", "Registry", "Writes"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Writes:
    """An on/off flag writes ``precision``'s numbers (at the default precision) another way."""

    precision: str  # the precision's value ("int8")
    condition: str  # what kiln plugins' legend says of a cell taken only with the flag


@dataclasses.dataclass(frozen=True)
class Flag:
    """One CLI option an entry declares, filling one field of its options (``cli_options`` makes
    it a click option; its click parameter is ``dest``)."""

    option: str  # "--int8-float"
    field: str  # the field it fills
    help: str
    multiple: bool = False
    is_flag: bool = False
    choices: tuple[str, ...] = ()
    default: str | None = None  # a choice's default, as typed
    metavar: str | None = None
    convert: Callable[[Any], Any] | None = None  # the typed text -> the field's value
    writes: Writes | None = None  # an on/off flag that writes a precision's numbers another way

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    def given(self, value: Any) -> bool:
        """Whether ``value`` (click's) is more than the option's default."""
        return bool(value) if self.multiple or self.is_flag else value is not None and value != self.default


class Registry(Generic[T]):
    """Names -> entry points (``"module:attribute"``) or objects, loaded when first asked."""

    def __init__(
        self,
        what: str,
        group: str,
        builtin: Mapping[str, str],
        accept: Callable[[Any], T | None],
        *,
        named: bool = True,
        error: type[KilnError] = ConfigError,
    ) -> None:
        self.what = what  # what an entry is, as errors name it ("target")
        self.group = group  # the entry-point group third-party packages add to
        self._entries: dict[str, str | T] = dict(builtin)
        self._builtin = dict(builtin)
        self._loaded: dict[str, T] = {}
        self._accept = accept
        self._named = named  # an entry's object carries its name (``.name``), which must be the entry's
        self._error = error
        self._scanned = False

    def register(self, name: str, entry: str | T) -> None:
        """Add ``name``: an entry point ``"module:attribute"`` or the object; another under a taken
        name is a programming error."""
        known = self._loaded.get(name, self._entries.get(name))
        if known is not None and known is not entry and known != entry:
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self._entries[name] = entry
        if not isinstance(entry, str):
            self._loaded[name] = self._checked(name, entry, entry)

    def forget(self, name: str) -> None:
        """Drop ``name`` (what a test registered, once it is done)."""
        self._entries.pop(name, None)
        self._loaded.pop(name, None)

    def fresh(self) -> Registry[T]:
        """A registry of the same built-ins, nothing registered and no entry point read yet (a test's, to swap in)."""
        return Registry(self.what, self.group, self._builtin, self._accept, named=self._named, error=self._error)

    def rescan(self) -> None:
        """Read the entry points again when the names are next asked (a package installed since)."""
        self._scanned = False

    def names(self) -> tuple[str, ...]:
        """Every entry's name: the built-ins in order, then those registered, then the entry points'."""
        self._scan()
        return tuple(self._entries)

    def builtins(self) -> tuple[str, ...]:
        """kiln's own entries' names, in their order."""
        return tuple(self._builtin)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def get(self, name: str) -> T:
        """The object of ``name``, loaded on first ask; an unknown name is a ``KeyError``."""
        self._scan()
        if name not in self._loaded:
            entry = self._entries[name]
            obj = metadata.EntryPoint(name, entry, self.group).load() if isinstance(entry, str) else entry
            self._loaded[name] = self._checked(name, entry, obj)
        return self._loaded[name]

    def all(self) -> list[T]:
        """Every entry's object, in ``names`` order."""
        return [self.get(name) for name in self.names()]

    def _checked(self, name: str, entry: object, obj: object) -> T:
        accepted = self._accept(obj)
        if accepted is None:
            raise self._error(f"entry point {name!r} ({entry}) does not provide a kiln {self.what}")
        if self._named and getattr(accepted, "name", name) != name:
            other = f"a {self.what} named {getattr(accepted, 'name')!r}"
            raise self._error(f"entry point {name!r} ({entry}) provides {other}; name the entry point so")
        return accepted

    def _scan(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        for ep in metadata.entry_points(group=self.group):
            if self._entries.get(ep.name, ep.value) != ep.value:
                taken = f"kiln already has a {self.what} named {ep.name!r}"
                raise self._error(f"entry point {ep.name!r} ({ep.value}) of {self.group}: {taken}")
            self._entries[ep.name] = ep.value
