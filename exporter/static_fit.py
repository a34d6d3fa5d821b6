"""Whether a ``--target onnx`` export's static KV cache fits this machine, asked before the trace
(``pipeline``: from the config before any weight is read, and again from the loaded model): the
figures are ``contract.static_cache.refuse_oversized``'s, the rows parity runs at once this
module's (``parity_rows``, from parity's own plan)."""

from __future__ import annotations

from kiln.exporter.contract.io import CacheUpdate
from kiln.exporter.contract.static_cache import refuse_oversized
from kiln.exporter.options import ExportOptions
from kiln.exporter.parity.driver import joins_batches, parity_plan
from kiln.plugins.base import DecoderSpec

__all__ = ["parity_rows", "refuse_static_cache"]


def refuse_static_cache(spec: DecoderSpec, options: ExportOptions, context: int) -> None:
    """A target whose graphs hold a static cache sizes its buffers by ``context``: too big for this
    machine (at ``--max-batch``, or at parity's peak), it is refused here, before the trace."""
    from kiln.exporter.targets import targets

    if any(CacheUpdate.STATIC in t.kv_caches for t in targets() if t.wanted(options)):
        rows = parity_rows(spec, options.max_batch, context, options.parity_tokens)
        refuse_oversized(
            spec,
            max_batch=options.max_batch,
            parity_rows=rows,
            max_context=context,
            kv_dtype=options.precision.kv_dtype,
        )


def parity_rows(spec: DecoderSpec, max_batch: int, max_context: int, tokens: int) -> int:
    """The most rows parity feeds one graph at once: its tensor checks' 2 (1 at ``max_batch`` 1),
    or its greedy runs', both batches' rows together where its plan joins them (``parity.driver``)."""
    single, padded, _ = parity_plan(max_context, max_batch, tokens)
    joined = joins_batches(spec) and len(single) + len(padded) <= max_batch
    return max(2 if max_batch > 1 else 1, len(single) + len(padded) if joined else max(len(single), len(padded)))
