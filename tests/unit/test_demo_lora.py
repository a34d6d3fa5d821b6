"""``python -m kiln.demo.lora`` without the hf extra: one line naming what is missing and how to install it
(it raised a raw ModuleNotFoundError), and nothing written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kiln.demo import lora


def test_without_the_hf_extra_one_line_and_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert lora.main([str(tmp_path / "lora")]) == 1
    assert (
        capsys.readouterr().err
        == 'error: python -m kiln.demo.lora needs peft (the hf extra): pip install -e ".[hf]" in kiln\'s checkout, '
        'or pip install "kiln-*.whl[hf]" beside a wheel\n'
    )
    assert not (tmp_path / "lora").exists()


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert lora.main([]) == 2
    assert capsys.readouterr().err == "usage: python -m kiln.demo.lora DIR   (writes DIR/base and DIR/adapter)\n"
