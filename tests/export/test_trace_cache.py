"""The trace cache (``exporter.trace.cache``): an architecture traced once is read back, not traced
again, and gives the same graphs, byte for byte; anything the trace reads changes its key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx_ir as ir
import pytest

from kiln.errors import ExportError
from kiln.exporter.options import ExportOptions
from kiln.exporter.passes.bind import BindWeights, WeightSource
from kiln.exporter.pipeline import export
from kiln.exporter.trace.cache import UNBOUND
from kiln_testing import RecordedProgress, tiny_config, write_checkpoint

OPTIONS = ExportOptions.from_flags(parity_tokens=4)


def _graphs(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "onnx").iterdir())}


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "trace").glob("*.onnx"))


def test_a_cached_trace_gives_the_same_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    monkeypatch.setenv("KILN_CACHE", "off")
    export(ckpt, tmp_path / "fresh", OPTIONS)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    export(ckpt, tmp_path / "first", OPTIONS)
    entries = _entries(tmp_path / "cache")
    names = sorted(
        p.name for p in (tmp_path / "cache" / "trace").iterdir()
    )  # hidden names too: a temporary is .NAME.<hex>.kiln-tmp (newfile.py)
    assert len(entries) == 1 and names == [entries[0].name], f"the trace folder holds more than its entry: {names}"
    written = entries[0].stat().st_mtime_ns
    progress = RecordedProgress()
    result = export(ckpt, tmp_path / "second", OPTIONS, progress)
    assert result.parity.passed and progress.stages["trace"] == [3, 3]  # the phases counted as done
    assert (
        _entries(tmp_path / "cache") == entries and entries[0].stat().st_mtime_ns == written
    )  # read, not written again
    assert _graphs(tmp_path / "fresh") == _graphs(tmp_path / "first") == _graphs(tmp_path / "second")


def test_what_the_trace_reads_changes_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another norm epsilon (a constant in the graph, no shape changes) and another --max-batch
    are new entries, and each export's graphs are its own (parity passes on each)."""
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    base = write_checkpoint(tmp_path / "base", tiny_config())
    other = write_checkpoint(tmp_path / "eps", tiny_config(norm_eps=1e-2))
    export(base, tmp_path / "a", OPTIONS)
    assert export(other, tmp_path / "b", OPTIONS).parity.passed
    assert (
        len(_entries(tmp_path / "cache")) == 2
        and _graphs(tmp_path / "a")["decode.onnx"] != _graphs(tmp_path / "b")["decode.onnx"]
    )
    export(base, tmp_path / "c", ExportOptions.from_flags(parity_tokens=4, max_batch=4))
    assert len(_entries(tmp_path / "cache")) == 3


def test_a_hugging_face_export_in_another_process_reads_the_entry(tmp_path: Path) -> None:
    """The key is the same in every process: two ``kiln export`` processes of a saved Llama with
    different hash seeds (a GenerationConfig keeps its own ``hash()``), the second reads the first's
    entry and writes nothing."""
    pytest.importorskip("transformers")
    import os
    import subprocess
    import sys

    from kiln_testing import save_base

    ckpt = save_base("llama", tmp_path / "ckpt")
    env = {**os.environ, "KILN_CACHE": str(tmp_path / "cache")}
    for seed, out in (("1", "a"), ("2", "b")):
        command = [
            sys.executable,
            "-m",
            "kiln.cli",
            "export",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / out),
            "--parity-tokens",
            "4",
            "--json",
        ]
        done = subprocess.run(command, env={**env, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        if out == "a":
            (entry,) = _entries(tmp_path / "cache")
            written = entry.stat().st_mtime_ns
    assert _entries(tmp_path / "cache") == [entry] and entry.stat().st_mtime_ns == written
    assert _graphs(tmp_path / "a") == _graphs(tmp_path / "b")


def test_an_unreadable_entry_is_traced_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    export(ckpt, tmp_path / "a", OPTIONS)
    (entry,) = _entries(tmp_path / "cache")
    entry.write_bytes(b"not a graph")
    assert export(ckpt, tmp_path / "b", OPTIONS).parity.passed
    assert _graphs(tmp_path / "a") == _graphs(tmp_path / "b") and entry.stat().st_size > 1000  # written again


def test_a_placeholder_the_model_cannot_bind_is_refused() -> None:
    import torch

    w = ir.Value(name="model.missing.weight", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    w.const_value = ir.ExternalTensor(UNBOUND, 0, 0, ir.DataType.FLOAT, shape=ir.Shape([2]), name=w.name)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2]))
    add = ir.node("Add", [x, w])
    add.outputs[0].name = "y"
    model = ir.Model(
        ir.Graph([x], [add.outputs[0]], nodes=[add], initializers=[w], opset_imports={"": 19}), ir_version=10
    )
    bind = BindWeights(WeightSource(torch.nn.Linear(2, 2)))
    bind.call(model)
    with pytest.raises(ExportError) as err:
        bind.ensures(model)
    assert str(err.value).endswith(
        "the traced graph reads ['model.missing.weight'], which the model has no tensor of that name for"
    )
