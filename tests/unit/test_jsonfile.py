"""Every way a JSON file kiln reads (config.json, manifest.json, genai_config.json) can be bad is one
``KilnError`` naming the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.jsonfile import read_json_object


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", r"not valid JSON \(Expecting property name"),
        ("[1, 2]", "expected a JSON object, found list"),
        ('{"n_layers": ' + "9" * 5000 + "}", r"not JSON kiln reads \(ValueError: Exceeds the limit \(4300 digits\)"),
        ("[" * 100_000 + "]" * 100_000, r"not JSON kiln reads \(RecursionError"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
    ids=["truncated", "a list", "a 5000-digit integer", "nested 100000 deep", "not utf-8"],
)
def test_bad_json_is_one_error(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=rf"^config: {path}: {message}"):
        read_json_object(path, ConfigError, "missing")


def test_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    directory = f"config: {tmp_path / 'config.json'}: a directory, not a regular file; kiln reads only regular files"
    with pytest.raises(ConfigError, match="^" + re.escape(directory) + "$"):
        read_json_object(tmp_path / "config.json", ConfigError, "missing")
    with pytest.raises(ConfigError, match="^config: no config here$"):
        read_json_object(tmp_path / "absent.json", ConfigError, "no config here")
