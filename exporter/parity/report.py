"""Parity reports: ``reports/parity.json`` (machine-readable), ``.md`` (for people) and
``.png`` (logit error per generation step).

Every graph set (the portable graphs and each target's, e.g. ``--target ort --ort-int8``) is
judged by its own precision's tolerances, and every table and the plot show them per set: an
int8 set sits 1000x above the fp32 tolerance and below its own. ``summary_table`` and
``verdict`` are the short forms ``kiln check`` and ``kiln export`` print.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.exporter.parity.results import GraphSetParity, ParityResult

__all__ = ["write_parity_reports", "markdown", "summary_table", "verdict", "plot_lines", "tolerance_lines"]


def write_parity_reports(result: ParityResult, directory: Path, extras: Mapping[str, Any] | None = None) -> list[Path]:
    """``parity.json``, ``.md`` and ``.png`` of ``result``, with ``extras`` (what else the export
    reports: PLE folding checks, fp32 islands, calibration...) after the checks."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "parity.json", directory / "parity.md", directory / "parity.png"]
    paths[0].write_text(json.dumps({**result.to_dict(), **(extras or {})}, indent=2) + "\n")
    paths[1].write_text(markdown(result, extras))
    _plot(result, paths[2])
    return paths


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def _precisions(result: ParityResult) -> str:
    return ", ".join(f"{s.name} {s.precision}" for s in result.sets())


def summary_table(result: ParityResult) -> list[str]:
    """One row per graph set: its precision, its tolerances, and its worst figures against them."""
    lines = [
        "| graph set | precision | worst logit error | logits tolerance | KV tolerance | cosine at least | lowest token match | token match at least | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result.sets():
        tol = s.tolerance
        lines.append(
            f"| {s.name} | {s.precision} | {s.worst_logits:.3g} | {tol.logits_atol:g} | {tol.kv_atol:g} | {tol.min_cosine:g} "
            f"| {s.token_match:.2%} | {tol.min_token_match:.0%} | {_yes(s.passed)} |"
        )
    return lines


def _set_figures(s: GraphSetParity) -> str:
    return (
        f"logits max abs error {s.worst_logits:.3g} (tolerance {s.tolerance.logits_atol:g}), "
        f"tokens {s.token_match:.0%} equal over {s.steps} steps in {len(s.generation)} runs"
    )


def verdict(result: ParityResult) -> str:
    """One line: passed or failed, and each graph set's worst logit error against its tolerance
    and its lowest token match."""
    sets = result.sets()
    figures = "; ".join(f"{s.name} ({s.precision}): {_set_figures(s)}" if len(sets) > 1 else _set_figures(s) for s in sets)
    return f"parity {'passed' if result.passed else 'FAILED'}: {figures}"


def _tensor_rows(result: ParityResult) -> list[str]:
    lines = ["| graph | output | max abs | tolerance | max rel | cosine | cosine at least | top-1 | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for s in result.sets():
        for t in s.tensors:
            top1 = f"{t.top1:.4f}" if t.top1 is not None else ""
            lines.append(
                f"| {t.graph} | {t.output} | {t.max_abs:.3g} | {t.atol:g} | {t.max_rel:.3g} | {t.cosine:.8f} | {s.tolerance.min_cosine:g} | {top1} | {_yes(t.passed)} |"
            )
    return lines


def _generation_rows(result: ParityResult) -> list[str]:
    lines = [
        "| path | batch | prompt lengths | steps | token match | at least | first divergence | ties | max logit error | tolerance | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result.sets():
        for g in s.generation:
            worst = max(g.per_step_max_abs) if g.per_step_max_abs else 0.0
            div = "-" if g.first_divergence is None else str(g.first_divergence)
            lines.append(
                f"| {g.path} | {g.batch} | {', '.join(map(str, g.prompt_lengths))} | {g.steps} | {g.token_match_rate:.4f} | {s.tolerance.min_token_match:g} "
                f"| {div} | {g.ties} | {worst:.3g} | {s.tolerance.logits_atol:g} | {_yes(g.passed)} |"
            )
    return lines


def markdown(result: ParityResult, extras: Mapping[str, Any] | None = None) -> str:
    lines = [
        f"# Parity: {result.backend} vs PyTorch ({_precisions(result)}): {'PASSED' if result.passed else 'FAILED'}",
        "",
        "Each graph set is judged by its own precision's tolerances.",
        "",
        "## Graph sets",
        "",
        *summary_table(result),
        "",
        "## Tensors",
        "",
        *_tensor_rows(result),
        "",
        "## Greedy generation (teacher-forced on PyTorch's tokens)",
        "",
        *_generation_rows(result),
    ]
    for key, value in (extras or {}).items():
        lines += ["", f"## {key}", "", *_section(value)]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(_cell, value)) or "-"
    return "-" if value is None else str(value)


def _flat(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, type(None))) or (isinstance(value, (list, tuple)) and all(_flat(v) and not isinstance(v, (list, tuple)) for v in value))


def _section(value: Any) -> list[str]:
    """A table where the value has one: a list of records (a row each), or a record (a row per
    key); anything nested deeper stays a JSON block."""
    if isinstance(value, list) and value and all(isinstance(v, dict) and all(_flat(x) for x in v.values()) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        return [f"| {' | '.join(keys)} |", "|" + "---|" * len(keys)] + [f"| {' | '.join(_cell(v.get(k)) for k in keys)} |" for v in value]
    if isinstance(value, dict) and value and all(_flat(v) for v in value.values()):
        return ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in value.items()]
    return ["```", json.dumps(value, indent=2), "```"]


_OVERLAP = 1e-3  # relative difference below which two lines are one on the log plot


def plot_lines(result: ParityResult) -> list[tuple[str, tuple[float, ...]]]:
    """The plot's lines: each generation run's per-step logit error (a zero drawn at 1e-12, on
    the log axis). Runs that would hide one another are drawn once, under one label that says
    so: ``=`` for exactly the same values, ``≈`` for values within 0.1% at every step."""
    groups: list[tuple[tuple[float, ...], list[tuple[str, tuple[float, ...]]]]] = []
    for g in result.generation:  # a target's paths carry its name ("ort:model")
        values = tuple(max(e, 1e-12) for e in g.per_step_max_abs)
        label = f"{g.path}, batch {g.batch}"
        same = [grp for grp in groups if len(grp[0]) == len(values) and all(abs(a - b) <= _OVERLAP * max(a, b) for a, b in zip(grp[0], values, strict=True))]
        if same:
            same[0][1].append((label, values))
        else:
            groups.append((values, [(label, values)]))
    lines = []
    for first, members in groups:
        if len(members) == 1:
            lines.append((members[0][0], first))
        elif all(v == first for _, v in members):
            lines.append((" = ".join(m[0] for m in members) + " (identical: one line)", first))
        else:
            lines.append((" ≈ ".join(m[0] for m in members) + " (within 0.1%: one line)", first))
    return lines


def tolerance_lines(result: ParityResult) -> list[tuple[str, float]]:
    """One dashed line per distinct logits tolerance, labelled with the sets it judges."""
    grouped: dict[float, list[str]] = {}
    for s in result.sets():
        grouped.setdefault(s.tolerance.logits_atol, []).append(f"{s.name} {s.precision}")
    return [(f"tolerance {atol:g} ({', '.join(names)})", atol) for atol, names in grouped.items()]


def _plot(result: ParityResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for label, errors in plot_lines(result):
        ax.semilogy(range(len(errors)), errors, label=label)
    for (label, atol), color in zip(tolerance_lines(result), itertools.cycle(("red", "purple", "darkorange", "black"))):
        ax.axhline(atol, color=color, linestyle="--", linewidth=1, label=label)
    ax.set_xlabel("generation step")
    ax.set_ylabel("max |logit error| vs PyTorch")
    ax.set_title(f"{result.backend} vs PyTorch: {_precisions(result)}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    # fixed metadata: the PNG's bytes depend only on the data
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
