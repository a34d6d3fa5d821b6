from __future__ import annotations

from pathlib import Path

import pytest
from kiln_testing import tiny_config, write_checkpoint


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> Path:
    """A tiny native checkpoint directory (config.json + model.safetensors)."""
    return write_checkpoint(tmp_path / "ckpt", tiny_config())
