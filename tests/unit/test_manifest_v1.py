"""Version-1 manifests (kiln before the target seam) are still read: their pass fields move into
``passes``, their ``--target ort`` entry gains ``kv_cache`` and ``record`` (``manifest_v1``).

The fixtures in tests/data/manifest_v1/ are the manifests the previous kiln (main at 12e4769 and
its issue-25 fixes) wrote for the demo: ``--fp16``, ``--int8 --fp16``, ``--target ort --int4``,
``--target ort --ort-int8``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.manifest_v1 import upgrade_v1
from kiln_testing import downgrade

DATA = Path(__file__).resolve().parents[1] / "data" / "manifest_v1"
CASES = ("fp16", "int8", "ort4", "ort8")


def _v1(case: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{case}.json").read_text())
    assert data["manifest_version"] == 1
    return data


@pytest.mark.parametrize("case", CASES)
def test_a_version_1_manifest_reads_as_version_2(case: str, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(_v1(case)))
    manifest = manifest_mod.read(tmp_path)
    assert manifest.manifest_version == 2
    v1 = _v1(case)
    for kind, graph in v1["graphs"].items():
        entry = manifest.graphs[kind]
        assert entry.report("fp16").get("fp32_nodes") == graph.get("fp32_nodes")
        assert entry.report("int8").get("nodes") == graph.get("int8_nodes")
        assert entry.report("int4").get("nodes") == graph.get("int4_nodes")


@pytest.mark.parametrize("case", CASES)
def test_downgrade_inverts_the_upgrade(case: str) -> None:
    v1 = _v1(case)
    assert downgrade(upgrade_v1(v1, "fixture")) == v1


def test_the_ort_target_gains_its_contract_and_record() -> None:
    int8 = upgrade_v1(_v1("ort8"), "fixture")["targets"]["ort"]
    assert int8["kv_cache"] == "shared"  # every layer's decode attention fused: GQA writes the cache in place
    assert int8["record"] == {"int8": {"op": "MatMulNBits", "bits": 8, "block_size": 128, "accuracy_level": 4}}
    assert int8["graphs"]["decode"]["passes"]["attention"]["layers"] == [0, 1, 2, 3]
    assert (
        "attention" not in int8["graphs"]["model"]["passes"] and "decode_mask" not in int8["graphs"]["model"]["passes"]
    )  # v1's placeholders
    assert len(int8["graphs"]["decode"]["passes"]["nbits_int8"]["nodes"]) == len(
        _v1("ort8")["targets"]["ort"]["graphs"]["decode"]["int8_nodes"]
    )
    int4 = upgrade_v1(_v1("ort4"), "fixture")["targets"]["ort"]
    assert int4["record"] == {"int4": {"op": "MatMulNBits", "bits": 4, "block_size": 128, "accuracy_level": 4}}


@pytest.mark.parametrize("case", CASES)
def test_an_upgraded_manifest_matches_the_schema(case: str) -> None:
    jsonschema = pytest.importorskip(
        "jsonschema", reason="the manifest's JSON Schema is checked with jsonschema (a test dependency)"
    )
    schema = json.loads((Path(manifest_mod.__file__).parent / "manifest.schema.json").read_text())
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(upgrade_v1(_v1(case), "fixture"))]
    assert errors == []
