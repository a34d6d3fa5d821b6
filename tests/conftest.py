from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from kiln_testing import tiny_config, write_checkpoint

# CI (the default profile) draws the same examples every run: a fuzz finding is a bug to fix, not a
# random red build. Explore with fresh examples: python -m pytest --hypothesis-profile explore
# tests/export/test_fuzz.py (add --hypothesis-seed N to replay a run).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _trace_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One trace cache for the run (``exporter.trace.cache``), shared by the xdist workers (their
    base directories' parent) and never the user's ~/.cache/kiln: an architecture the suite exports
    many times is traced once. Tests of the cache itself set their own."""
    base = tmp_path_factory.getbasetemp()
    os.environ["KILN_CACHE"] = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kiln-cache")


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> Path:
    """A tiny native checkpoint directory (config.json + model.safetensors)."""
    return write_checkpoint(tmp_path / "ckpt", tiny_config())
