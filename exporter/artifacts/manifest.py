"""``manifest.json``: the contract between an export directory and whoever serves it.

It holds everything a host needs without reading Python: graph files with their I/O names,
dtypes and shapes (named dims), KV layout, limits, precision, special token ids, the sha256 of
every file, and the tool versions. It has no timestamps, so the same export gives the same file.

``Manifest`` is its typed form: every reader (check, generate, bench, engine, serving) reads
attributes, never raw keys; ``Manifest.to_json``/``from_json`` are the only places the JSON
layout is spelled out (``manifest.schema.json`` describes it for other languages). The export
options a manifest records and the inverse (``graph_options``) live here together.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.errors import ArtifactError
from kiln.exporter.artifacts.cache_info import CacheTensorInfo, SharedKvRead
from kiln.exporter.artifacts.manifest_v1 import upgrade_v1
from kiln.exporter.artifacts.serde import OMIT_IF_NONE, from_json, to_json
from kiln.exporter.contract.io import GraphIO, GraphKind, TensorSpec
from kiln.exporter.contract.lora import LoraSlots
from kiln.exporter.options import (
    ExportOptions,
    GraphOptions,
    LogitsMode,
    PLEExtendMode,
    PLEOptions,
    PLETables,
    Precision,
)
from kiln.jsonfile import read_json_object
from kiln.newfile import new_output

__all__ = [
    "MANIFEST",
    "MANIFEST_VERSION",
    "Manifest",
    "AdapterRef",
    "CheckpointRef",
    "ModelInfo",
    "TextDecoderInfo",
    "KvCacheInfo",
    "Limits",
    "PleInfo",
    "ExportSettings",
    "TensorEntry",
    "GraphEntry",
    "WeightsInfo",
    "ParityInfo",
    "QualityInfo",
    "TargetGraph",
    "TargetWeights",
    "TargetEntry",
    "EnginesEntry",
    "read",
    "write",
    "tool_versions",
    "graph_options",
]

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # 1 (before targets and passes reported their own data) is still read: ``manifest_v1``
_TOOLS = (
    "torch",
    "onnx",
    "onnx-ir",
    "onnxscript",
    "onnxruntime",
    "polygraphy",
    "transformers",
)  # transformers: the Hugging Face family's model code


def _omit() -> Any:
    """A field that defaults to None and is left out of the JSON when it is None."""
    return dataclasses.field(default=None, metadata=OMIT_IF_NONE)


@dataclasses.dataclass(frozen=True)
class AdapterRef:
    """A PEFT LoRA adapter merged into the checkpoint (``--adapter DIR[:WEIGHT]``)."""

    path: str  # the directory as --adapter gave it (relative or absolute)
    resolved: str  # its absolute path when the export ran (kiln check's fallback)
    files: dict[str, str]  # sha256 of adapter_config.json and adapter_model.safetensors
    weight: float  # w in W + sum w * s * B @ A
    rank: int  # r
    alpha: float  # lora_alpha
    use_rslora: bool  # s = alpha / sqrt(r) (else alpha / r)
    target_modules: tuple[str, ...]  # the names of the modules it changed (q_proj, c_attn), sorted


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    reference: str | None  # what --model named ('demo', a path or ORG/NAME); None when unknown
    files: dict[str, str]  # sha256 of each checkpoint file read, by file name
    dtype: str = "float32"  # the dtype its weights are stored in (the graphs' is ``Manifest.precision``)
    # the absolute path ``reference`` resolved to (a repo id's cached snapshot): kiln check's fallback
    resolved: str | None = _omit()
    adapters: tuple[AdapterRef, ...] | None = _omit()  # LoRA adapters merged into it, in --adapter order


@dataclasses.dataclass(frozen=True)
class TextDecoderInfo:
    """A multimodal checkpoint exported as its text decoder alone (``plugins.base.TextDecoderOf``)."""

    architecture: str  # the checkpoint's class (Gemma3ForConditionalGeneration)
    prefix: str  # the text decoder's module in it (model.language_model)
    not_exported: tuple[str, ...]  # its other modules, in no graph (model.vision_tower, ...)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    encoder_dim: int | None  # set for cross-attention decoders
    has_encoder: bool = False  # an encoder-decoder exported with its encoder graph (graphs["encoder"])
    decoder_start_token_id: int | None = None  # its decoder's first token
    text_decoder_of: TextDecoderInfo | None = _omit()  # a multimodal checkpoint's text decoder: what was left out


@dataclasses.dataclass(frozen=True)
class KvCacheInfo:
    layout: str
    dims: tuple[str, ...]
    dtype: str
    kind: str | None = _omit()  # a cache other than keys and values per KV head ("latent"), with its tensors
    tensors: tuple[CacheTensorInfo, ...] | None = _omit()
    reads: tuple[SharedKvRead, ...] | None = _omit()  # a shared_kv cache: the layers that carry none


@dataclasses.dataclass(frozen=True)
class Limits:
    max_batch: int
    max_context: int


@dataclasses.dataclass(frozen=True)
class PleInfo:
    folded: bool
    trained_rows: int
    rows: int
    extend_mode: str | None
    tables: str


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    opset: int
    keep_fp32: tuple[str, ...]
    calibration: dict[str, Any] | None
    logits: str
    ple: PleInfo | None
    quantization: dict[str, Any] | None = _omit()  # int4 / int8 / fp8: format, method, block size, what stayed float


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[str | int, ...]

    @classmethod
    def of(cls, spec: TensorSpec) -> TensorEntry:
        return cls(spec.name, spec.dtype, tuple(spec.dims))


@dataclasses.dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[TensorEntry, ...]
    outputs: tuple[TensorEntry, ...]
    # what the graph's passes report, by report name (``passes.reports``): fp16's islands, the
    # int8/int4/fp8 MatMuls; absent for a graph whose passes report nothing (fp32)
    passes: dict[str, dict[str, Any]] | None = _omit()

    @classmethod
    def of(cls, file: str, io: GraphIO, passes: dict[str, dict[str, Any]] | None = None) -> GraphEntry:
        return cls(file, tuple(map(TensorEntry.of, io.inputs)), tuple(map(TensorEntry.of, io.outputs)), passes or None)

    def report(self, name: str) -> dict[str, Any]:
        """One pass's report (empty when that pass did not run on this graph)."""
        return (self.passes or {}).get(name, {})

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]


@dataclasses.dataclass(frozen=True)
class WeightsInfo:
    file: str
    tensors: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class QualityInfo:
    """The graphs that carry the quantization against the checkpoint's model on text
    (``parity.quality``): what the quantization costs; ``threshold`` the top-1 agreement that gated
    it (None: recorded only); ``graphs`` the graph set measured, ``portable`` or a target's name
    (None: a manifest written before it recorded the set, the portable graphs)."""

    source: str
    real: bool
    tokens: int
    agreement: float
    kl: float
    perplexity_checkpoint: float
    perplexity_graphs: float
    judged: str
    threshold: float | None = _omit()
    graphs: str | None = _omit()


@dataclasses.dataclass(frozen=True)
class ParityInfo:
    passed: bool
    report: str
    agreement: str | None = (
        _omit()
    )  # int4: "gate" or "record" (--parity-agreement): whether agreement with the checkpoint's model gated it
    quality: QualityInfo | None = _omit()  # absent in manifests written before it, and where quality was not measured


@dataclasses.dataclass(frozen=True)
class TargetGraph:
    """A target's graph: its file, what the target's passes report of it (the target owns them)
    and, when they are not the portable graph's (a static cache: ``contract.static_cache``), its
    inputs and outputs."""

    file: str
    passes: dict[str, dict[str, Any]] | None = _omit()
    inputs: tuple[TensorEntry, ...] | None = _omit()
    outputs: tuple[TensorEntry, ...] | None = _omit()

    def report(self, name: str) -> dict[str, Any]:
        return (self.passes or {}).get(name, {})


@dataclasses.dataclass(frozen=True)
class TargetWeights:
    file: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class TargetEntry:
    """A target's graph set (``exporter.targets``): everything in it is the target's own data."""

    precision: str  # of its graphs ("fp32", or "int8"/"int4" for weight-only MatMulNBits)
    kv_cache: str  # how its decode step carries the cache (``contract.io.CacheUpdate``): what a runtime loop needs
    graphs: dict[str, TargetGraph]
    weights: TargetWeights
    record: dict[str, Any] | None = _omit()  # what its graphs were written with (the MatMulNBits format...)


@dataclasses.dataclass(frozen=True)
class EnginesEntry:
    """Written by ``kiln build``: the TensorRT, CUDA and GPU the engines were built with."""

    record: str
    tensorrt: str
    cuda: str | None
    gpu: str
    compute_capability: str
    files: dict[str, str]
    graphs: str | None = _omit()  # "portable" | "onnx": the graph set they were built from (kiln build --graphs)
    graphs_reason: str | None = _omit()  # why that set, in words


@dataclasses.dataclass(frozen=True)
class Manifest:
    manifest_version: int
    family: str
    checkpoint: CheckpointRef
    config: dict[str, Any]
    model: ModelInfo
    precision: str
    kv_cache: KvCacheInfo
    limits: Limits
    export: ExportSettings
    graphs: dict[str, GraphEntry]
    weights: WeightsInfo
    tokenizer: str | None
    parity: ParityInfo
    tools: dict[str, str]
    files: dict[str, str]
    targets: dict[str, TargetEntry] | None = _omit()
    engines: EnginesEntry | None = _omit()
    lora: LoraSlots | None = (
        _omit()
    )  # --lora-slots: every portable graph's optional adapter inputs, and --target ort's graphs' (``exporter.lora``)

    def graph(self, kind: GraphKind) -> GraphEntry:
        return self.graphs[kind.value]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = to_json(self)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = MANIFEST) -> Manifest:
        return from_json(cls, data, where)


def tool_versions() -> dict[str, str]:
    out = {"kiln": __version__, "python": platform.python_version()}
    for name in _TOOLS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def export_settings(
    options: ExportOptions,
    *,
    trained_rows: int | None,
    keep_fp32: tuple[str, ...],
    calibration: dict[str, Any] | None,
    quantization: dict[str, Any] | None = None,
) -> ExportSettings:
    """What the manifest records of the options that shaped the graphs (``graph_options`` reads it back)."""
    ple = None
    if trained_rows is not None:
        extend = options.ple.extend_mode.value if options.ple.extend else None
        ple = PleInfo(True, trained_rows, options.ple.extend or trained_rows, extend, options.ple.tables.value)
    return ExportSettings(
        options.graph_opset,
        keep_fp32 if options.precision.float16 else (),
        calibration,
        options.graphs.logits.value,
        ple,
        quantization,
    )


def graph_options(manifest: Manifest) -> ExportOptions:
    """The options that shaped an export's graphs, from its manifest (``kiln check`` re-runs parity
    with them); the graphs' precision is the manifest's own, as they already carry it."""
    ple = manifest.export.ple
    return ExportOptions(
        graphs=GraphOptions(
            manifest.limits.max_batch,
            manifest.limits.max_context,
            LogitsMode(manifest.export.logits),
            manifest.export.opset,
        ),
        ple=PLEOptions(
            ple.rows if ple is not None and ple.extend_mode else None,
            PLEExtendMode(ple.extend_mode if ple is not None and ple.extend_mode else "clamp"),
            PLETables(ple.tables if ple is not None else "constant"),
        ),
    )


def precision_of(manifest: Manifest) -> Precision:
    return Precision.parse(manifest.precision)


def write(root: Path, manifest: Manifest) -> Path:
    """``root/manifest.json``, whole or as it was: written beside it, then renamed over it (a
    full disk or a kill mid-write never leaves a cut manifest in an export)."""
    path = root / MANIFEST
    with new_output(path) as staged:
        staged.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    return path


def read(root: Path) -> Manifest:
    """Read and check a manifest; the error says what is wrong with the directory."""
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a directory")
    # links=False: kiln writes no link into an export (kiln verify reports one), so it reads none
    data = read_json_object(
        path, ArtifactError, f"{root}: no {MANIFEST}; is this a kiln export directory?", links=False
    )
    version = data.get("manifest_version")
    if version == 1:
        data = upgrade_v1(data, str(path))
    elif version != MANIFEST_VERSION:
        raise ArtifactError(
            f"{path}: manifest_version {version!r} is not supported (this kiln reads versions 1 and "
            f"{MANIFEST_VERSION}); re-export with this kiln"
        )
    manifest = Manifest.from_json(data, str(path))
    _check_ranges(manifest, path)
    return manifest


# What a manifest's numbers may be: beyond these no model kiln exports goes, and a reader would
# allocate or loop by them (``kiln generate`` sizes its cache by n_layers, bench its feeds by the limits)
_RANGES = {
    "model.n_layers": (1, 1 << 12),
    "model.n_kv_heads": (1, 1 << 12),
    "model.head_dim": (1, 1 << 16),
    "model.vocab_size": (1, 1 << 31),
    "limits.max_batch": (1, 1 << 16),
    "limits.max_context": (2, 1 << 24),
}


def _check_ranges(manifest: Manifest, path: Path) -> None:
    """Refuse numbers no export has (a hand-edited or damaged manifest) before anyone sizes by them."""
    values = {
        "model.n_layers": manifest.model.n_layers,
        "model.n_kv_heads": manifest.model.n_kv_heads,
        "model.head_dim": manifest.model.head_dim,
        "model.vocab_size": manifest.model.vocab_size,
        "limits.max_batch": manifest.limits.max_batch,
        "limits.max_context": manifest.limits.max_context,
    }
    for key, value in values.items():
        low, high = _RANGES[key]
        if not low <= value <= high:
            raise ArtifactError(
                f"{path}: {key} is {value}, outside {low}..{high}; the manifest is damaged or was edited: re-export"
            )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        token = getattr(manifest.model, name)
        if token is not None and not 0 <= token < 1 << 31:
            raise ArtifactError(
                f"{path}: model.{name} is {token}, not a token id; the manifest is damaged or was edited: re-export"
            )
    ple = manifest.export.ple
    if ple is not None and not manifest.limits.max_context <= ple.rows <= 1 << 24:
        raise ArtifactError(
            f"{path}: limits.max_context is {manifest.limits.max_context} but the PLE tables have {ple.rows} "
            "rows; the manifest is damaged or was edited: re-export"
        )
