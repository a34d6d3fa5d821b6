"""Tracing one graph of the contract with the torch.export-based ONNX exporter.

A graph is traced from the folded module through a thin wrapper (``trace.wrapper``) that
flattens the KV cache into named tensors. What is traced, and why only once, is ``trace.unified``:
the unified graph of a template of the model; prefill and decode are derived from it
(``passes.specialise``), the remaining layers stamped (``passes.stamp``). Measured on the
development machine (2 cores), one trace costs ~2 s plus ~1.3 s per decoder layer (warm;
torch.export's capture, decompositions and translation: the exporter's optimizer, here off, was
~10% more), so three traces of a 24-layer model took minutes and one trace of a 2-layer
template takes ~4 s.

Traps, for the next engineer:
- torch.export specialises a dim whose example size is 0 or 1, so example inputs use
  batch 2, seq 3, past 5; decode's seq is meant to be 1 and is left static.
- ``attention_mask``'s length is past + seq, which ``torch.export.Dim`` cannot express
  (only increasing linear expressions of ONE dim); in decode it is ``past_seq + 1``, in the
  unified graph ``Dim.AUTO``. Dim names are set afterwards from the contract by
  ``passes.apply_contract``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import onnx_ir as ir
import torch
from torch import nn
from torch.export import Dim

from kiln.errors import ExportError
from kiln.exporter.contract.io import (
    ENC_SEQ,
    ENCODER_FEATURES,
    ENCODER_MASK,
    ENCODER_STATES,
    PAST_SEQ,
    GraphIO,
    GraphKind,
    is_cross,
)
from kiln.exporter.trace.wrapper import EncoderModule, FeaturesEncoderModule, GraphModule

__all__ = ["trace_graph", "example_inputs", "root_cause"]

_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST, _EXAMPLE_ENC = 2, 3, 5, 4
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def example_inputs(io_spec: GraphIO, kind: GraphKind, vocab: int) -> tuple[object, ...]:
    """Small example inputs for tracing (sizes chosen so that no dynamic dim is 0 or 1)."""
    batch = _EXAMPLE_BATCH
    gen = torch.Generator().manual_seed(0)
    if kind is GraphKind.ENCODER and io_spec.inputs[0].name == ENCODER_FEATURES:  # fixed [n_mels, frames]
        return (torch.randn(batch, *(int(d) for d in io_spec.inputs[0].dims[1:]), generator=gen),)
    if kind is GraphKind.ENCODER:
        return (
            torch.randint(0, vocab, (batch, _EXAMPLE_ENC), generator=gen),
            torch.ones(batch, _EXAMPLE_ENC, dtype=torch.int64),
        )
    # an encoder-decoder's decoder graphs take the encoder's mask fourth
    enc_mask = (
        (torch.ones(batch, _EXAMPLE_ENC, dtype=torch.int64),)
        if any(t.name == ENCODER_MASK for t in io_spec.inputs)
        else ()
    )
    seq = 1 if kind is GraphKind.DECODE else _EXAMPLE_SEQ
    past = 0 if kind is GraphKind.PREFILL else _EXAMPLE_PAST
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    if kind is GraphKind.PREFILL:
        enc = [t for t in io_spec.inputs if t.name == ENCODER_STATES]
        if enc:
            return (ids, mask, pos, *enc_mask, torch.randn(batch, _EXAMPLE_ENC, int(enc[0].dims[2]), generator=gen))
        return (ids, mask, pos, *enc_mask)
    kv = [t for t in io_spec.inputs if t.name.startswith("past_key_values.")]
    length = {PAST_SEQ: past, ENC_SEQ: _EXAMPLE_ENC}  # a recurrent state's length is its own number
    cache = [
        torch.randn(batch, int(t.dims[1]), int(length.get(str(t.dims[2]), t.dims[2])), int(t.dims[3]), generator=gen)
        for t in kv
    ]
    return (ids, mask, pos, *enc_mask, cache)


def _dynamic_shapes(
    kind: GraphKind, io_spec: GraphIO, max_batch: int, max_context: int, max_encoder: int = 0
) -> tuple[object, ...]:
    batch = Dim("batch", min=1, max=max(max_batch, _EXAMPLE_BATCH))
    seq = Dim("seq", min=1, max=max(max_context, _EXAMPLE_SEQ))
    # the encoder's length is bounded by max_context too (TensorRT profiles need a bound)
    enc = Dim("encoder_seq", min=1, max=max(max_context, _EXAMPLE_ENC, max_encoder))
    if kind is GraphKind.ENCODER:
        features = io_spec.inputs[0].name == ENCODER_FEATURES
        return ({0: batch},) if features else ({0: batch, 1: enc}, {0: batch, 1: enc})
    ids = {0: batch} if kind is GraphKind.DECODE else {0: batch, 1: seq}
    enc_mask = ({0: batch, 1: enc},) if any(t.name == ENCODER_MASK for t in io_spec.inputs) else ()
    if kind is GraphKind.PREFILL:
        shapes: tuple[object, ...] = (ids, {0: batch, 1: seq}, ids, *enc_mask)
        return (*shapes, {0: batch, 1: enc}) if any(t.name == ENCODER_STATES for t in io_spec.inputs) else shapes
    past = Dim("past_seq", min=0, max=max(max_context, _EXAMPLE_PAST))
    total = past + 1 if kind is GraphKind.DECODE else Dim.AUTO
    kv = [t for t in io_spec.inputs if t.name.startswith("past_key_values.")]
    return (
        ids,
        {0: batch, 1: total},
        ids,
        *enc_mask,
        [_cache_dims(t.dims[2], batch, enc, past) for t in kv],
    )


def _cache_dims(length: str | int, batch: Dim, enc: Dim, past: Dim) -> dict[int, Dim]:
    """A cache input's dynamic dims: batch, and its length unless it is fixed (a recurrent state)."""
    if isinstance(length, int):
        return {0: batch}
    return {0: batch, 2: enc if length == ENC_SEQ else past}


def _to_meta(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


class _Phases(io.StringIO):
    """The exporter's own progress lines (``verbose=True``: ``[torch.onnx] Run decompositions...
    ✅``), swallowed; ``on_phase`` is called once per phase done (capture, decompositions,
    translation). Only progress depends on their wording: if it changes, the stage's count just
    does not move."""

    def __init__(self, on_phase: Callable[[], None]) -> None:
        super().__init__()
        self._on_phase = on_phase

    def write(self, text: str) -> int:
        if text.rstrip().endswith("... ✅"):  # print() writes "[torch.onnx]" and the phase apart
            self._on_phase()
        return len(text)


PHASES = 3  # what ``_Phases`` counts per traced graph


@contextlib.contextmanager
def _quiet(on_phase: Callable[[], None] | None = None) -> Iterator[None]:
    """The exporter prints progress lines and warnings meant for its own developers."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "torch.fx", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(_Phases(on_phase or (lambda: None))):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def trace_graph(
    module: nn.Module,
    kind: GraphKind,
    io_spec: GraphIO,
    *,
    n_layers: int,
    vocab: int,
    opset: int,
    last_logits_only: bool,
    max_batch: int,
    max_context: int,
    meta: bool = False,
    translations: Mapping[Any, Callable[..., Any]] | None = None,
    max_encoder: int = 0,
    on_phase: Callable[[], None] | None = None,
) -> ir.Model:
    """Trace one graph to an in-memory ONNX model with the contract's I/O names (PLE table
    inputs are added afterwards by a pass; ``passes.apply_contract`` then checks the whole I/O).

    ``meta``: ``module``'s weights are on the meta device, and so are the example inputs; the
    graph's initializers then hold no data until ``passes.bind`` binds them. The exporter's own
    optimizer is off either way (it would read every weight): ``passes.fold`` folds instead.
    ``translations``: the family's ONNX translations of its custom ops (``LoadedModel.translations``).
    ``on_phase``: called after each of the exporter's ``PHASES`` (progress). ``max_encoder``: the
    encoder's output length when it is fixed and may exceed ``max_context`` (a speech encoder's)."""
    cross = any(is_cross(t.name) for t in (*io_spec.inputs, *io_spec.outputs))
    encoder_mask = any(t.name == ENCODER_MASK for t in io_spec.inputs)
    features = kind is GraphKind.ENCODER and io_spec.inputs[0].name == ENCODER_FEATURES
    wrapper = (
        (FeaturesEncoderModule(module) if features else EncoderModule(module))
        if kind is GraphKind.ENCODER
        else GraphModule(module, kind, n_layers, last_logits_only, cross, encoder_mask)
    )
    wrapper = wrapper.eval()
    args = example_inputs(io_spec, kind, vocab)
    if meta:
        args = tuple(_to_meta(a) for a in args)
    try:
        with _quiet(on_phase), torch.no_grad():
            program = torch.onnx.export(
                wrapper,
                args,
                dynamo=True,
                dynamic_shapes=_dynamic_shapes(kind, io_spec, max_batch, max_context, max_encoder),
                input_names=[n for n in io_spec.input_names if not n.startswith("ple.")],
                output_names=io_spec.output_names,
                opset_version=opset,
                optimize=False,
                verbose=True,  # its phase lines count progress (``_Phases``); nothing is shown
                custom_translation_table=dict(translations or {}),
            )
    except Exception as exc:  # the exporter raises many unrelated types; all mean "could not trace"
        raise ExportError(f"tracing the {kind.value} graph of {_model_name(module)} failed: {root_cause(exc)}") from exc
    assert program is not None
    return program.model


def root_cause(exc: BaseException) -> str:
    """The first line of the deepest exception of ``exc``'s chain (``__cause__``, else
    ``__context__``), colour codes stripped, with its type: torch.onnx's own first line ("Failed
    to export the model with torch.export. This is step 1/3 ... Next steps:") names no cause."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _model_name(module: nn.Module) -> str:
    """What is traced, for the error: a Hugging Face model's architecture (its config's), else the module's class."""
    for sub in module.modules():
        names = getattr(getattr(sub, "config", None), "architectures", None)
        if isinstance(names, (list, tuple)) and names:
            return str(names[0])
    return type(module).__name__
