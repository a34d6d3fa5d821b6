"""Whether a ``--target onnx`` export's static KV cache fits this machine, a plan-stage refusal
(``exporter.plan``: from the config before any weight is read, and again from the loaded model):
the figures are ``contract.static_cache.oversized_reasons``'s, the rows parity runs at once this
module's (``parity_rows``, from parity's own plan)."""

from __future__ import annotations

from kiln.exporter.context_limit import context_reasons, exported_context
from kiln.exporter.contract.io import CacheUpdate
from kiln.exporter.contract.static_cache import oversized_reasons
from kiln.exporter.options import ExportOptions
from kiln.exporter.parity.driver import joins_batches, parity_plan
from kiln.plugins.base import DecoderSpec

__all__ = ["parity_rows", "static_cache_reasons"]


def static_cache_reasons(spec: DecoderSpec | None, options: ExportOptions) -> list[str]:
    """A target whose graphs hold a static cache sizes its buffers by the exported context: too big
    for this machine (at ``--max-batch``, or at parity's peak), it is refused before the trace (a
    context refused on its own is ``context_reasons``' to say)."""
    from kiln.exporter.targets import targets

    if (
        spec is None
        or context_reasons(spec, options)
        or not any(CacheUpdate.STATIC in t.kv_caches for t in targets() if t.wanted(options))
    ):
        return []
    context = exported_context(spec, options)
    assert context is not None, "context_reasons refuses an export without a context"
    return oversized_reasons(
        spec,
        max_batch=options.graphs.max_batch,
        parity_rows=parity_rows(spec, options.graphs.max_batch, context, options.parity.tokens),
        max_context=context,
        kv_dtype=options.precision.kv_dtype,
    )


def parity_rows(spec: DecoderSpec, max_batch: int, max_context: int, tokens: int) -> int:
    """The most rows parity feeds one graph at once: its tensor checks' 2 (1 at ``max_batch`` 1),
    or its greedy runs', both batches' rows together where its plan joins them (``parity.driver``)."""
    single, padded, _ = parity_plan(max_context, max_batch, tokens)
    joined = joins_batches(spec) and len(single) + len(padded) <= max_batch
    return max(2 if max_batch > 1 else 1, len(single) + len(padded) if joined else max(len(single), len(padded)))
