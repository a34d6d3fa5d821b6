"""Special files and links where kiln reads or writes, through the CLI (issue 38, items 3 and 11):
a FIFO, or a link to /dev/zero, as config.json, adapter_config.json or manifest.json is one line and
exit code 1 from every command, never a hang or a read until MemoryError; a Hugging Face cache's
refs/main that leads out of the cache, and bench's --out or --plot through a link, are refused.

Each command runs in its own interpreter with a timeout and a memory limit: a hang or an endless
read fails the test rather than hanging it or filling the machine's memory."""

from __future__ import annotations

import copy
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.contract.io import DECODER_KINDS, graph_io
from kiln.plugins.native import spec_of
from kiln_testing import placeholder_export, tiny_config, typed_manifest, write_checkpoint

NOT_REGULAR = "not a regular file; kiln reads only regular files"
NOT_FOLLOWED = "which kiln does not follow here; put the file itself there"
Q = "model.layers.0.self_attn.q_proj"
_MEMORY = 6 << 30  # address space: ample for kiln's imports, far short of what reading /dev/zero takes


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY, _MEMORY))


def _kiln(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """The exit code of ``kiln ARGS`` and its stderr's lines (a hang: ``TimeoutExpired``, the test fails)."""
    code = "import sys; from kiln.cli import main; main(sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, preexec_fn=_limited, env=env
    )
    return done.returncode, done.stderr.strip().splitlines()


def _files(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: its kind, and its bytes or where it links (never opening a special file)."""
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        content = os.readlink(path) if stat.S_ISLNK(mode) else path.read_bytes() if stat.S_ISREG(mode) else None
        found[path.relative_to(root).as_posix()] = (stat.S_IFMT(mode), content)
    return found


def _refused(root: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """The one line of ``kiln ARGS`` (exit code 1), ``root``'s files as they were."""
    before = _files(root)
    code, lines = _kiln(*args, env=env)
    assert code == 1 and len(lines) == 1, lines
    assert _files(root) == before
    return lines[0]


def _manifest(lora: bool = False) -> dict[str, Any]:
    """The manifest of the tiny model's three graphs (with one LoRA slot, on layer 0's q_proj)."""
    spec = spec_of(tiny_config())
    graphs = {}
    for kind in DECODER_KINDS:
        io = graph_io(spec, kind)
        inputs, outputs = [t.to_dict() for t in io.inputs], [t.to_dict() for t in io.outputs]
        graphs[kind.value] = {"file": f"onnx/{kind.value}.onnx", "inputs": inputs, "outputs": outputs}
    limits = {"max_batch": 8, "max_context": 48}
    m: dict[str, Any] = {"manifest_version": 2, "precision": "fp32", "limits": limits, "graphs": graphs}
    if lora:
        names = {"a": f"{Q}.lora_A", "b": f"{Q}.lora_B", "rank_dim": f"{Q}.rank"}
        slot = {"module": Q, "in_features": 64, "out_features": 64, **names}
        m["lora"] = {"max_rank": 8, "dtype": "float32", "slots": [slot]}
    return m


def _export(directory: Path, lora: bool = False) -> Path:
    """An export ``kiln verify`` passes (placeholder graphs; with LoRA slots, the slot inputs in its graphs)."""
    m = _manifest(lora)
    written = copy.deepcopy(m)
    slots = typed_manifest(m).lora
    if slots is not None:
        extra = [{"name": name, "dtype": slots.dtype, "shape": [a, b]} for name, (_, a, b) in slots.inputs().items()]
        for graph in written["graphs"].values():
            graph["inputs"] = [*graph["inputs"], *extra]
    placeholder_export(directory, written)
    m.update(
        {key: written[key] for key in ("files", "weights", "checkpoint")}
    )  # what placeholder_export made true of the files
    manifest_mod.write(directory, typed_manifest(m))
    return directory


def _special(path: Path, kind: str) -> None:
    """``path`` replaced by a FIFO or a link to /dev/zero."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_export_with_a_special_config(tmp_path: Path, kind: str) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    _special(ckpt / "config.json", kind)
    line = _refused(tmp_path, "export", "--model", str(ckpt), "--out", str(tmp_path / "out"))
    config = ckpt / "config.json"
    what = f"{config}: a FIFO" if kind == "fifo" else f"{config} (a link to /dev/zero): a character device"
    assert line == f"error: checkpoint: {what}, {NOT_REGULAR}"


COMMANDS: dict[str, tuple[str, ...]] = {
    "verify": (), "check": (), "generate": ("--ids", "1,2"), "bench": ("--no-torch",),
    "triton": ("--name", "m"), "build": (),
}  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_with_a_special_manifest(tmp_path: Path, command: str, kind: str) -> None:
    export = _export(tmp_path / "export")
    _special(export / "manifest.json", kind)
    line = _refused(tmp_path, command, str(export), *COMMANDS[command])
    manifest = export / "manifest.json"
    if kind == "fifo":
        assert line == f"error: artifacts: {manifest}: a FIFO, {NOT_REGULAR}"
    else:  # kiln writes no link into an export, and reads none (kiln verify names one)
        assert line == f"error: artifacts: {manifest}: a symbolic link (to /dev/zero), {NOT_FOLLOWED}"


def test_adapter_with_a_fifo_adapter_config(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="kiln adapter needs peft (pip install -e .[hf])")
    export = _export(tmp_path / "export", lora=True)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    _special(adapter / "adapter_config.json", "fifo")
    line = _refused(tmp_path, "adapter", str(adapter), "--export", str(export), "--no-check")
    assert line == f"error: config: {adapter / 'adapter_config.json'}: a FIFO, {NOT_REGULAR}"


@pytest.mark.parametrize("name", ["model.onnx", "genai_config.json"])
def test_bench_on_a_directory_whose_graph_or_config_is_a_fifo(tmp_path: Path, name: str) -> None:
    peer = tmp_path / "peer"
    peer.mkdir()
    _special(peer / name, "fifo")
    line = _refused(tmp_path, "bench", str(peer), "--no-torch")
    assert line == f"error: bench: {peer / name}: a FIFO, {NOT_REGULAR}"


@pytest.mark.parametrize("flags", [("--out", "link.json"), ("--plot", "link.png", "--sweep", "8")], ids=["out", "plot"])
def test_bench_refuses_to_write_through_a_link(tmp_path: Path, flags: tuple[str, ...]) -> None:
    export = _export(tmp_path / "export")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    link = tmp_path / flags[1]
    link.symlink_to(victim)
    line = _refused(tmp_path, "bench", str(export), "--no-torch", flags[0], str(link), *flags[2:], "--force")
    refusal = f"{link}: --force replaces only a file, and this is a link (to {victim}); nothing was replaced"
    assert line == f"error: config: {refusal}"


def _hub(root: Path, ref: str) -> tuple[Path, dict[str, str]]:
    """A Hugging Face cache of models--org--name, ``ref`` in its refs/main, and the environment that uses it."""
    repo = root / "hub" / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "refs" / "main").write_text(ref)
    return repo, {**os.environ, "HF_HUB_CACHE": str(root / "hub")}


def test_a_cache_ref_that_leads_out_of_the_cache(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub", reason="repo ids are looked up with huggingface_hub (pip install -e .[hf])")
    elsewhere = write_checkpoint(tmp_path / "elsewhere", tiny_config())  # hub/models--org--name/snapshots/../../../
    repo, env = _hub(tmp_path, "../../../elsewhere")
    line = _refused(tmp_path, "export", "--model", "org/name", "--out", str(tmp_path / "out"), env=env)
    assert line == (
        f"error: checkpoint: org/name: the Hugging Face cache's {repo / 'refs' / 'main'} leads to "
        f"{elsewhere.resolve()},"
        f" not a snapshot in {(repo / 'snapshots').resolve()}; kiln reads a cached repo only from its snapshots:"
        " fetch it again (hf download org/name) or pass a directory"
    )


def test_a_cache_ref_that_is_a_fifo(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub", reason="repo ids are looked up with huggingface_hub (pip install -e .[hf])")
    repo, env = _hub(tmp_path, "0" * 40)
    _special(repo / "refs" / "main", "fifo")
    line = _refused(tmp_path, "export", "--model", "org/name", "--out", str(tmp_path / "out"), env=env)
    assert line == f"error: checkpoint: {repo / 'refs' / 'main'}: a FIFO, {NOT_REGULAR}"
