"""``--model ORG/NAME``: a Hugging Face repo id resolved from the local Hugging Face cache.

kiln never downloads. A repo id names the snapshot that ``hf download`` (huggingface_hub's
command; or ``transformers``' ``from_pretrained``) left in the cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``,
else ``~/.cache/huggingface/hub``, as ``huggingface_hub`` itself reads them. The lookup is
``huggingface_hub.snapshot_download(local_files_only=True)``: the hub library's own reading of
its cache layout (refs, snapshots, symlinked blobs), which never touches the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kiln.errors import CheckpointError
from kiln.inputs import check_input

__all__ = ["HF_EXTRA", "looks_like_repo_id", "cached_snapshot", "cache_repo_root"]

# how the Hugging Face extra is installed: kiln installs from its checkout (README, Set up)
# a wheel's user has no checkout
HF_EXTRA = """pip install -e ".[hf]" in kiln's checkout, or pip install "kiln-*.whl[hf]" beside a wheel"""

# ORG/NAME as the Hub spells repo ids: one slash, letters, digits, '-', '_', '.' (no '..', no leading '.')
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_REF_MAX_BYTES = 4096  # refs/main holds a 40-character commit hash


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model


def cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot directory of ``repo_id`` (its ``refs/main``), or one line saying where kiln looked."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(
            f"{repo_id}: no such directory; as a Hugging Face repo id it is looked up in the Hugging Face cache, "
            f"which needs huggingface_hub: {HF_EXTRA}"
        ) from None
    cache = Path(constants.HF_HUB_CACHE)
    where = cache / f"models--{repo_id.replace('/', '--')}"
    if os.path.lexists(where / "refs" / "main"):  # huggingface_hub opens it: a FIFO there would hang the lookup
        check_input(where / "refs" / "main", CheckpointError, _REF_MAX_BYTES, what="a Hugging Face cache ref")
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise CheckpointError(
            f"{repo_id}: no such directory, and not in the Hugging Face cache (looked in {where}; set "
            "HF_HUB_CACHE or HF_HOME "
            f"to use another cache); kiln never downloads: fetch it first (hf download {repo_id}) or pass a directory"
        ) from None
    _refuse_outside_snapshots(repo_id, path, where)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{repo_id}: the cached snapshot {path} has no config.json (an incomplete download?)")
    return path


def _refuse_outside_snapshots(repo_id: str, path: Path, where: Path) -> None:
    """``path`` is one of the repo's snapshots (``where/snapshots/<commit>``): huggingface_hub
    joins ``refs/main``'s text to ``snapshots/`` as it is, so a ref of ``../../../elsewhere`` led
    the export to a checkpoint outside the cache."""
    snapshots = (where / "snapshots").resolve()
    if path.resolve().parent != snapshots:
        ref = where / "refs" / "main"
        raise CheckpointError(
            f"{repo_id}: the Hugging Face cache's {ref} leads to {path.resolve()}, not a snapshot in {snapshots}; kiln"
            f" reads a cached repo only from its snapshots: fetch it again (hf download {repo_id}) or pass a directory"
        )


def cache_repo_root(directory: Path) -> Path | None:
    """The repo's cache folder (``models--ORG--NAME``) when ``directory`` is one of its snapshots
    (``models--ORG--NAME/snapshots/<rev>``), whose files are links into the folder's ``blobs/``."""
    snapshots = directory.absolute().parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        return snapshots.parent
    return None
