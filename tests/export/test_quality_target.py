"""Quality measures the graphs that carry the export's quantization (issue 40 item 3): with
``--target ort --ort-int8`` the portable graphs are fp32 and only the ort graphs are int8, so
quality is measured on the ort graphs (KL above 0), at int8's threshold, and the export's last
line, parity.json/md and the manifest name them; where the portable graphs are
quantized themselves (``--int4 --target ort``) they stay the measured set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])")

from kiln.cli import main  # noqa: E402
from kiln.exporter.artifacts.manifest import read  # noqa: E402
from kiln.exporter.contract.io import CacheUpdate  # noqa: E402
from kiln.exporter.options import ExportOptions, Precision  # noqa: E402
from kiln.exporter.parity.quality import QualityPlan  # noqa: E402
from kiln.exporter.parity.quality_text import QualityText  # noqa: E402
from kiln.exporter.precision.kinds import Int4  # noqa: E402
from kiln.exporter.quality_gate import measured_graphs  # noqa: E402
from kiln.exporter.targets.base import TargetGraphs  # noqa: E402
from kiln_testing import save_base  # noqa: E402

ORT_INT8 = {"target": "ort", "target_flags": {"ort_int8": True}}


@pytest.fixture(scope="module")
def ort_int8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny Llama exported ``--target ort --ort-int8`` through the CLI: its directory and last line."""
    root = tmp_path_factory.mktemp("quality_ort")
    ckpt, out = save_base("llama", root / "ckpt"), root / "out"
    args = ["export", "--model", str(ckpt), "--out", str(out), "--target", "ort", "--ort-int8", "--parity-tokens", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out, result.output.strip().splitlines()[-1]


def test_ort_int8_quality_is_measured_on_the_ort_graphs(ort_int8: tuple[Path, str]) -> None:
    out, last = ort_int8
    data = json.loads((out / "reports" / "parity.json").read_text())["quality"]
    assert data["graphs"] == "ort" and data["kl"] > 0, data  # the int8 weights cost something; fp32 graphs cost ~0
    assert data["source"] == "random tokens (no real text)" and data["threshold"] is None and data["passed"], data
    assert f"-> {data['perplexity_graphs']:.4g} (ort graphs) over " in last, last
    assert f"quality (recorded: no real text): top-1 agreement {data['agreement']:.3f}, KL " in last, last
    manifest = read(out).parity.quality
    assert manifest is not None and manifest.graphs == "ort" and manifest.kl == data["kl"], manifest
    text = (out / "reports" / "parity.md").read_text()
    assert "The ort graphs against the checkpoint's model, teacher-forced on random tokens" in text


def test_kiln_check_measures_the_ort_graphs_again(ort_int8: tuple[Path, str]) -> None:
    """``kiln check`` measures quality on the set the export recorded (the ort graphs), the same figures
    on the same random tokens (KL above 0: not the fp32 portable graphs')."""
    out, _ = ort_int8
    result = CliRunner().invoke(main, ["check", str(out)])
    assert result.exit_code == 0, result.output
    exported = json.loads((out / "reports" / "parity.json").read_text())["quality"]
    last = result.output.strip().splitlines()[-1]
    assert "(ort graphs) over " in last and f"KL {exported['kl']:.3g}" in last, (last, exported)


def _plan() -> QualityPlan:
    text = QualityText("the calibration data (x.txt)", True, (np.arange(4, dtype=np.int64),))
    return QualityPlan(text, None)


def _written(precision: Precision) -> TargetGraphs:
    return TargetGraphs("ort", precision, {}, None, {}, CacheUpdate.GROWN)  # type: ignore[arg-type]  # no weights read


def test_the_measured_set_and_its_gate_follow_the_quantized_graphs() -> None:
    """fp32 portable + int8 target: the target, at int8's 0.9 (or the gate given, or none when off);
    int4 portable + int4 target: the portable graphs, the plan unchanged; nothing quantized: unchanged."""
    plan = _plan()
    int8 = measured_graphs(plan, ExportOptions.from_flags(**ORT_INT8), [_written(Precision.INT8)])  # type: ignore[arg-type]
    assert (int8.target, int8.graphs, int8.threshold) == ("ort", "ort", 0.9), int8
    given = ExportOptions.from_flags(quality_gate="0.95", **ORT_INT8)  # type: ignore[arg-type]
    assert measured_graphs(plan, given, [_written(Precision.INT8)]).threshold == 0.95
    off = ExportOptions.from_flags(quality_gate="off", **ORT_INT8)  # type: ignore[arg-type]
    assert measured_graphs(plan, off, [_written(Precision.INT8)]).threshold is None
    int4 = Precision.of(Int4())
    both = measured_graphs(plan, ExportOptions(precision=int4, target="ort"), [_written(int4)])
    assert both is plan and both.graphs == "portable"
    assert measured_graphs(plan, ExportOptions(target="ort"), [_written(Precision.FP32)]) is plan
