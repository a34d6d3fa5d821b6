"""``reports/parity.png``: two panels over the generation steps of every run of every graph set.

Above, the logit error relative to the step's scale (max |logit error| / max |PyTorch logit|, on
a log axis), with each distinct logits rtol dashed: the same units as the tensor checks' rule,
though a generation step is judged by its token, not by it. Below, token agreement: the share of
the batch whose argmax is PyTorch's token. Every run keeps its own line (colour per run, marker
per graph set, dashes for model.onnx), so lines that nearly coincide stay apart; only exactly
equal runs share one, and the legend (below the panels, clear of the axes) says so.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.exporter.parity.results import ParityResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PlotLine", "plot_lines", "tolerance_lines", "figure", "write_plot"]

_FLOOR = 1e-12  # where a zero error is drawn on the log axis
_MARKERS = ("o", "x", "^", "s", "d")


@dataclasses.dataclass(frozen=True)
class PlotLine:
    label: str
    graph_set: str  # "portable" or the target's name: picks the marker
    model: bool  # the model.onnx path: dashed
    relative: tuple[float, ...]  # per step: max |logit error| / max |reference logit|
    match: tuple[float, ...]  # per step: share of the batch whose argmax is the reference's


def plot_lines(result: ParityResult) -> list[PlotLine]:
    """One line per generation run, a target's labelled with its name (``ort:model``); runs
    whose figures are exactly equal share one line under a label that says so."""
    lines: list[PlotLine] = []
    for g in result.generation:
        relative = tuple(max(e / s if s > 0 else e, _FLOOR) for e, s in zip(g.per_step_max_abs, g.per_step_scale, strict=True))
        line = PlotLine(g.label, g.target or "portable", g.path.endswith("model"), relative, g.per_step_match)
        same = next((i for i, other in enumerate(lines) if (other.relative, other.match) == (relative, g.per_step_match)), None)
        if same is None:
            lines.append(line)
        else:
            first = lines[same]
            label = first.label.removesuffix(" (identical: one line)") + f" = {g.label} (identical: one line)"
            lines[same] = dataclasses.replace(first, label=label)
    return lines


def tolerance_lines(result: ParityResult) -> list[tuple[str, float]]:
    """One dashed line per distinct logits rtol, labelled with the sets it judges."""
    grouped: dict[float, list[str]] = {}
    for s in result.sets():
        grouped.setdefault(s.tolerance.logits_rtol, []).append(f"{s.name} {s.precision}")
    return [(f"logits rtol {rtol:g} ({', '.join(names)})", rtol) for rtol, names in grouped.items()]


def _match_lines(result: ParityResult) -> list[tuple[str, float]]:
    """The token match thresholds below 100% (the low-bit sets'), one per distinct value."""
    grouped: dict[float, list[str]] = {}
    for s in result.sets():
        if s.tolerance.min_token_match < 1.0:
            grouped.setdefault(s.tolerance.min_token_match, []).append(f"{s.name} {s.precision}")
    return [(f"token match at least {m:.0%} ({', '.join(names)})", m) for m, names in grouped.items()]


def write_plot(result: ParityResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(path, metadata={"Software": None})  # fixed metadata: the PNG's bytes depend only on the data
    plt.close(fig)


def figure(result: ParityResult) -> Figure:
    """The two panels, their legend below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = plot_lines(result)
    markers = {name: m for name, m in zip(dict.fromkeys(line.graph_set for line in lines), itertools.cycle(_MARKERS))}
    fig, (error, tokens) = plt.subplots(2, 1, figsize=(8, 6.5 + 0.18 * len(lines)), dpi=100, sharex=True, layout="constrained", height_ratios=(3, 2))
    colors = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for index, (line, color) in enumerate(zip(lines, colors)):
        size = max(2.0, 7.0 - 1.5 * index)  # each line drawn smaller than the one before: one hidden under a later one still shows
        style = dict(color=color, marker=markers[line.graph_set], markersize=size, linestyle="--" if line.model else "-", linewidth=max(0.8, 2.4 - 0.4 * index))
        error.semilogy(range(len(line.relative)), line.relative, label=line.label, **style)
        tokens.plot(range(len(line.match)), [100 * m for m in line.match], **style)
    dashes = itertools.cycle(("red", "purple", "darkorange", "black"))
    for label, rtol in tolerance_lines(result):
        error.axhline(rtol, color=next(dashes), linestyle=":", linewidth=1.5, label=label)
    for label, share in _match_lines(result):
        tokens.axhline(100 * share, color=next(dashes), linestyle=":", linewidth=1.5, label=label)
    error.set_ylabel("max |logit error| / max |logit|")
    error.set_title(f"{result.backend} vs PyTorch: {', '.join(f'{s.name} {s.precision}' for s in result.sets())}")
    tokens.set_ylabel("tokens equal to PyTorch's (%)")
    tokens.set_ylim(-5, 105)
    tokens.set_xlabel("generation step (the graphs' own tokens, scored by PyTorch)")
    handles = [h for ax in (error, tokens) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7)
    return fig
