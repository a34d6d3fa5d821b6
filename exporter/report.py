"""Parity reports: ``reports/parity.json`` (machine-readable), ``.md`` (for people) and
``.png`` (logit error per generation step)."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.exporter.parity import ParityResult

__all__ = ["write_parity_reports", "markdown"]


def write_parity_reports(result: ParityResult, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "parity.json", directory / "parity.md", directory / "parity.png"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    paths[1].write_text(markdown(result))
    _plot(result, paths[2])
    return paths


def markdown(result: ParityResult) -> str:
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
    for key, value in result.extra.items():
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
