"""Reading checkpoint weights safely and checking them against a module.

Weights come from ``model.safetensors`` (preferred) or a ``.pt``/``.bin`` file read with
``torch.load(weights_only=True)``: a pickle that would construct anything but tensors is refused
and its code never runs.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from kiln.errors import CheckpointError
from kiln.inputs import check_input
from kiln.plugins.base import non_finite

__all__ = [
    "WEIGHT_FILES",
    "Header",
    "find_weights",
    "read_state_dict",
    "state_header",
    "check_header",
    "apply_state_dict",
    "state_dtype",
]

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}

WEIGHT_FILES = ("model.safetensors", "model.pt", "pytorch_model.bin")
Header = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, dtype name), as a file's header states them


def find_weights(path: Path) -> Path:
    """The weights file of a checkpoint directory, or the file itself."""
    if path.is_file():
        return path
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    raise CheckpointError(f"{path}: no weights file; expected one of {', '.join(WEIGHT_FILES)}")


class _SafetensorsState(Mapping[str, Tensor]):
    """A safetensors file as a read-only mapping that reads one tensor at a time, so loading a
    checkpoint never holds a second full copy of its weights."""

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            # safetensors' safe_open is untyped
            self._keys: list[str] = list(self._file.keys())  # type: ignore[no-untyped-call]
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._keys:
            raise KeyError(key)
        try:
            # safetensors' safe_open is untyped
            tensor: Tensor = self._file.get_tensor(key)  # type: ignore[no-untyped-call]
            return tensor
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{self._path}: tensor {key} is unreadable ({_first_line(exc)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def header(self) -> Header:
        """Every tensor's shape and safetensors dtype name (``F32``, ``BF16``, ``I64``...), from the header."""
        out: Header = {}
        for key in self._keys:
            view = self._file.get_slice(key)  # type: ignore[no-untyped-call]  # safetensors' safe_open is untyped
            out[key] = (tuple(view.get_shape()), str(view.get_dtype()))
        return out

    def dtypes(self) -> set[torch.dtype]:
        """The floating-point dtypes the file stores, read from its header (no tensor is read)."""
        # untyped
        names = {self._file.get_slice(key).get_dtype() for key in self._keys}  # type: ignore[no-untyped-call]
        return {_SAFETENSORS_DTYPES[n] for n in names if n in _SAFETENSORS_DTYPES}

    def __len__(self) -> int:
        return len(self._keys)


def read_state_dict(weights: Path) -> Mapping[str, Tensor]:
    """Tensors by name, without executing any code from the file (a regular file: safetensors and
    torch open it by name, and would wait on a FIFO)."""
    check_input(weights, CheckpointError, None)
    if weights.suffix == ".safetensors":
        return _SafetensorsState(weights)
    if weights.suffix in (".pt", ".pth", ".bin"):
        try:
            with warnings.catch_warnings():  # torch warns about the pickle protocol before refusing it
                warnings.simplefilter("ignore")
                state = torch.load(weights, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(_pickle_refusal(weights, exc)) from None
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(f"{weights}: not a readable PyTorch file ({_first_line(exc)})") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise CheckpointError(f"{weights}: expected a dict of tensors (a state_dict)")
        return state
    raise CheckpointError(f"{weights}: unknown weights format {weights.suffix!r}; use .safetensors")


def state_dtype(state: Mapping[str, Tensor]) -> torch.dtype:
    """The dtype a checkpoint's weights are held in: the one floating-point dtype it stores
    (float32 when it mixes several, or stores float64)."""
    found = (
        state.dtypes()
        if isinstance(state, _SafetensorsState)
        else {t.dtype for t in state.values() if t.is_floating_point()}
    )
    return (
        found.pop()
        if len(found) == 1 and next(iter(found)) in (torch.float32, torch.bfloat16, torch.float16)
        else torch.float32
    )


_SHOWN = 5  # problems (and names in a list) an error shows before "and N more"


def state_header(state: Mapping[str, Tensor]) -> Header:
    """Every tensor's shape and dtype; for a safetensors file from its header alone (no tensor read)."""
    if isinstance(state, _SafetensorsState):
        return state.header()
    return {key: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for key, t in state.items()}


def _floating(dtype: str) -> bool:
    """Whether a dtype name (torch's ``float16`` or safetensors' ``F16``/``BF16``) is floating-point."""
    return dtype.startswith(("F", "BF", "float", "bfloat"))


def _capped(items: list[str]) -> list[str]:
    return items if len(items) <= _SHOWN else [*items[:_SHOWN], f"and {len(items) - _SHOWN} more"]


def check_header(module: nn.Module, header: Header, source: Path) -> dict[str, str]:
    """Compare the names, shapes and dtypes of ``header`` with ``module``'s tensors (a meta
    module will do: nothing is read or allocated); raise one ``CheckpointError`` naming every
    missing, unexpected, mis-shaped and non-float tensor. Returns each canonical name's key."""
    expected = _expected_tensors(module)
    aliases = {alias for _, names in expected.values() for alias in names}
    chosen = {
        name: present[0] for name, (_, names) in expected.items() if (present := [n for n in names if n in header])
    }
    missing = sorted(name for name in expected if name not in chosen)
    unexpected = sorted(key for key in header if key not in aliases)
    problems = [f"missing keys {_capped(missing)}"] if missing else []
    problems += [f"unexpected keys {_capped(unexpected)}"] if unexpected else []
    tensors: list[str] = []
    for name, key in sorted(chosen.items()):
        (shape, dtype), want = header[key], tuple(expected[name][0].shape)
        if shape != want:
            tensors.append(f"{key} has shape {list(shape)}, the config needs {list(want)}")
        elif not _floating(dtype):
            tensors.append(f"{key} has dtype {dtype}, expected a floating-point tensor")
    problems += _capped(tensors)
    if problems:
        raise CheckpointError(f"{source}: weights do not match the config: " + "; ".join(problems))
    return chosen


def apply_state_dict(module: nn.Module, state: Mapping[str, Tensor], source: Path) -> None:
    """Copy ``state`` into ``module`` once its header matches (``check_header``), one tensor in
    memory at a time, naming every non-finite tensor in one error."""
    chosen = check_header(module, state_header(state), source)
    expected = _expected_tensors(module)
    problems: list[str] = []
    for name, key in sorted(chosen.items()):
        tensor, want = state[key], expected[name][0]
        if bad := non_finite(tensor):
            problems.append(f"{key} has {bad} non-finite values (NaN or Inf)")
        elif not problems:
            with torch.no_grad():
                want.copy_(tensor.to(want.dtype))
        del tensor
    if problems:
        raise CheckpointError(f"{source}: weights do not match the config: " + "; ".join(_capped(problems)))


def _expected_tensors(module: nn.Module) -> dict[str, tuple[Tensor, list[str]]]:
    """Persistent parameters and buffers by first name, with every name the same tensor goes by
    (a tied LM head is stored once, under either name, as safetensors requires)."""
    out: dict[str, tuple[Tensor, list[str]]] = {}
    first: dict[int, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            out[first[id(tensor)]][1].append(name)
            continue
        first[id(tensor)] = name
        out[name] = (tensor, [name])
    return out


def _pickle_refusal(weights: Path, exc: pickle.UnpicklingError) -> str:
    """kiln's own words for a pickle ``torch.load(weights_only=True)`` refused: what it would have
    built (torch's message names it), why that is refused, and how to convert the file."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = f"an object of {found.group(1)}" if found else "objects other than tensors"
    target = weights.parent / "model.safetensors"  # what find_weights reads first
    return (
        f"{weights}: refused to load: this pickle would build {what}, and unpickling anything but tensors can run code"
        " from the file, which kiln never does; if you trust the file, convert it to safetensors once (kiln "
        f"then reads {target}):"
        f" python -c \"import torch; from safetensors.torch import save_file; m = torch.load('{weights}', "
        "weights_only=False);"
        " sd = m.state_dict() if hasattr(m, 'state_dict') else m;"
        f" save_file({{k: v.contiguous().clone() for k, v in sd.items() if torch.is_tensor(v)}}, '{target}')\""
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
