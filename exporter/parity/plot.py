"""``reports/parity.png``: the proof's two panels over the generation steps of every run of every
graph set, and the quality's own panel when it was measured.

Above, each step's max |logit error| (log axis) and, dotted in the run's colour, the limit the
precision's rule gives at that step, atol + rtol x the step's max |PyTorch logit| (a generation
step is judged by its token, not by it: the limit shows how far inside the tensor checks' rule
its logits are). Middle, the token rule as it judges: the run's token match so far (the share of
steps, and rows, whose token is PyTorch's argmax), judged once at the run's end against its floor,
drawn at the right edge (ties excepted, which the report counts). Every run keeps its own line
(colour per run, marker per graph set, dashes for model.onnx), so lines that nearly coincide stay
apart; only exactly equal runs share one, and the legend (below the panels) says so. Below, apart
from the proof: the quality on text (``parity.quality``), top-1 agreement against its gate.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.exporter.parity.results import ParityResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PlotLine", "plot_lines", "limit_labels", "run_rules", "figure", "write_plot"]

_FLOOR = 1e-12  # where a zero error is drawn on the log axis
_MARKERS = ("o", "x", "^", "s", "d")


@dataclasses.dataclass(frozen=True)
class PlotLine:
    label: str
    graph_set: str  # "portable" or the target's name: picks the marker
    model: bool  # the model.onnx path: dashed
    error: tuple[float, ...]  # per step: max |logit error| (at least _FLOOR)
    limit: tuple[float, ...]  # per step: atol + rtol x max |reference logit|, its set's logits rule
    match: tuple[float, ...]  # per step: share of the batch whose argmax is the reference's

    @property
    def run_match(self) -> tuple[float, ...]:
        """The run's token match so far at each step: what the whole-run rule judges at the end."""
        return tuple(total / (i + 1) for i, total in enumerate(itertools.accumulate(self.match)))


def plot_lines(result: ParityResult) -> list[PlotLine]:
    """One line per generation run, a target's labelled with its name (``ort:model``); runs
    whose figures are exactly equal share one line under a label that says so."""
    rules = {s.name: s.tolerance.logits for s in result.sets()}
    lines: list[PlotLine] = []
    for g in result.generation:
        error = tuple(max(e, _FLOOR) for e in g.per_step_max_abs)
        limit = tuple(rules[g.target or "portable"].limit(s) for s in g.per_step_scale)
        line = PlotLine(g.label, g.target or "portable", g.path.endswith("model"), error, limit, g.per_step_match)
        same = next(
            (
                i
                for i, other in enumerate(lines)
                if (other.error, other.limit, other.match) == (error, limit, g.per_step_match)
            ),
            None,
        )
        if same is None:
            lines.append(line)
        else:
            first = lines[same]
            label = first.label.removesuffix(" (identical: one line)") + f" = {g.label} (identical: one line)"
            lines[same] = dataclasses.replace(first, label=label)
    return lines


def limit_labels(result: ParityResult) -> dict[str, str]:
    """Per graph set, the label of its runs' dotted limits: ``limit 1e-05 + 0.0001 x max|logit| (portable fp32)``."""
    return {
        s.name: f"limit {s.tolerance.logits_atol:g} + {s.tolerance.logits_rtol:g} x step's max|logit| ({s.name} "
        f"{s.precision})"
        for s in result.sets()
    }


def run_rules(result: ParityResult) -> list[tuple[str, float]]:
    """The whole-run token-match floors, one per distinct value, labelled with the sets they judge."""
    grouped: dict[float, list[str]] = {}
    for s in result.sets():
        grouped.setdefault(s.tolerance.min_token_match, []).append(f"{s.name} {s.precision}")
    return [
        (f"whole run: token match at least {m:.0%}, ties excepted ({', '.join(names)})", m)
        for m, names in grouped.items()
    ]


def write_plot(result: ParityResult, path: Path) -> None:
    fig = figure(result)
    fig.savefig(path, metadata={"Software": None})  # fixed metadata: the PNG's bytes depend only on the data


def figure(result: ParityResult) -> Figure:
    """The proof's two panels, the quality's below them when measured, the legend at the bottom.

    A bare ``Figure`` on the Agg canvas, not pyplot: no pyplot state (its figure list, a backend
    picked for the machine) and nothing to close; the same figure and PNG as ``pyplot.subplots``
    drew (``test_the_plot_is_pyplots_png``)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = plot_lines(result)
    quality = result.quality is not None and result.quality.note is None
    ratios = (3, 2, 1.4) if quality else (3, 2)
    fig = Figure(figsize=(8, 6.5 + 1.2 * quality + 0.18 * len(lines)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # the figure's canvas: savefig writes PNG through Agg whatever backend pyplot would pick
    axes = fig.subplots(len(ratios), 1, height_ratios=ratios)
    error, tokens = axes[0], axes[1]
    tokens.sharex(error)
    _proof(result, lines, error, tokens, matplotlib.rcParams["axes.prop_cycle"].by_key()["color"])
    if quality:
        _quality(result, axes[2])
    handles = [h for ax in (error, tokens) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7)
    return fig


def _proof(result: ParityResult, lines: list[PlotLine], error: Axes, tokens: Axes, palette: list[str]) -> None:
    """Each run's logit error against its per-step limit, and its token match so far against the run's floor."""
    markers = {name: m for name, m in zip(dict.fromkeys(line.graph_set for line in lines), itertools.cycle(_MARKERS))}
    labels, labelled = limit_labels(result), set()
    for index, (line, color) in enumerate(zip(lines, itertools.cycle(palette))):
        size = max(
            2.0, 7.0 - 1.5 * index
        )  # each line drawn smaller than the one before: one hidden under a later one still shows
        style: dict[str, Any] = dict(
            color=color,
            marker=markers[line.graph_set],
            markersize=size,
            linestyle="--" if line.model else "-",
            linewidth=max(0.8, 2.4 - 0.4 * index),
        )
        steps = range(len(line.error))
        error.semilogy(steps, line.error, label=line.label, **style)
        first = line.graph_set not in labelled
        labelled.add(line.graph_set)
        error.semilogy(
            steps,
            line.limit,
            color=color,
            linestyle=":",
            linewidth=1.2,
            label=labels[line.graph_set] if first else "_nolegend_",
        )
        tokens.plot(steps, [100 * m for m in line.run_match], **style)
    for (label, share), color in zip(run_rules(result), itertools.cycle(("red", "purple", "darkorange", "black"))):
        tokens.axhline(
            100 * share, xmin=0.9, xmax=1.0, color=color, linestyle=":", linewidth=2.5, label=label
        )  # judged at the run's end
    error.set_ylabel("max |logit error| (dotted: its limit)")
    error.set_title(
        f"proof: {result.backend} vs PyTorch: {', '.join(f'{s.name} {s.precision}' for s in result.sets())}"
    )
    tokens.set_ylabel("run's token match so far (%)")
    tokens.set_ylim(-5, 105)
    tokens.set_xlabel("generation step (the graphs' own tokens, scored by PyTorch)")


def _quality(result: ParityResult, ax: Axes) -> None:
    """The quality apart from the proof: top-1 agreement on text against its gate, KL and perplexities in the title."""
    q = result.quality
    assert q is not None
    ax.barh([0], [100 * q.agreement], color="tab:blue" if q.passed else "tab:red", height=0.5)
    if q.threshold is not None:
        ax.axvline(
            100 * q.threshold, color="black", linestyle=":", linewidth=2, label=f"gate: at least {q.threshold:g}"
        )
    ax.set_xlim(0, 100)
    ax.set_yticks([0], [f"top-1 agreement {q.agreement:.3f}"])
    ax.set_xlabel("top-1 agreement with the checkpoint's model on the text (%)")
    ax.set_title(
        f"quality, apart from the proof ({q.judged})\n{q.tokens} tokens of {q.source}\n"
        f"KL {q.kl:.3g} nats, perplexity {q.perplexity_checkpoint:.4g} (checkpoint) -> {q.perplexity_graphs:.4g} "
        f"({q.graphs} graphs)",
        fontsize=8,
    )
