"""Parity reports: ``reports/parity.json`` (machine-readable), ``.md`` (for people) and
``.png`` (``plot``: logit error and token agreement per generation step).

Every graph set (the portable graphs and each target's, e.g. ``--target ort --ort-int8``) is
judged by its own precision's tolerances, and every table and the plot show them per set: an
int8 set sits 1000x above the fp32 tolerance and below its own. ``summary_table`` and
``verdict`` are the short forms ``kiln check`` and ``kiln export`` print.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.exporter.parity.plot import write_plot
from kiln.exporter.parity.results import GraphSetParity, ParityResult, TensorCheck, quantized_model_name
from kiln.exporter.tolerance import RULE

__all__ = ["write_parity_reports", "markdown", "summary_table", "verdict"]


def write_parity_reports(result: ParityResult, directory: Path, extras: Mapping[str, Any] | None = None) -> list[Path]:
    """``parity.json``, ``.md`` and ``.png`` of ``result``, with ``extras`` (what else the export
    reports: PLE folding checks, fp32 islands, calibration...) after the checks."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "parity.json", directory / "parity.md", directory / "parity.png"]
    paths[0].write_text(json.dumps({**result.to_dict(), **(extras or {})}, indent=2) + "\n")
    paths[1].write_text(markdown(result, extras))
    write_plot(result, paths[2])
    return paths


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def _precisions(result: ParityResult) -> str:
    return ", ".join(f"{s.name} {s.precision}" for s in result.sets())


def _labelled_sets(result: ParityResult) -> list[tuple[str, GraphSetParity, bool]]:
    """Every graph set with its label and whether it gates: against the quantized model first
    (an int4 export's), then against the checkpoint's model (its agreement)."""
    if result.quantized is None:
        return [(s.name, s, True) for s in result.sets()]
    agreement = "agreement, gating" if result.agreement_gates else "agreement, recorded only"
    against = "int4 weights" if "int4" in result.quantized.precision else "Q/DQ scales"
    return [(f"{s.name} vs {against}", s, True) for s in result.quantized.sets()] + [
        (f"{s.name} vs checkpoint ({agreement})", s, result.agreement_gates) for s in result.sets()
    ]


def _ok(passed: bool, gates: bool) -> str:
    return _yes(passed) if passed or gates else "no (not gating)"


def _cells(t: TensorCheck | None) -> str:
    """Two table cells (no ``|`` inside): the worst row's error, and its tolerance with the rule's
    figures, ``0.00159 | 1e-05 + 0.0001 x 40.3 = 0.00404`` (the row's max abs reference: 40.3)."""
    if t is None:
        return "- | -"
    return f"{t.error:.3g} | {t.atol:g} + {t.rtol:g} x {t.scale:.3g} = {t.limit:.3g}"


def summary_table(result: ParityResult) -> list[str]:
    """One row per graph set: its precision, its worst logits and KV rows (the rows closest to
    their limits) against their tolerances, atol + rtol x the row's max abs reference; cosine and
    tokens against theirs."""
    lines = [
        "| graph set | precision | worst logit error | logits tolerance: atol + rtol x its row's max abs logit | "
        "worst KV/other error "
        "| KV/other tolerance: atol + rtol x its row's max abs value | cosine at least | lowest token match | "
        "token match at least | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s, gates in _labelled_sets(result):
        lines.append(
            f"| {name} | {s.precision} | {_cells(s.worst(True))} | {_cells(s.worst(False))} | "
            f"{s.tolerance.min_cosine:g} "
            f"| {s.token_match:.2%} | {_token_floor(s)} | {_ok(s.passed, gates)} |"
        )
    return lines


def _token_floor(s: GraphSetParity) -> str:
    """The token-match floor, and when a set passed below it, why: its mismatches were near-ties
    (a row read "98.96% | 100% | yes" with nothing saying so)."""
    floor = f"{s.tolerance.min_token_match:.0%}"
    ties = sum(g.ties for g in s.generation)
    return (
        f"{floor} ({ties} near-tie{'s' if ties > 1 else ''} excepted)"
        if ties and s.token_match < s.tolerance.min_token_match
        else floor
    )


def _figures(t: TensorCheck | None, missing: str) -> str:
    """``logits error 2e-05 (limit 0.00101)``: the worst row's error and its limit (atol + rtol x the row's
    max abs reference: the rule's terms are in the report and ``kiln check --verbose``); the KV cache's,
    or another output's by name."""
    if t is None:
        return missing
    what = "logits" if t.output == "logits" else "KV" if t.output.startswith("present.") else t.output
    return f"{what} error {t.error:.3g} (limit {t.limit:.3g})"


def _set_figures(s: GraphSetParity) -> str:
    return (
        f"{_figures(s.worst(True), 'no logits checked')}, {_figures(s.worst(False), 'no other output checked')}, "
        f"tokens {s.token_match:.0%} equal over {s.steps} steps"
    )


def verdict(result: ParityResult) -> str:
    """One short line: passed or failed, and each graph set's worst logits and KV rows against their
    limits and its lowest token match (a summary; the report's tables hold every check)."""
    sets = _labelled_sets(result)
    figures = "; ".join(
        f"{name} ({s.precision}): {_set_figures(s)}" if len(sets) > 1 else _set_figures(s) for name, s, _ in sets
    )
    return f"parity {'passed' if result.passed else 'FAILED'}: {figures}{_quality_phrase(result)}"


def _quality_phrase(result: ParityResult) -> str:
    """The verdict's quality clause: how it was judged and its figures, or once why it was not measured."""
    q = result.quality
    if q is None:
        return ""
    if q.note is not None:
        return f"; quality {q.note}"
    return f"; quality {'' if q.passed else 'BELOW ITS GATE '}({q.judged}): {q.figures()}"


def _tensor_rows(sets: list[GraphSetParity]) -> list[str]:
    lines = [
        "| graph | batch | output | max abs | worst row's error | its tolerance: atol + rtol x the row's max abs "
        "reference | max rel | cosine | cosine at least | top-1 | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sets:
        for t in s.tensors:
            top1 = f"{t.top1:.4f}" if t.top1 is not None else ""
            lines.append(
                f"| {t.call} | {t.batch} | {t.output} | {t.max_abs:.3g} | {_cells(t)} | {t.max_rel:.3g} | "
                f"{t.cosine:.8f} | {s.tolerance.min_cosine:g} | {top1} | {_yes(t.passed)} |"
            )
    return lines


def _generation_rows(sets: list[GraphSetParity]) -> list[str]:
    lines = [
        "| path | batch | prompt lengths | steps | token match | at least | first divergence | ties | max logit "
        "error | max abs logit | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sets:
        for g in s.generation:
            worst = max(g.per_step_max_abs, default=0.0)
            div = "-" if g.first_divergence is None else str(g.first_divergence)
            lines.append(
                f"| {g.path} | {g.batch} | {g.lengths} | {g.steps} | {g.token_match_rate:.4f} | "
                f"{s.tolerance.min_token_match:g} "
                f"| {div} | {g.ties} | {worst:.3g} | {max(g.per_step_scale, default=0.0):.3g} | {_yes(g.passed)} |"
            )
    return lines


def markdown(result: ParityResult, extras: Mapping[str, Any] | None = None) -> str:
    lines = [
        f"# Parity: {result.backend} vs PyTorch ({_precisions(result)}): {'PASSED' if result.passed else 'FAILED'}",
        "",
        "Each graph set is judged by its own precision's tolerances. Every output, row by row (its last axis: a "
        "position's "
        f"logits, a head's key or value at a position), by {RULE}; and by cosine. Generation is judged by its tokens: "
        "a mismatch is a tie (not a failure) where PyTorch's own two logits are within twice that row's logits limit; "
        "a generation step's logit error carries the cache's accumulated rounding and is shown, not judged.",
        "",
        *_quality_section(result),
        "# Proof: each graph computes its model",
        "",
        "## Graph sets",
        "",
        *summary_table(result),
        "",
        *_check_sections(result),
    ]
    for key, value in (extras or {}).items():
        lines += ["", f"## {key}", "", *_section(value)]
    return "\n".join(lines) + "\n"


def _quality_section(result: ParityResult) -> list[str]:
    """Quality apart from the proof: the graphs it measured (the portable graphs, or a target's
    quantized ones) against the checkpoint's model on text (``parity.quality``), its figures and how they count."""
    q = result.quality
    if q is None:
        return []
    head = [
        "# Quality: what the quantization costs",
        "",
        f"The {q.graphs} graphs against the checkpoint's model, teacher-forced on {q.source}: {q.judged}.",
        "",
    ]
    if q.note is not None:
        return head
    verdict = "-" if q.threshold is None else _yes(q.passed)
    return head + [
        "| text | real | tokens | top-1 agreement | agreement at least | mean KL (checkpoint \\|\\| graphs), "
        "nats | perplexity: checkpoint | perplexity: graphs | ok |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {q.source} | {_yes(q.real).lower()} | {q.tokens} | {q.agreement:.4f} | "
        f"{'-' if q.threshold is None else f'{q.threshold:g}'} | {q.kl:.4g} "
        f"| {q.perplexity_checkpoint:.4g} | {q.perplexity_graphs:.4g} | {verdict} |",
        "",
    ]


def _check_sections(result: ParityResult) -> list[str]:
    """The tensor and generation tables; an int4 export's twice: against the quantized model (the
    graphs' own int4 weights in PyTorch), then against the checkpoint's model (agreement)."""
    parts = [("", result.sets())]
    if result.quantized is not None:
        parts = [
            (f" against {quantized_model_name(result.quantized.precision)}", result.quantized.sets()),
            (" against the checkpoint's model (agreement)", result.sets()),
        ]
    lines: list[str] = []
    for title, sets in parts:
        lines += [
            "## Tensors" + title,
            "",
            *_tensor_rows(sets),
            "",
            "## Greedy generation (the graphs' tokens, scored by PyTorch at each prefix)" + title,
            "",
            *_generation_rows(sets),
            "",
        ]
    return lines[:-1]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(_cell, value)) or "-"
    return "-" if value is None else str(value)


def _flat(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, type(None))) or (
        isinstance(value, (list, tuple)) and all(_flat(v) and not isinstance(v, (list, tuple)) for v in value)
    )


def _section(value: Any) -> list[str]:
    """A table where the value has one: a list of records (a row each), or a record (a row per
    key); anything nested deeper stays a JSON block."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, dict) and all(_flat(x) for x in v.values()) for v in value)
    ):
        keys = list(dict.fromkeys(k for v in value for k in v))
        return [f"| {' | '.join(keys)} |", "|" + "---|" * len(keys)] + [
            f"| {' | '.join(_cell(v.get(k)) for k in keys)} |" for v in value
        ]
    if isinstance(value, dict) and value and all(_flat(v) for v in value.values()):
        return ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in value.items()]
    return ["```", json.dumps(value, indent=2), "```"]
