"""A graph set as parity checks it (``parity.Candidate``): judged by its precision's tolerances
and fed its KV dtype, and, for a weight-only set, by its float precision's against PyTorch on its
own quantized numbers. Shared by ``kiln export`` (``pipeline``) and ``kiln check`` (``check``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.external_data import set_bytes
from kiln.exporter.parity import Candidate
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.runners import Runner
from kiln.exporter.tolerance import Tolerance

__all__ = ["candidate", "qdq_tolerance"]


def candidate(
    open_runner: Callable[[], contextlib.AbstractContextManager[Runner]],
    graphs: tuple[GraphKind, ...],
    precision: Precision,
    quantized: Precision | Tolerance | None,
    target: str | None = None,
    files: Iterable[Path] = (),
) -> Candidate:
    """The graph set whose graphs are of ``precision``, judged against the
    quantized model at ``quantized``'s tolerances (a precision's, or a Q/DQ set's own:
    ``qdq_tolerance`` below; None: not judged so), where no greedy token may
    differ but by a tie: the quantized model computes the graphs' own numbers, so only their
    arithmetic's rounding may reorder its tokens, and only those within the tolerance of each other
    (a token-match floor, int8's 90%, would refuse a correct graph of a model whose logits are
    mostly near-ties: the random Llama-3-8B-shaped one's ``--target ort`` matched 64-70% here,
    every mismatch a tie; and it would let a wrong token through on a model with few). ``files``:
    its graph files, sized for parity's memory rule (``parity.memory``)."""
    judging = quantized.tolerance if isinstance(quantized, Precision) else quantized
    against = dataclasses.replace(judging, min_token_match=1.0) if judging is not None else None
    return Candidate(
        open_runner,
        graphs,
        precision.value,
        precision.tolerance,
        precision.kv_dtype,
        target=target,
        quantized=against,
        weight_bytes=set_bytes(files),
    )


def qdq_tolerance(precision: Precision) -> Tolerance:
    """The tolerances that judge an int8 or fp8 Q/DQ set against PyTorch with its Q/DQ numbers
    (``parity.qdq_model``): the precision's own, the bound set for the quantization's own error.
    Not its float precision's: Q/DQ is discontinuous, so a value within float rounding of a code
    boundary lands on either code in graph and reference, and that one-code difference (one step
    of the quantization) propagates and multiplies in later layers. The demo's fp32 int8 graphs
    match the Q/DQ model to 1e-5 of a logit, but the 33M random Llama's drift by 3% of a row from
    its fifth layer, and fp16 rounding before every quantizer (fp8, int8 with --fp16) flips codes
    in every layer (the demo's fp8 logits 0.4 off, against 0.77 from the checkpoint's model).
    What is strict is the rest: every scale bit for bit (``parity.qdq_proof``), and every greedy
    token the Q/DQ model's argmax or a tie (``candidate``)."""
    return precision.tolerance
