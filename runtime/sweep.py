"""Decode-step time against past length (issue 8's cost-growth target): measure, fit, plot.

A decode step with a KV cache reads the weights once and the cache once, so its time should be
``intercept + slope * past``: linear, no recomputation of the past. The fitted slope (ms per
1,000 past tokens) compares how each graph's attention scales; r² and the worst relative
residual say whether "linear" actually holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.exporter.progress import Progress
from kiln.newfile import new_output
from kiln.runtime.decoder_dirs import DecoderDir
from kiln.runtime.feeds import Sizes
from kiln.runtime.timing import Timed, interleaved, vocab_of

__all__ = ["fit_line", "plot_sweep", "render_sweep", "runs_at", "sweep"]


def runs_at(past: int, runs: int) -> int:
    """Fewer runs at long pasts (each costs more), never fewer than 5."""
    return max(5, min(runs, runs * 512 // max(past, 1)))


def fit_line(pasts: list[int], ms: list[float]) -> dict[str, float]:
    """Least-squares ``ms = intercept + slope * past``; slope reported per 1,000 tokens."""
    x, y = np.asarray(pasts, dtype=np.float64), np.asarray(ms, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("a slope needs at least two different past lengths")
    slope, intercept = np.polyfit(x, y, 1)
    fitted = intercept + slope * x
    ss_res, ss_tot = float(((y - fitted) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {
        "slope_ms_per_1k": float(slope * 1000),
        "intercept_ms": float(intercept),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "max_rel_residual": float(np.max(np.abs(y - fitted) / y)),
    }


def sweep(
    decoders: list[DecoderDir],
    labels: list[str],
    sessions: dict[Path, Any],
    options: Any,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Decode-step medians of every directory at every past in ``options.sweep``, interleaved
    across directories at each past (each past's warm-up and runs a stage of ``progress``)."""

    pasts = sorted(set(options.sweep))
    medians: dict[str, list[float]] = {label: [] for label in labels}
    runs = []
    vocabs = [vocab_of(sessions[d.decode], d) for d in decoders]
    for past in pasts:
        calls: dict[str, Callable[[], object]] = {}  # (rebinding it frees the previous past's KV feeds first)
        for label, d, vocab in zip(labels, decoders, vocabs, strict=True):
            calls[label] = Timed(d, sessions[d.decode], Sizes(seq=1, past=past), vocab)
        runs.append(runs_at(past, options.sweep_runs))
        what = f"sweep: decode step (past {past})"
        for label, ms in interleaved(calls, runs[-1], options.pause_s, warmup=2, progress=progress, what=what).items():
            medians[label].append(ms)
    return {
        "pasts": pasts,
        "runs": runs,
        "median_ms": medians,
        "fit": {label: fit_line(pasts, ms) for label, ms in medians.items()} if len(pasts) > 1 else {},
    }


def render_sweep(result: dict[str, Any]) -> str:
    pasts = result["pasts"]
    lines = [
        "decode step (ms) against past length, runs per past: " + ", ".join(map(str, result["runs"])),
        "",
        "| backend | " + " | ".join(str(p) for p in pasts) + " | slope ms/1k past | intercept ms | r² |",
        "|---|" + "---|" * (len(pasts) + 3),
    ]
    for label, ms in result["median_ms"].items():
        fit = result["fit"].get(label)
        tail = f"{fit['slope_ms_per_1k']:.3f} | {fit['intercept_ms']:.2f} | {fit['r2']:.3f}" if fit else "- | - | -"
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {tail} |")
    return "\n".join(lines)


def plot_sweep(result: dict[str, Any], path: Path) -> Path:
    """A PNG of decode-step time against past length, one line (and its fit) per directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.asarray(result["pasts"], dtype=np.float64)
    for label, ms in result["median_ms"].items():
        (line,) = ax.plot(x, ms, marker="o", label=label)
        fit = result["fit"].get(label)
        if fit:
            ax.plot(x, fit["intercept_ms"] + fit["slope_ms_per_1k"] * x / 1000, linestyle=":", color=line.get_color())
    ax.set_xlabel("past length (tokens)")
    ax.set_ylabel("decode step, median ms")
    ax.set_title("decode step vs past (dotted: linear fit)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with new_output(path) as staged:  # whole or as it was; a link at path is replaced, never written through
        fig.savefig(staged, dpi=110, format=path.suffix[1:].lower() or "png")  # by path's suffix, as savefig(path)
    plt.close(fig)
    return path
