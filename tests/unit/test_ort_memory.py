"""Issue 38: ONNX Runtime's allocation failures end in one line (``runners.ort_memory``), not a
traceback: a real failure, provoked by a graph whose output is larger than any address space
(256 TiB: refused by the system whatever its overcommit rule), met through ``OrtRunner`` (parity,
``kiln check``) and through a bare session as ``kiln generate``/``kiln bench`` run them (the CLI's
last resort); another ONNX Runtime failure is not taken for one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln import cli
from kiln.errors import MemoryLimitError
from kiln.exporter.contract import static_cache
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.runners.ort_memory import allocation_failure
from kiln.exporter.runners.ort_runner import OrtRunner, ort_session

HUGE = 2**46  # float32 elements: 2**48 bytes, past x86-64's 2**47 bytes of user address space
WAY_OUT = "ask for less (a smaller --max-context, --max-batch, batch or --past) or run on a machine with more memory"


def _huge_graph(path: Path) -> Path:
    """y = zeros(input_ids[0] elements): the feed says how much it allocates."""
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["input_ids"], ["y"])],
        "huge",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10), path)
    return path


@pytest.fixture(autouse=True)
def _sixteen_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(static_cache, "machine_memory", lambda: 16 * 2**30)


def test_a_parity_run_out_of_memory_is_one_line(tmp_path: Path) -> None:
    graph = _huge_graph(tmp_path / "decode.onnx")
    with OrtRunner({GraphKind.DECODE: graph}) as runner:
        assert runner.run(GraphKind.DECODE, {"input_ids": np.array([4], dtype=np.int64)})["y"].tolist() == [0.0] * 4
        with pytest.raises(MemoryLimitError) as err:
            runner.run(GraphKind.DECODE, {"input_ids": np.array([HUGE], dtype=np.int64)})
    assert str(err.value) == (  # parity's sessions have no arena (ort_runner): std::bad_alloc names no size
        f"memory: {graph}: a run at batch 1: ONNX Runtime could not allocate a buffer:"
        f" out of memory (this machine has 16.0 GiB); {WAY_OUT}"
    )


def _failure(graph: Path, feed: np.ndarray) -> Exception:
    """The exception ONNX Runtime itself raises running ``graph`` on ``feed``."""
    try:
        ort_session(graph).run(None, {"input_ids": feed})
    except Exception as exc:  # onnxruntime's own classes (Fail, InvalidArgument, ...)
        return exc
    raise AssertionError("the run did not fail")


def test_any_other_run_out_of_memory_is_one_line_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exc = _failure(_huge_graph(tmp_path / "model.onnx"), np.array([HUGE], dtype=np.int64))
    assert type(exc).__module__.startswith("onnxruntime") and "BFCArena" in str(exc), exc
    with pytest.raises(SystemExit) as code:
        cli._exit_for(exc)
    assert code.value.code == 1
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: memory: a graph: ONNX Runtime could not allocate a buffer of {4 * HUGE} bytes (262144.0 GiB):"
        f" out of memory (this machine has 16.0 GiB); {WAY_OUT}\n"
    )


def test_another_onnx_runtime_failure_is_not_taken_for_memory(tmp_path: Path) -> None:
    exc = _failure(
        _huge_graph(tmp_path / "model.onnx"), np.array([[1]], dtype=np.int64)
    )  # a rank the graph does not take
    assert type(exc).__module__.startswith("onnxruntime") and not allocation_failure(exc), exc
    with pytest.raises(type(exc)):
        cli._exit_for(exc)  # a bug's traceback, as before
