"""``kiln verify``: does an export directory still hold exactly the files its manifest names?"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError
from kiln.exporter import manifest as manifest_mod
from kiln.exporter.artifacts import hash_tree

__all__ = ["Verification", "verify_dir", "require_verified"]


@dataclasses.dataclass(frozen=True)
class Verification:
    directory: Path
    checked: int  # files whose sha256 was recomputed
    missing: tuple[str, ...]
    changed: tuple[str, ...]
    unexpected: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not (self.missing or self.changed or self.unexpected)

    def problems(self) -> list[str]:
        return (
            [f"missing: {p}" for p in self.missing]
            + [f"changed (sha256 differs): {p}" for p in self.changed]
            + [f"unexpected: {p}" for p in self.unexpected]
        )


def verify_dir(directory: Path) -> Verification:
    manifest = manifest_mod.read(directory)
    recorded: dict[str, str] = manifest.get("files", {})
    found = hash_tree(directory, exclude=(manifest_mod.MANIFEST,))
    return Verification(
        directory=directory,
        checked=len(found),
        missing=tuple(sorted(set(recorded) - set(found))),
        changed=tuple(sorted(p for p in set(recorded) & set(found) if recorded[p] != found[p])),
        unexpected=tuple(sorted(set(found) - set(recorded))),
    )


def require_verified(directory: Path) -> dict[str, Any]:
    """The manifest of a directory whose files all match it; otherwise one clear error."""
    result = verify_dir(directory)
    if not result.ok:
        problems = result.problems()
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ArtifactError(f"{directory}: files differ from manifest.json: {'; '.join(problems[:3])}{more}; run kiln verify {directory}")
    return manifest_mod.read(directory)
