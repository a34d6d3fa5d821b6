"""``kiln verify``: does an export directory still hold exactly the files its manifest names?"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.hashing import hash_tree
from kiln.exporter.artifacts.manifest import Manifest

__all__ = ["Verification", "verify_dir", "require_verified", "unlisted"]


@dataclasses.dataclass(frozen=True)
class Verification:
    directory: Path
    checked: int  # files whose sha256 was recomputed
    missing: tuple[str, ...]
    changed: tuple[str, ...]
    unexpected: tuple[str, ...]
    manifest: Manifest

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
    recorded = manifest.files
    found = hash_tree(directory, exclude=(manifest_mod.MANIFEST,))
    return Verification(
        directory=directory,
        checked=len(found),
        missing=tuple(sorted(set(recorded) - set(found))),
        changed=tuple(sorted(p for p in set(recorded) & set(found) if recorded[p] != found[p])),
        unexpected=tuple(sorted(set(found) - set(recorded))),
        manifest=manifest,
    )


def require_verified(directory: Path, *, rewritten: str | None = None) -> Manifest:
    """The manifest of a directory whose files all match it; otherwise one clear error. Files
    under ``rewritten`` (a folder the caller is about to rewrite, e.g. ``engines/``) are not checked."""
    result = verify_dir(directory)
    problems = [p for p in result.problems() if rewritten is None or not p.split(": ", 1)[-1].startswith(rewritten)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ArtifactError(f"{directory}: files differ from manifest.json: {'; '.join(problems[:3])}{more}; run kiln verify {directory}")
    return result.manifest


def unlisted(directory: Path, manifest: Manifest, sub: str) -> list[str]:
    """Files under ``directory/sub`` that ``manifest.files`` does not list (paths relative to
    ``directory``): what a command rewriting that folder did not write, by the replacement rule
    of ``artifacts.staging``."""
    root = directory / sub
    if not root.is_dir():
        return []
    found = (p.relative_to(directory).as_posix() for p in sorted(root.rglob("*")) if p.is_file() or p.is_symlink())
    return [rel for rel in found if rel not in manifest.files]
