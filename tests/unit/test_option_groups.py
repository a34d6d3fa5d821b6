"""``ExportOptions`` as grouped plain data (``exporter.option_groups``): each flag of kiln export lands in
its group's field, every group field has exactly one flag, and the groups are what a stage reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest

from kiln.errors import ConfigError
from kiln.exporter.option_groups import FLAGS, GROUPS
from kiln.exporter.options import (
    CalibrationOptions,
    ExportOptions,
    GraphOptions,
    LogitsMode,
    LoraOptions,
    ParityOptions,
    PLEOptions,
    Precision,
)


def test_every_group_field_has_one_flag_and_every_flag_one_field() -> None:
    fields = {(group, f.name) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    assert sorted(FLAGS.values()) == sorted(fields)
    own = {f.name for f in dataclasses.fields(ExportOptions)}
    assert set(GROUPS) <= own and not set(FLAGS) & own  # a flag names a group's field or an option of its own


def test_kiln_export_s_flags_are_the_groups_and_the_options_own_fields() -> None:
    """Every flag kiln export gives ``from_flags`` is a group's or the options' own (the precision kinds'
    and the targets' flags are taken out before: ``Precision.chosen``, ``Target.flags``)."""
    from kiln.cli import main
    from kiln.exporter.precision.kinds import kinds
    from kiln.exporter.targets import targets

    export = main.commands["export"]
    dests = {p.name for p in export.params if isinstance(p, click.Option)}
    kind_flags = {k.name for k in kinds()} | {f.dest for k in kinds() for group in k.flags for f in group}
    target_flags = {f.dest for t in targets() for f in t.flags}
    command = {"model", "out", "as_json"}  # the command's own: not options of the export
    assert set(FLAGS) <= dests
    own = {f.name for f in dataclasses.fields(ExportOptions)} - set(GROUPS) - {"precision", "target_flags"}
    assert dests - kind_flags - target_flags - command - set(FLAGS) == own


def test_from_flags_fills_each_group() -> None:
    options = ExportOptions.from_flags(
        max_batch=2,
        logits=LogitsMode.LAST,
        ple_extend=96,
        calib_data="synthetic",
        calib_samples=4,
        parity_tokens=8,
        eval_data=Path("text.txt"),
        lora_slots=4,
        lora_targets=("q_proj",),
        precision=Precision.INT8,
        target="ort",
        force=True,
    )
    assert options == ExportOptions(
        precision=Precision.INT8,
        target="ort",
        graphs=GraphOptions(max_batch=2, logits=LogitsMode.LAST),
        ple=PLEOptions(extend=96),
        calibration=CalibrationOptions(data="synthetic", samples=4),
        parity=ParityOptions(tokens=8, eval_data=Path("text.txt")),
        lora=LoraOptions(slots=4, targets=("q_proj",)),
        force=True,
    )
    assert options.graphs.last_logits_only and options.samples == 4
    assert options.data_inputs == (Path("text.txt"),)  # synthetic calibration data is no file
    assert ExportOptions.from_flags() == ExportOptions()


def test_values_wrong_in_several_groups_are_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        ExportOptions.from_flags(max_batch=0, calib_samples=0, parity_tokens=0, lora_targets=("q",))
    assert str(err.value) == (
        "config: --max-batch must be at least 1, found 0 | --calib-samples must be at least 1, found 0 | "
        "--lora-targets only applies with --lora-slots RANK | parity tokens must be at least 1, found 0"
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_batches'"):
        ExportOptions.from_flags(max_batches=2)  # a misspelt flag is no option
