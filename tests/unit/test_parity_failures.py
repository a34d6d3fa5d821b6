"""A parity result's failures as data (``ParityResult.failure_records``): each names the graph call or
generation path it belongs to, its check and the reference it was judged against, and its text is the
line ``failures()`` and the refusals have always shown."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.exporter.parity import GenerationCheck, ParityResult, TensorCheck
from kiln.exporter.parity.failure import ParityFailure
from kiln.exporter.parity.summary import shown_failures
from kiln.exporter.precision import TOLERANCES


def _tensor(precision: str, graph: str, passed: bool, batch: int = 2, empty_cache: bool = False) -> TensorCheck:
    tol = TOLERANCES[precision]
    return TensorCheck(
        graph, "logits", 0.003, 0.01, 0.99, None, tol.logits_atol, tol.logits_rtol, 0.002, 10.0, passed, None, batch,
        empty_cache,
    )  # fmt: skip


def _run(path: str, passed: bool, divergence: int | None) -> GenerationCheck:
    return GenerationCheck(path, 2, (5, 3), 8, 4, 0.5, divergence, 2, (0.1,) * 4, (10.0,) * 4, (0.5,) * 4, passed)


def _result(precision: str) -> ParityResult:
    """A failed logits check of decode at batch 1 and of model.onnx from an empty cache, a passed one,
    a failed generation run diverging at step 3 and one failed by near-ties only."""
    result = ParityResult("onnxruntime", precision, TOLERANCES[precision])
    result.tensors = [
        _tensor(precision, "decode", False, batch=1),
        _tensor(precision, "prefill", True),
        _tensor(precision, "model", False, empty_cache=True),
    ]
    result.generation = [_run("prefill+decode", False, 3), _run("model", True, None), _run("model", False, None)]
    return result


DECODE = (
    "decode (batch 1):logits max abs 0.002 (tolerance 1e-05 + 0.0001 x max|row| = 0.00101 at max|row| 10), "
    "cosine 0.990000 (at least 0.999999)"
)
MODEL = DECODE.replace("decode (batch 1)", "model (empty cache)")
DIVERGED = (
    "generation via prefill+decode, batch 2, 5, 3 (padded to 8): token match 0.500 (at least 1), "
    "first divergence at step 3"
)
TIES = (
    "generation via model, batch 2, 5, 3 (padded to 8): token match 0.500 (at least 1), every mismatch a near-tie (2)"
)


def test_each_failure_names_its_graph_call_or_generation_path_and_reads_as_before() -> None:
    result = _result("fp32")
    records = result.failure_records()
    assert [(f.kind, f.subject, f.check, f.reference) for f in records] == [
        ("tensor", "decode", "decode (batch 1):logits", ""),
        ("tensor", "model (empty cache)", "model (empty cache):logits", ""),
        ("generation", "prefill+decode", "prefill+decode, batch 2, 5, 3 (padded to 8)", ""),
        ("generation", "model", "model, batch 2, 5, 3 (padded to 8)", ""),
    ]
    assert result.failures() == [DECODE, MODEL, DIVERGED, TIES]
    assert [str(f) for f in records] == result.failures()


def test_a_target_set_is_named_by_its_graphs_and_paths_with_its_own_tolerances() -> None:
    result = _result("fp32").merge("ort", _result("int8"))
    ort = result.failure_records()[4:]
    assert [(f.subject, f.check) for f in ort] == [
        ("decode.ort", "decode.ort (batch 1):logits"),
        ("model.ort (empty cache)", "model.ort (empty cache):logits"),
        ("ort:prefill+decode", "ort:prefill+decode, batch 2, 5, 3 (padded to 8)"),
        ("ort:model", "ort:model, batch 2, 5, 3 (padded to 8)"),
    ]
    assert ort[0].message.endswith(f"cosine 0.990000 (at least {TOLERANCES['int8'].min_cosine:g})")
    assert ort[2].text.startswith(
        "generation via ort:prefill+decode, batch 2, 5, 3 (padded to 8): token match 0.500 (at least 0."
    )


@pytest.mark.parametrize("gates", [True, False])
def test_a_low_bit_export_names_each_failure_s_reference(gates: bool) -> None:
    """The quantized model's failures first, under its name; the checkpoint's model's after them only
    where agreement gates; the summary keeps the first of each graph under each reference."""
    against = dataclasses.replace(_result("fp32"), precision="int4")  # the int4 graphs at fp32's tolerances
    result = _result("int4").merge_quantized(None, against)
    result.agreement_gates = gates
    records = result.failure_records()
    exact = [f"against the int4 weights' model: {line}" for line in (DECODE, MODEL, DIVERGED, TIES)]
    agreement = [f.text for f in _result("int4").failure_records()]
    assert result.failures() == exact + ([f"agreement with the checkpoint's model: {a}" for a in agreement] * gates)
    assert {f.reference for f in records} == {"against the int4 weights' model"} | (
        {"agreement with the checkpoint's model"} if gates else set()
    )
    assert shown_failures(records, limit=1) == result.failures()  # 4 groups under each reference


def test_a_failure_under_a_second_reference_names_the_outer_one_first() -> None:
    inner = ParityFailure(kind="tensor", subject="decode", check="decode:logits", message="max abs 1", reference="b")
    outer = inner.against("a")
    assert outer.text == "a: b: decode:logits max abs 1"
    assert outer.group == ("a: b", "tensor", "decode") and inner.group == ("b", "tensor", "decode")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'message'"):
        outer.message = "max abs 2"  # type: ignore[misc]
