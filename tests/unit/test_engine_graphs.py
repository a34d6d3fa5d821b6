"""Which graphs ``kiln build`` builds (engine/graphs.py): the ``--target onnx`` graphs where the
export has them and TensorRT is 10.15+, the portable ones otherwise, ``--graphs onnx`` refused by
name where either is missing. Pure: the TensorRT version is passed in."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError, EngineError
from kiln.exporter.engine.graphs import choose_graphs, has_onnx_graphs
from kiln.exporter.engine.options import GraphSet
from kiln_testing import typed_manifest, with_std_target

PORTABLE_ONLY = {"limits": {"max_batch": 8, "max_context": 48}, "graphs": {}}
STD, PORTABLE = typed_manifest(with_std_target(dict(PORTABLE_ONLY))), typed_manifest(PORTABLE_ONLY)


@pytest.mark.parametrize(
    ("version", "graphs"),
    [
        ((10, 12, 0, 1), GraphSet.PORTABLE),
        ((10, 14, 1), GraphSet.PORTABLE),
        ((10, 15, 0), GraphSet.ONNX),
        ((10, 16, 1, 11), GraphSet.ONNX),
        ((11, 1, 0, 106), GraphSet.ONNX),
    ],
)
def test_auto_takes_the_std_graphs_from_10_15(version: tuple[int, ...], graphs: GraphSet) -> None:
    choice = choose_graphs(STD, GraphSet.AUTO, version)
    assert choice.graphs is graphs
    found = ".".join(map(str, version))
    if graphs is GraphSet.ONNX:
        assert choice.reason == f"the export has --target onnx graphs and TensorRT {found} parses them (10.15+)"
    else:
        assert (
            choice.reason.startswith(f"TensorRT {found} is older than 10.15, the first whose ONNX parser imports")
            and "TensorScatter" in choice.reason
        )
    assert choice.to_dict() == {"set": graphs.value, "reason": choice.reason}


def test_auto_without_the_target_is_portable() -> None:
    assert not has_onnx_graphs(PORTABLE) and has_onnx_graphs(STD)
    choice = choose_graphs(PORTABLE, GraphSet.AUTO, (11, 1, 0))
    assert (choice.graphs, choice.reason) == (
        GraphSet.PORTABLE,
        "the export has no --target onnx graphs (manifest targets.onnx)",
    )


def test_portable_by_name_on_any_version() -> None:
    for m in (STD, PORTABLE):
        assert choose_graphs(m, GraphSet.PORTABLE, (11, 1)).graphs is GraphSet.PORTABLE


def test_onnx_by_name() -> None:
    assert choose_graphs(STD, GraphSet.ONNX, (10, 15, 1)).to_dict() == {
        "set": "onnx",
        "reason": "--graphs onnx, TensorRT 10.15.1",
    }
    with pytest.raises(
        EngineError,
        match=r"--graphs onnx needs TensorRT 10.15 or newer \(the first whose ONNX parser imports TensorScatter, "
        r"RotaryEmbedding and RMSNormalization\), found TensorRT 10.14.1",
    ):
        choose_graphs(STD, GraphSet.ONNX, (10, 14, 1))
    with pytest.raises(
        ConfigError,
        match=r"--graphs onnx builds the --target onnx graphs \(onnx/\*.std.onnx\), and this export has none",
    ):
        choose_graphs(PORTABLE, GraphSet.ONNX, (11, 1))
