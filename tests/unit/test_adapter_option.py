"""``kiln export --adapter DIR[:WEIGHT]``: how the option's text becomes a directory and a weight."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cli_options import _adapters
from kiln.errors import ConfigError
from kiln.exporter.options import Adapter, ExportOptions


def test_the_weight_follows_the_last_colon_when_it_is_a_number() -> None:
    given = ("a", "a:0.5", "b:-2", "c:d", "dir:1:0.25", "odd:1:1", "x:", ":3", r"C:\adapters\one")
    assert _adapters(None, None, given) == (  # type: ignore[arg-type]  # click's context and parameter are unused
        (Path("a"), 1.0),
        (Path("a"), 0.5),
        (Path("b"), -2.0),
        (Path("c:d"), 1.0),
        (Path("dir:1"), 0.25),
        (Path("odd:1"), 1.0),
        (Path("x:"), 1.0),
        (Path(":3"), 1.0),
        (Path(r"C:\adapters\one"), 1.0),
    )


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_must_be_finite(weight: float) -> None:
    with pytest.raises(ConfigError, match=r"^config: --adapter a: its weight must be a finite number, found "):
        Adapter(Path("a"), weight)


def test_adapter_directories_are_inputs_the_output_never_replaces() -> None:
    options = ExportOptions.from_flags(adapters=(Adapter(Path("first")), Adapter(Path("second"), 0.5)))
    assert options.data_inputs[-2:] == (Path("first"), Path("second"))


def test_a_checkpoint_goes_by_its_last_path_component() -> None:
    """The names an adapter's base_model_name_or_path is compared with (lower case)."""
    from kiln.plugins.hf.adapter import base_names

    snapshot = Path("/cache/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd")
    assert base_names("Qwen/Qwen2.5-0.5B", snapshot) == {"qwen2.5-0.5b", "0123abcd"}
    assert base_names("models/Llama-3.2-1B/", Path("models/Llama-3.2-1B")) == {"llama-3.2-1b"}
