"""A Triton Inference Server model repository, ``DIR/triton/``, from an export's manifest.

Models (every name, dtype and shape comes from ``manifest.json``):

- ``NAME`` (``platform: "onnxruntime_onnx"``) serves ``model.onnx`` with sequence batching and
  implicit state: Triton keeps ``present.{i}.key/value`` of one request and feeds it back as
  ``past_key_values.{i}.key/value`` of the next request of the same sequence, starting from a zero
  initial state with a past length of 0. The graph and its external weights sit in
  ``NAME/1/model.onnx/`` (a directory holding ``model.onnx`` and the weights file), where the
  backend resolves external data; the weights are a reflink or a copy, never a hard link
  (``_place``).
- ``NAME_prefill`` and ``NAME_decode`` (``platform: "tensorrt_plan"``), when
  ``engines/prefill.plan`` and ``engines/decode.plan`` exist: stateless, dynamic batching; the
  client carries the KV tensors.

Facts from Triton's sources that this relies on (triton-inference-server/common
``protobuf/model_config.proto``, core ``src/backend_model.cc`` and
``src/sequence_batch_scheduler/sequence_batch_scheduler.cc``, onnxruntime_backend
``src/onnxruntime.cc``, server ``qa/common/gen_qa_implicit_models.py``):

- with ``max_batch_size > 0`` every dim list (inputs, outputs, states, initial states) excludes
  the batch dim; ``dynamic_batching`` and ``sequence_batching`` are one oneof;
- every sequence control is optional, and a ``control_input`` names a *model input* that receives
  the control value; the ONNX Runtime backend refuses a control whose input the graph lacks. kiln's
  graphs have no such input, so no control inputs are configured: Triton itself resets the state to
  ``initial_state`` when a request carries the ``sequence_start`` flag;
- an input with a variable dim and no ``allow_ragged_batch`` is batched only with requests of the
  same shape, so requests in one batch share their prompt and past lengths;
- LoRA slots (``--lora-slots``) are refused (``options.LORA_TRITON_REASON``), by ``kiln export
  --triton`` and ``kiln triton`` alike: both models batch (``max_batch_size > 0``), so Triton adds a
  batch dim to every input and the ONNX Runtime and TensorRT backends refuse a graph input whose
  first dim is not a variable batch (backend ``CompareDimsSupported``: "model configuration
  supports batching but first dimension ... is not a variable-size batch dimension"); a slot's
  ``A`` [in, r] / ``B`` [r, out] has none, and the graph applies one adapter to a whole batch, so
  the batchers would run one request's adapter on another's tokens. ``optional: true`` inputs
  would not change either. Serving slots needs per-request adapter routing (batch-1 models without
  the batchers, or a BLS/python model grouping requests by adapter), not written yet;
- ``initial_state`` dims may not be -1; a dim of 0 passes that check, but whether the server and
  backend accept a zero-length initial state at run time is unverified (no server here).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError, ConfigError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.hashing import rehash_subtree
from kiln.exporter.artifacts.manifest import Manifest, TensorEntry
from kiln.exporter.artifacts.staging import Owner, require_replaceable, staged_output
from kiln.exporter.artifacts.verify import require_verified, unlisted
from kiln.exporter.contract.io import BATCH, PAST_SEQ, GraphKind
from kiln.exporter.external_data import external_files
from kiln.exporter.options import LORA_TRITON_REASON, TRITON_NAME
from kiln.exporter.serving.triton_readme import IDLE_MICROSECONDS, readme

__all__ = [
    "TRITON_DIR",
    "ENGINE_FILES",
    "TRITON_DTYPES",
    "TritonModel",
    "triton_dims",
    "triton_models",
    "render_pbtxt",
    "repository_models",
    "write_triton_repo",
    "write_triton_models",
]

TRITON_DIR = "triton"
ENGINE_FILES = {GraphKind.PREFILL: "engines/prefill.plan", GraphKind.DECODE: "engines/decode.plan"}
TRITON_DTYPES = {
    "bool": "TYPE_BOOL",
    "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
}


class _Enum(str):
    """A protobuf enum value: written bare, not quoted."""


def _scalar(value: Any) -> str:
    if isinstance(value, _Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"no protobuf text for {value!r}")


def render_pbtxt(message: Mapping[str, Any], indent: int = 0) -> str:
    """Protobuf text format of a nested mapping: mappings are messages, lists are repeated fields."""
    pad = "  " * indent
    lines: list[str] = []
    for key, value in message.items():
        if isinstance(value, Mapping):
            lines.append(f"{pad}{key} {{")
            lines.append(render_pbtxt(value, indent + 1))
            lines.append(f"{pad}}}")
        elif isinstance(value, list) and value and isinstance(value[0], Mapping):
            lines.append(f"{pad}{key} [")
            for i, item in enumerate(value):
                lines.append(f"{pad}  {{")
                lines.append(render_pbtxt(item, indent + 2))
                lines.append(f"{pad}  }}{',' if i < len(value) - 1 else ''}")
            lines.append(f"{pad}]")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(line for line in lines if line)


@dataclasses.dataclass(frozen=True)
class TritonModel:
    """One model of the repository: its ``config.pbtxt`` and the files of version 1."""

    name: str
    config: dict[str, Any]
    files: dict[str, Path]  # path under NAME/1/ -> source file in the export directory
    comment: str = ""

    def config_text(self) -> str:
        header = "".join(f"# {line}\n" if line else "#\n" for line in self.comment.splitlines())
        return header + render_pbtxt(self.config) + "\n"


def _dtype(tensor: TensorEntry, graph: str) -> _Enum:
    try:
        return _Enum(TRITON_DTYPES[tensor.dtype])
    except KeyError:
        raise ArtifactError(
            f"triton: {graph}: {tensor.name} has dtype {tensor.dtype!r}, which has no Triton data type"
        ) from None


def triton_dims(tensor: TensorEntry, graph: str) -> list[int]:
    """The dims Triton wants with ``max_batch_size > 0``: the batch dim dropped, named dims as -1."""
    shape = list(tensor.shape)
    if not shape or shape[0] != BATCH:
        raise ArtifactError(
            f"triton: {graph}: {tensor.name} has shape {shape} without a leading {BATCH!r} dim, which Triton "
            "cannot batch"
            " (with --ple-tables input the tables are such inputs; re-export with --ple-tables constant to serve "
            "with Triton)"
        )
    return [d if isinstance(d, int) else -1 for d in shape[1:]]


def _io(tensors: Iterable[TensorEntry], graph: str) -> list[dict[str, Any]]:
    return [{"name": t.name, "data_type": _dtype(t, graph), "dims": triton_dims(t, graph)} for t in tensors]


def _graph(manifest: Manifest, kind: GraphKind) -> tuple[str, dict[str, TensorEntry], dict[str, TensorEntry]]:
    graph = manifest.graph(kind)
    return graph.file, {t.name: t for t in graph.inputs}, {t.name: t for t in graph.outputs}


def _states(
    manifest: Manifest, file: str, inputs: Mapping[str, TensorEntry], outputs: Mapping[str, TensorEntry]
) -> list[dict[str, Any]]:
    states = []
    reading = {r.layer for r in manifest.kv_cache.reads or ()}  # a shared_kv cache's layers that carry none
    for layer in (i for i in range(manifest.model.n_layers) if i not in reading):
        for past, present in _layer_pairs(manifest, layer):
            if past not in inputs or present not in outputs:
                raise ArtifactError(
                    f"triton: {file} lacks {past if past not in inputs else present}; re-export the directory "
                    "with this kiln"
                )
            p_in, p_out = inputs[past], outputs[present]
            dims, out_dims = triton_dims(p_in, file), triton_dims(p_out, file)
            if dims != out_dims or p_in.dtype != p_out.dtype:
                raise ArtifactError(
                    f"triton: {file}: {past} ({p_in.dtype} {dims}) and {present} ({p_out.dtype} {out_dims}) must "
                    "match to be one state"
                )
            initial = [0 if d == PAST_SEQ else d for d in p_in.shape[1:]]
            if not all(isinstance(d, int) for d in initial):
                raise ArtifactError(
                    f"triton: {file}: {past} has shape {list(p_in.shape)}; only its {PAST_SEQ!r} dim may vary"
                )
            dtype = _dtype(p_in, file)
            states.append(
                {
                    "input_name": past,
                    "output_name": present,
                    "data_type": dtype,
                    "dims": dims,
                    "initial_state": [{"data_type": dtype, "dims": initial, "zero_data": True, "name": "empty_cache"}],
                }
            )
    return states


def _layer_pairs(manifest: Manifest, layer: int) -> list[tuple[str, str]]:
    """A layer's ``(past, present)`` names: its listed tensors (a recurrent state's ``conv``/``ssm``,
    whose fixed shape is the state's and whose zeros its initial value), else key and value; none
    for a hybrid's layer that lists none (Nemotron-H's MLP blocks carry no cache)."""
    listed = [t.name for t in manifest.kv_cache.tensors or () if t.layer == layer and t.span != "encoder"]
    names = listed or ([] if manifest.kv_cache.kind == "hybrid" else ["key", "value"])
    return [(f"past_key_values.{layer}.{n}", f"present.{layer}.{n}") for n in names]


def _ort_model(directory: Path, manifest: Manifest, name: str) -> TritonModel:
    import onnx  # a core dependency; only the graph (no weights) is read

    file, inputs, outputs = _graph(manifest, GraphKind.UNIFIED)
    states = _states(manifest, file, inputs, outputs)
    state_inputs = {s["input_name"] for s in states}
    state_outputs = {s["output_name"] for s in states}
    graph_path = directory / file
    proto = onnx.load(str(graph_path), load_external_data=False)
    try:
        external = external_files(graph_path, proto)
    except ArtifactError as exc:
        raise ArtifactError(f"triton: {exc.args[0]}; re-export the directory") from exc
    files = {f"model.onnx/{graph_path.name}": graph_path} | {
        f"model.onnx/{name}": path for name, path in sorted(external.items())
    }
    config = {
        "name": name,
        "platform": "onnxruntime_onnx",
        "max_batch_size": manifest.limits.max_batch,
        "input": _io([t for n, t in inputs.items() if n not in state_inputs], file),
        "output": _io([t for n, t in outputs.items() if n not in state_outputs], file),
        "sequence_batching": {
            "max_sequence_idle_microseconds": IDLE_MICROSECONDS,
            "direct": {},
            "state": states,
        },
        "instance_group": [{"kind": _Enum("KIND_AUTO"), "count": 1}],
    }
    comment = (
        f"kiln: {file} with its KV cache as implicit state (Triton feeds present.N.* back as past_key_values.N.*).\n"
        "Send sequence_start on a sequence's first request: Triton then feeds the zero initial state\n"
        "(past length 0). Whether the server accepts a zero-length initial dim is unverified.\n"
        "No control_input: each names a model input, and the graph has none for sequence controls."
    )
    return TritonModel(name, config, files, comment)


def _trt_model(directory: Path, manifest: Manifest, name: str, kind: GraphKind) -> TritonModel:
    file, inputs, outputs = _graph(manifest, kind)
    model_name = f"{name}_{kind.value}"
    config = {
        "name": model_name,
        "platform": "tensorrt_plan",
        "max_batch_size": manifest.limits.max_batch,
        "input": _io(inputs.values(), file),
        "output": _io(outputs.values(), file),
        "dynamic_batching": {},
        "instance_group": [{"kind": _Enum("KIND_GPU"), "count": 1, "profile": ["0"]}],
    }
    comment = f"kiln: {ENGINE_FILES[kind]}, built from {file}; stateless, the client carries the KV tensors."
    return TritonModel(model_name, config, {"model.plan": directory / ENGINE_FILES[kind]}, comment)


def _engines(directory: Path) -> bool:
    present = {kind: (directory / path).is_file() for kind, path in ENGINE_FILES.items()}
    if any(present.values()) and not all(present.values()):
        missing = [ENGINE_FILES[k] for k, ok in present.items() if not ok]
        raise ArtifactError(
            f"triton: {directory} has {' and '.join(ENGINE_FILES[k] for k, ok in present.items() if ok)} but not "
            f"{missing[0]}; run kiln build {directory}"
        )
    return all(present.values())


def triton_models(directory: Path, manifest: Manifest, name: str) -> list[TritonModel]:
    """The models of the repository: ``NAME`` (ONNX Runtime) and, with engines, ``NAME_prefill``/``NAME_decode``."""
    if not TRITON_NAME.match(name):
        raise ArtifactError(
            f"triton: model name {name!r} must start with a letter or digit and hold only letters, digits, '_', "
            "'.' and '-'"
        )
    if manifest.lora is not None:
        raise ConfigError(f"triton: {directory} was exported with --lora-slots: {LORA_TRITON_REASON}")
    if manifest.model.encoder_dim is not None:
        raise ArtifactError(
            "triton: cross-attention decoders are not supported yet (the ensemble would need encoder_hidden_states"
            " and a cross cache that is written once); serve prefill.onnx and decode.onnx from your own host"
        )
    models = [_ort_model(directory, manifest, name)]
    if _engines(directory):
        models += [_trt_model(directory, manifest, name, kind) for kind in (GraphKind.PREFILL, GraphKind.DECODE)]
    return models


_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), the ioctl behind cp --reflink


def _place(source: Path, target: Path) -> None:
    """``target``, a copy of ``source`` that shares its blocks where the filesystem can (a
    reflink, as ``cp --reflink=auto`` makes: btrfs, XFS, bcachefs...), else a plain copy. Never a
    hard link: onnx 1.23 refuses to load external data from a file with more than one link ("a
    potential hardlink attack"), which would break both the export's graphs and the copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(target, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
            return
        except OSError:  # no reflinks here (ext4, tmpfs, another filesystem...): copy below
            pass
    shutil.copyfile(source, target)


def _written_by_kiln(manifest: Manifest) -> Owner:
    """The replacement rule (``artifacts.staging``) for ``triton/``: kiln wrote it when the
    export's manifest lists every file in it (``--triton`` and ``kiln triton`` both record theirs);
    a folder holding anything else is never replaced."""

    def owner(repo: Path) -> str | None:
        foreign = unlisted(repo.parent, manifest, repo.name)
        if not foreign:
            return None
        more = f" (and {len(foreign) - 5} more)" if len(foreign) > 5 else ""
        return (
            f"kiln triton replaces only a {TRITON_DIR}/ folder kiln wrote, and manifest.json does not list "
            f"{', '.join(foreign[:5])}{more}"
        )

    return owner


def write_triton_repo(directory: Path, name: str) -> list[Path]:
    """``kiln triton``: write ``directory/triton/`` for a verified export, replacing an earlier
    one kiln wrote (staged, renamed into place), and record its files in the manifest so that
    ``kiln verify`` still passes; return its files."""
    directory = Path(directory)
    target = directory / TRITON_DIR
    if target.exists() and not target.is_dir():
        raise ArtifactError(f"triton: {target} exists and is not a directory; remove it")
    owner = _written_by_kiln(manifest_mod.read(directory))
    require_replaceable(target, True, owner)  # before verifying, so that the refusal names what is there
    written: list[Manifest] = []  # the manifest listing the new repository, hashed before the rename

    def record() -> None:  # with the rename, signals deferred: the export never lists files it lacks
        manifest_mod.write(directory, written[0])

    try:
        with staged_output(target, force=True, owner=owner, committed=record) as tmp:
            # verified under the lock, once what a killed or interrupted kiln triton left is gone (or put back)
            manifest = require_verified(directory)
            _write_repo(tmp, manifest, triton_models(directory, manifest, name))
            files = rehash_subtree(manifest.files, directory, TRITON_DIR, staged=tmp)
            written.append(dataclasses.replace(manifest, files=files))
    except OSError as exc:
        raise ArtifactError(
            f"triton: could not write {target} ({exc}); check the permissions and free space of {directory}"
        ) from exc
    return sorted(p for p in target.rglob("*") if p.is_file())


def repository_models(directory: Path) -> list[str]:
    """The models of the Triton repository an export holds now (``triton/*/config.pbtxt``)."""
    return sorted(p.parent.name for p in (directory / TRITON_DIR).glob("*/config.pbtxt"))


def write_triton_models(root: Path, manifest: Manifest, name: str) -> None:
    """``kiln export --triton NAME``: the repository written into the staged export ``root``
    (the manifest, not yet written, will list its files with the rest)."""
    repo = root / TRITON_DIR
    repo.mkdir()
    _write_repo(repo, manifest, triton_models(root, manifest, name))


def _write_repo(repo: Path, manifest: Manifest, models: Sequence[TritonModel]) -> None:
    """Every model's ``config.pbtxt`` and version-1 files, and the README, into ``repo``."""
    os.chmod(repo, 0o755)
    for model in models:
        (repo / model.name).mkdir()
        (repo / model.name / "config.pbtxt").write_text(model.config_text())
        for rel, source in model.files.items():
            _place(source, repo / model.name / "1" / rel)
    (repo / "README.md").write_text(readme(manifest, models))
