"""Parity reports: ``reports/parity.json`` (machine-readable), ``.md`` (for people) and
``.png`` (logit error per generation step)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.exporter.parity.results import ParityResult

__all__ = ["write_parity_reports", "markdown"]


def write_parity_reports(result: ParityResult, directory: Path, extras: Mapping[str, Any] | None = None) -> list[Path]:
    """``parity.json``, ``.md`` and ``.png`` of ``result``, with ``extras`` (what else the export
    reports: PLE folding checks, fp32 islands, calibration...) after the checks."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "parity.json", directory / "parity.md", directory / "parity.png"]
    paths[0].write_text(json.dumps({**result.to_dict(), **(extras or {})}, indent=2) + "\n")
    paths[1].write_text(markdown(result, extras))
    _plot(result, paths[2])
    return paths


def markdown(result: ParityResult, extras: Mapping[str, Any] | None = None) -> str:
    verdict = "PASSED" if result.passed else "FAILED"
    tol = result.tolerance
    lines = [
        f"# Parity: {result.backend} vs PyTorch ({result.precision}): {verdict}",
        "",
        f"Tolerances: logits max abs {tol.logits_atol:g}, KV max abs {tol.kv_atol:g}, cosine >= {tol.min_cosine:g}.",
        "",
        "## Tensors",
        "",
        "| graph | output | max abs | max rel | cosine | top-1 | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in result.tensors:
        top1 = f"{t.top1:.4f}" if t.top1 is not None else ""
        lines.append(f"| {t.graph} | {t.output} | {t.max_abs:.3g} | {t.max_rel:.3g} | {t.cosine:.8f} | {top1} | {'yes' if t.passed else 'NO'} |")
    lines += [
        "",
        "## Greedy generation (teacher-forced on PyTorch's tokens)",
        "",
        "| path | batch | prompt lengths | steps | token match | first divergence | ties | max logit error | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in result.generation:
        worst = max(g.per_step_max_abs) if g.per_step_max_abs else 0.0
        div = "-" if g.first_divergence is None else str(g.first_divergence)
        lines.append(
            f"| {g.path} | {g.batch} | {', '.join(map(str, g.prompt_lengths))} | {g.steps} | {g.token_match_rate:.4f} "
            f"| {div} | {g.ties} | {worst:.3g} | {'yes' if g.passed else 'NO'} |"
        )
    sections = {**({"targets": result.to_dict()["targets"]} if result.targets else {}), **(extras or {})}
    for key, value in sections.items():
        lines += ["", f"## {key}", "", "```", json.dumps(value, indent=2), "```"]
    return "\n".join(lines) + "\n"


def _plot(result: ParityResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for g in result.generation:
        errors = [max(e, 1e-12) for e in g.per_step_max_abs]
        ax.semilogy(range(len(errors)), errors, label=f"{g.path}, batch {g.batch}")
    ax.axhline(result.tolerance.logits_atol, color="red", linestyle="--", linewidth=1, label="tolerance")
    ax.set_xlabel("generation step")
    ax.set_ylabel("max |logit error| vs PyTorch")
    ax.set_title(f"{result.backend} ({result.precision}) vs PyTorch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    # fixed metadata: the PNG's bytes depend only on the data
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
