"""Precision kinds and their composition (``exporter.precision.kinds``): names, roles, implied
kinds, the flags each kind declares, its refusals, and the manifest schema kept to the registry."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from kiln.errors import ConfigError
from kiln.exporter.options import ExportOptions, PLETables, Precision
from kiln.exporter.plan import plan
from kiln.exporter.precision import TOLERANCES
from kiln.exporter.precision.kinds import Fp8, Fp16, Int4, Int8
from kiln.exporter.precision.kinds.base import Needs, Role
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.exporter.precision.kinds.plan import names
from kiln.exporter.precision.kinds.registry import kinds
from kiln.exporter.tolerance import FP32


def _flags(**given: Any) -> dict[str, Any]:
    """``kiln export``'s precision flags as click passes them (every one, defaults unless given)."""
    flags: dict[str, Any] = {}
    for kind in kinds():
        flags[kind.name] = False
        for flag in (f for group in kind.flags for f in group):
            flags[flag.dest] = () if flag.multiple else False if flag.is_flag else flag.default
    unknown = set(given) - set(flags)
    assert not unknown, unknown
    return flags | given


def test_names_roles_and_implied_kinds() -> None:
    assert names() == ("fp32", "fp16", "int8", "fp8", "int4", "int8+fp16", "int4+fp16")
    assert [(k.name, k.role) for k in kinds()] == [
        ("fp16", Role.FLOAT),
        ("int8", Role.MATMULS),
        ("fp8", Role.MATMULS),
        ("int4", Role.MATMULS),
    ]
    assert Precision.of(Fp16(), Int8()).value == "int8+fp16"  # the MatMuls' kind first, whatever the order given
    fp8 = Precision.of(Fp8())
    assert fp8.value == "fp8" and fp8.kinds == (Fp8(), Fp16()) and fp8.float16  # fp8 implies fp16, not named
    assert Precision.of(Fp8(), Fp16(keep_fp32=("Softmax",))).get("fp16") == Fp16(keep_fp32=("Softmax",))
    assert Precision.of() is Precision.FP32 and Precision.FP32.value == "fp32" and Precision.FP32.tolerance is FP32
    assert (
        Precision.parse("int4+fp16") is Precision.INT4_FP16 is Precision.of(Fp16(), Int4())
    )  # equal precisions are one object
    assert Precision.of(Int4(method=Int4Method.RTN)) is not Precision.INT4  # its options are part of it


def test_what_follows_from_the_kinds() -> None:
    assert [Precision.parse(n).kv_dtype for n in names()] == [
        "float32",
        "float16",
        "float32",
        "float16",
        "float32",
        "float16",
        "float16",
    ]
    assert {n: Precision.parse(n).min_bytes_per_weight for n in names()} == {
        "fp32": 4.0,
        "fp16": 2.0,
        "int8": 1.0,
        "fp8": 1.0,
        "int4": 0.5,
        "int8+fp16": 1.0,
        "int4+fp16": 0.5,
    }
    assert {n: Precision.parse(n).weight_only_float for n in names()} == {
        "fp32": None,
        "fp16": None,
        "int8": None,
        "fp8": None,
        "int4": "fp32",
        "int8+fp16": None,
        "int4+fp16": "fp16",
    }
    assert [Precision.parse(n).graph_opset(19) for n in names()] == [19, 19, 19, 19, 21, 19, 21]
    assert Precision.FP8.min_compute_capability == (8, 9, "Ada (L4, L40S, RTX 40) or Hopper (H100, H200) or later")
    assert (
        Precision.INT4_FP16.min_compute_capability == (8, 0, "Ampere (A100, A10, RTX 30) or later")
        and Precision.FP16.min_compute_capability is None
    )
    assert (
        TOLERANCES["int8+fp16"] == TOLERANCES["int8"] == TOLERANCES["fp8"]
        and TOLERANCES["int4+fp16"] == TOLERANCES["int4"]
    )
    assert TOLERANCES["fp16"] == Fp16.tolerance and TOLERANCES["fp32"] == FP32
    assert Precision.INT8.needs(Needs.RANGES) and not Precision.INT4.needs(Needs.RANGES)
    assert Precision.INT4.needs(Needs.HESSIANS) and Precision.of(Int4(method=Int4Method.RTN)).needs(Needs.NOTHING)
    assert ExportOptions.from_flags(precision=Precision.INT8, calib_data="synthetic").samples == 32
    assert ExportOptions.from_flags(precision=Precision.INT4, calib_data="synthetic").samples == 256


def test_refusals_are_one_line() -> None:
    with pytest.raises(
        ConfigError, match="^config: --int8 and --int4 are different precisions of the same MatMuls; choose one$"
    ):
        Precision.of(Int4(), Int8())
    with pytest.raises(
        ConfigError,
        match=r"^config: precision 'int3' is not one kiln writes; kiln writes fp32, fp16, int8, fp8, int4, int8\+fp16, "
        r"int4\+fp16$",
    ):
        Precision.parse("int3")
    with pytest.raises(ConfigError, match="^config: precision 'int8\\+' is not one kiln writes"):
        Precision.parse("int8+")
    with pytest.raises(ConfigError, match="^config: --int4-block must be one of 16, 32, 64, 128, 256, found 100$"):
        Int4(block=100)
    with pytest.raises(ConfigError, match="^config: --fp8 needs --opset 19 or later \\(fp16 Q/DQ scales\\), found 18$"):
        plan(ExportOptions.from_flags(precision=Precision.FP8, calib_data="synthetic", opset=18))
    with pytest.raises(
        ConfigError, match="^config: --calib-data only applies to --int8, --fp8 and --int4 \\(method gptq\\) exports$"
    ):
        plan(ExportOptions.from_flags(precision=Precision.of(Int4(method=Int4Method.RTN)), calib_data="synthetic"))
    with pytest.raises(ConfigError, match="^config: --auto-keep-fp32 cannot be combined with --ple-tables input$"):
        plan(ExportOptions.from_flags(precision=Precision.of(Fp16(auto_keep_fp32=True)), ple_tables=PLETables.INPUT))


def test_flags_choose_the_kinds_and_fill_their_options() -> None:
    assert Precision.from_flags(_flags()) is Precision.FP32
    flags = _flags(int4=True, fp16=True, int4_block="32", int4_method="rtn", int4_float=("*.fc2",))
    assert Precision.from_flags(flags) is Precision.of(
        Int4(block=32, method=Int4Method.RTN, float_rules=("*.fc2",)), Fp16()
    )
    assert flags == {}  # every precision flag taken out: the rest are ExportOptions' fields
    assert Precision.from_flags(_flags(fp8=True, keep_fp32=("Softmax",))).get("fp16") == Fp16(
        keep_fp32=("Softmax",)
    )  # the fp16 fp8 implies takes its flags


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(int4_method="rtn"), "--int4-method and --int4-block only apply to --int4 exports"),
        (dict(int4_block="64"), "--int4-method and --int4-block only apply to --int4 exports"),
        (dict(int4_all_matmuls=True), "--int4-float and --int4-all-matmuls only apply to --int4 exports"),
        (dict(int8=True, int4_float=("*.fc2",)), "--int4-float and --int4-all-matmuls only apply to --int4 exports"),
        (dict(fp16=True, fp8_float=("*.fc2",)), "--fp8-float only applies to --fp8 exports"),
        (dict(int8_all_matmuls=True), "--int8-float and --int8-all-matmuls only apply to --int8 exports"),
        (dict(auto_keep_fp32=True), "--keep-fp32 and --auto-keep-fp32 only apply to --fp16 exports"),
        (dict(int8=True, fp8=True), "--int8 and --fp8 are different precisions of the same MatMuls; choose one"),
    ],
)
def test_flags_without_their_kind_are_refused(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Precision.from_flags(_flags(**given))
    assert str(err.value) == f"config: {message}"


def test_the_schema_follows_the_registry() -> None:
    """The manifest schema is the published contract: its precision names and the conditions on
    each kind's records are what the registry says (a new kind fails here until they are added)."""
    schema = json.loads(resources.files("kiln.exporter.artifacts").joinpath("manifest.schema.json").read_text())
    assert sorted(schema["$defs"]["precision"]["enum"]) == sorted(names())
    conditions = [
        block["if"]["properties"]["precision"]
        for block in schema["allOf"]
        if "precision" in block["if"].get("properties", {})
    ]
    found = sorted(sorted(c["enum"]) if "enum" in c else [c["const"]] for c in conditions)

    def having(test: Any) -> list[str]:
        return sorted(n for n in names() if test(Precision.parse(n)))

    wanted = [having(lambda p: p.needs(Needs.RANGES))] + [having(lambda p, k=k.name: k in p) for k in kinds()]
    assert found == sorted(wanted)
