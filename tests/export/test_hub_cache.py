"""``--model ORG/NAME`` resolved from a Hugging Face cache the test builds in the hub's own layout
(refs/main -> snapshots/<commit>/ of symlinks into blobs/), offline; a repo id that is not there
gets one line naming where kiln looked."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_testing import tiny_config, write_checkpoint

pytest.importorskip("huggingface_hub", reason="repo ids are looked up with huggingface_hub (pip install -e .[hf])")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(root: Path, repo_id: str) -> Path:
    """A cache holding ``repo_id`` at ``COMMIT`` (a tiny kiln checkpoint; the resolution does not
    depend on the family)."""
    source = write_checkpoint(root / "source", tiny_config())
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return root / "hub"


def _kiln(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    code = "import sys; from kiln.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


def test_repo_id_from_the_cache(tmp_path: Path) -> None:
    cache = _cache(tmp_path, "kiln-tests/tiny-ple")
    done = _kiln(
        "export",
        "--model",
        "kiln-tests/tiny-ple",
        "--out",
        str(tmp_path / "out"),
        "--parity-tokens",
        "4",
        "--json",
        cache=cache,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads(done.stdout)["manifest"]
    assert manifest["checkpoint"]["reference"] == "kiln-tests/tiny-ple"  # kiln check finds it the same way
    assert manifest["family"] == "native"


def test_repo_id_not_in_the_cache(tmp_path: Path) -> None:
    cache = _cache(tmp_path, "kiln-tests/tiny-ple")
    done = _kiln("export", "--model", "kiln-tests/other", "--out", str(tmp_path / "out"), cache=cache)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0] == (
        f"error: checkpoint: kiln-tests/other: no such directory, and not in the Hugging Face cache (looked in "
        f"{cache / 'models--kiln-tests--other'}; set HF_HUB_CACHE or HF_HOME to use another cache); kiln never "
        "downloads: "
        "fetch it first (hf download kiln-tests/other) or pass a directory"
    )
    assert not (tmp_path / "out").exists()


def test_a_path_wins_over_a_repo_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.plugins import resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_checkpoint("org/name") == Path("org/name")  # an existing relative directory is never looked up


def test_check_finds_the_snapshot_without_the_cache(tmp_path: Path) -> None:
    """The manifest stores the repo id and the snapshot it resolved to: kiln check in a shell whose
    Hugging Face cache lacks the repo uses the snapshot, and says so in one line."""
    cache = _cache(tmp_path, "kiln-tests/tiny-ple")
    out = tmp_path / "out"
    done = _kiln(
        "export", "--model", "kiln-tests/tiny-ple", "--out", str(out), "--parity-tokens", "4", "--json", cache=cache
    )
    assert done.returncode == 0, done.stderr
    snapshot = cache / "models--kiln-tests--tiny-ple" / "snapshots" / COMMIT
    assert json.loads(done.stdout)["manifest"]["checkpoint"]["resolved"] == str(snapshot)
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    checked = _kiln("check", str(out), cache=empty)
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr.strip().splitlines()[0] == (
        f"checkpoint: kiln-tests/tiny-ple does not resolve here (no such directory, and not in the Hugging Face cache"
        f" (looked in {empty / 'models--kiln-tests--tiny-ple'}; set HF_HUB_CACHE or HF_HOME to use another "
        "cache); kiln never downloads:"
        f" fetch it first (hf download kiln-tests/tiny-ple) or pass a directory); using {snapshot}, where it "
        "resolved when the export ran"
    )
    assert "parity passed" in checked.stdout


def test_cache_links_may_reach_anywhere_in_the_repo_folder_only(tmp_path: Path) -> None:
    """A snapshot is links into the repo's blobs/ by design (../../blobs/<sha>): kiln loads it; a
    link of the snapshot that leaves the repo's cache folder is refused as anywhere else."""
    from kiln.errors import CheckpointError
    from kiln.plugins import load_model

    cache = _cache(tmp_path, "kiln-tests/tiny-ple")
    snapshot = cache / "models--kiln-tests--tiny-ple" / "snapshots" / COMMIT
    assert all((snapshot / name).is_symlink() for name in ("config.json", "model.safetensors"))
    assert load_model(snapshot).spec.family == "native"
    secret = tmp_path / "secret.json"
    secret.write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}')
    (snapshot / "tokenizer.json").symlink_to(secret)
    with pytest.raises(CheckpointError) as err:
        load_model(snapshot)
    repo = cache / "models--kiln-tests--tiny-ple"
    assert str(err.value) == (
        f"checkpoint: {snapshot / 'tokenizer.json'} links to {secret}, outside {repo}: kiln reads nothing from "
        "outside the checkpoint;"
        f" copy the file in (rm {snapshot / 'tokenizer.json'} && cp {secret} {snapshot / 'tokenizer.json'})"
    )


def test_the_commands_kiln_names_exist_and_agree_with_the_readme() -> None:
    """The not-in-cache error's fetch command is the one today's huggingface_hub installs (``hf``;
    ``huggingface-cli`` is gone), and the install command of kiln's errors is the README's."""
    from importlib import metadata

    import tomllib

    from kiln.plugins.hub_cache import HF_EXTRA

    scripts = {ep.name for ep in metadata.distribution("huggingface_hub").entry_points if ep.group == "console_scripts"}
    assert "hf" in scripts and "huggingface-cli" not in scripts
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert "huggingface-cli" not in readme and "`hf download ORG/NAME`" in readme
    assert HF_EXTRA == """pip install -e ".[hf]" in kiln's checkout, or pip install "kiln-*.whl[hf]" beside a wheel"""
    assert '`pip install -e ".[hf]"`' in readme
    assert "hf" in tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
