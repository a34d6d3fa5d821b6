"""Reading a JSON object from a file with one clear error per way it can fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.inputs import read_input

__all__ = ["read_json_object"]


MAX_BYTES = 1 << 28  # no config or manifest kiln reads comes near this (a 32-layer export's manifest: ~0.3 MB)


def read_json_object(path: Path, error: type[KilnError], missing: str, *, links: bool = True) -> dict[str, Any]:
    """The object in ``path``; a missing file raises ``error(missing)``, anything else that is
    not a JSON object raises ``error`` naming the file and what was found. Read through
    ``inputs.read_input``: a FIFO, a device or a file over ``MAX_BYTES`` is refused unopened, and
    with ``links`` False (a file kiln wrote itself: an export's manifest.json) so is a link."""
    try:
        data = json.loads(read_input(path, error, MAX_BYTES, what="a config or manifest", links=links).decode("utf-8"))
    except FileNotFoundError:
        raise error(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except (
        ValueError,
        RecursionError,
    ) as exc:  # an integer of more than 4300 digits; nesting deeper than Python's stack
        raise error(
            f"{path}: not JSON kiln reads ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'too deep'})"
        ) from None
    except OSError as exc:  # a directory of that name, no permission
        raise error(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
