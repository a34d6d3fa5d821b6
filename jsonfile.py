"""Reading a JSON object from a file with one clear error per way it can fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

__all__ = ["read_json_object"]


def read_json_object(path: Path, error: type[KilnError], missing: str) -> dict[str, Any]:
    """The object in ``path``; a missing file raises ``error(missing)``, anything else that is
    not a JSON object raises ``error`` naming the file and what was found."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
