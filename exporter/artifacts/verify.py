"""``kiln verify``: does an export directory still hold exactly the files its manifest names, and
do its graphs and the manifest's claims about them agree (``structure``: paths, I/O, dims; then
``claims``: what the graphs are, against every field that changes how they are run or judged)?
Every command that runs an export (check, generate, bench, triton, build) reads it through
``require_verified``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath

from kiln.errors import ArtifactError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.claims import claim_problems
from kiln.exporter.artifacts.hashing import hash_tree, links
from kiln.exporter.artifacts.lockfile import own_leftovers, staging_pids
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.structure import structure_problems

__all__ = ["Verification", "verify_dir", "require_verified", "unlisted"]


@dataclasses.dataclass(frozen=True)
class Verification:
    directory: Path
    checked: int  # files whose sha256 was recomputed
    missing: tuple[str, ...]
    changed: tuple[str, ...]
    unexpected: tuple[str, ...]
    manifest: Manifest
    links: tuple[str, ...] = ()  # "path -> where it points": kiln writes no links, and never reads through one
    leftovers: tuple[str, ...] = ()  # kiln triton's own lock file and staging (``lockfile``): not checked
    structure: tuple[str, ...] = ()  # what the graphs and the manifest's claims disagree on (``structure``, ``claims``)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.changed or self.unexpected or self.links or self.structure)

    def problems(self) -> list[str]:
        return (
            [f"missing: {p}" for p in self.missing]
            + [f"changed (sha256 differs): {p}" for p in self.changed]
            + [f"unexpected: {p}" for p in self.unexpected]
            + [f"a symbolic link (kiln writes none, and reads none): {p}" for p in self.links]
            + list(self.structure)
        )


def verify_dir(directory: Path) -> Verification:
    manifest = manifest_mod.read(directory)
    recorded = manifest.files
    leftovers = own_leftovers(directory)  # a killed or interrupted kiln triton's: the next one removes them
    found = hash_tree(directory, exclude=(manifest_mod.MANIFEST,), skip=leftovers)
    # the claims are compared only with graphs proved inside the export and of the recorded I/O
    structure = structure_problems(directory, manifest) or claim_problems(directory, manifest)
    return Verification(
        directory=directory,
        checked=len(found),
        missing=tuple(sorted(set(recorded) - set(found))),
        changed=tuple(sorted(p for p in set(recorded) & set(found) if recorded[p] != found[p])),
        unexpected=tuple(sorted(set(found) - set(recorded))),
        manifest=manifest,
        links=tuple(f"{path} -> {target}" for path, target in links(directory, leftovers).items()),
        leftovers=tuple(leftovers),
        structure=tuple(structure),
    )


def require_verified(directory: Path, *, rewritten: str | None = None) -> Manifest:
    """The manifest of a directory whose files all match it; otherwise one clear error. Files
    under ``rewritten`` (a folder the caller is about to rewrite, e.g. ``engines/``) are not checked."""
    result = verify_dir(directory)
    problems = [p for p in result.problems() if rewritten is None or not p.split(": ", 1)[-1].startswith(rewritten)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        differ = f"{directory}: files differ from manifest.json: {'; '.join(problems[:3])}{more}"
        raise ArtifactError(f"{differ}; {_what_to_run(result)}")
    return result.manifest


def _what_to_run(result: Verification) -> str:
    """The end of ``require_verified``'s refusal. Where an interrupted kiln triton left its staging
    (killed between its renames: ``triton/`` is missing), the next kiln triton puts it back."""
    directory = result.directory
    if result.leftovers and os.getpid() not in staging_pids(directory):  # not this kiln triton's own staging
        left = ", ".join(result.leftovers)
        then = f"run kiln triton {directory} --name NAME, then kiln verify {directory}"
        return f"{left} were left by an interrupted kiln triton: {then}"
    return f"run kiln verify {directory}"


def unlisted(directory: Path, manifest: Manifest, sub: str = "") -> list[str]:
    """What under ``directory/sub`` (all of it by default) the manifest does not account for
    (paths relative to ``directory``): files it does not list, links (always: kiln writes none)
    and empty folders; what a command replacing that folder did not write, by the replacement
    rule of ``artifacts.staging``. ``manifest.json`` itself is accounted for."""
    root = directory / sub if sub else directory
    if not root.is_dir():
        return []
    holding = {parent.as_posix() for rel in manifest.files for parent in PurePosixPath(rel).parents}
    leftovers = set(own_leftovers(directory))  # kiln's own (``lockfile``): replaced with the rest
    foreign = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if rel.split("/", 1)[0] in leftovers:
            continue
        if path.is_symlink():
            foreign.append(f"{rel} (a symbolic link)")
        elif path.is_dir():
            if rel not in holding and not any(path.iterdir()):
                foreign.append(f"{rel}/")
        elif rel not in manifest.files and rel != manifest_mod.MANIFEST:
            foreign.append(rel)
    return foreign
