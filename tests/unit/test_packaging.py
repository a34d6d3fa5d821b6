"""The wheel users install holds every module of kiln and nothing else (a hand-kept package list once
missed three subpackages: every non-editable install failed at ``kiln --version``, and the editable
install the tests use hid it). `.ci/wheel` installs the wheel outside the checkout and runs kiln from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_KILN = ("tests", "benchmarks", "docs", "build", "dist")


def _checkout_files() -> list[Path]:
    """The files a clean clone would have (tracked, and new ones git does not ignore)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [Path(line) for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def _clean_copy(to: Path) -> Path:
    """The checkout's files alone: setuptools reuses a build/ folder left in a checkout, which once made a
    wheel of a broken package list look complete."""
    for path in _checkout_files():
        (to / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, to / path)
    return to


def _repository_modules() -> set[str]:
    """Every .py file of the kiln package, as its path inside the wheel."""
    paths = [path for path in _checkout_files() if path.suffix == ".py"]
    return {f"kiln/{path.as_posix()}" for path in paths if path.parts[0] not in NOT_KILN and path.name != "setup.py"}


def test_the_wheel_holds_every_module_and_its_data(tmp_path: Path) -> None:
    source = _clean_copy(tmp_path / "src")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("kiln-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name for name in names if name.endswith(".py")} == _repository_modules()
    assert {
        "kiln/exporter/precision/kinds/__init__.py",
        "kiln/exporter/targets/onnx/__init__.py",
        "kiln/exporter/lora/__init__.py",
    } <= names
    assert "kiln/demo/checkpoint/model.safetensors" in names
    assert "kiln/exporter/artifacts/manifest.schema.json" in names
