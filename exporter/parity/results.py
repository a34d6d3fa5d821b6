"""What a parity check found: per tensor, per generation run, and for one whole graph set."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.exporter.parity.failure import ParityFailure
from kiln.exporter.parity.quality import QualityResult
from kiln.exporter.tolerance import RULE, Bound, Tolerance

__all__ = ["TensorCheck", "GenerationCheck", "TargetParity", "GraphSetParity", "ParityResult", "quantized_model_name"]


@dataclasses.dataclass(frozen=True)
class TensorCheck:
    """One output of one graph, judged row by row by ``|a - b| <= atol + rtol * max|b| of the row``;
    ``error`` and ``scale`` are the figures of the row closest to its limit (``limit``)."""

    graph: str
    output: str
    max_abs: float  # over the whole tensor (its real positions)
    max_rel: float  # element-wise, |a - b| / max(|b|, 1e-6): shown, not judged
    cosine: float
    top1: float | None  # logits only: fraction of positions whose argmax agrees
    atol: float
    rtol: float
    error: float  # the max abs error of the row closest to its limit...
    scale: float  # ... and that row's max |reference|
    passed: bool
    target: str | None = None  # the graph set: None for the portable graphs (or engines), else the target's name
    batch: int = 2  # the feeds' batch: 2 (a left-padded row and a full one), or 1 (the full row alone)
    empty_cache: bool = False  # the unified graph's prompt call from an empty cache (its other call has a past)

    @property
    def call(self) -> str:
        """The graph and which call of it: ``model``, ``model (empty cache)``."""
        return f"{self.graph}{' (empty cache)' if self.empty_cache else ''}"

    @property
    def label(self) -> str:
        """``prefill:logits``, ``prefill (batch 1):logits``, ``model (empty cache) (batch 1):logits``."""
        return f"{self.call}{' (batch 1)' if self.batch == 1 else ''}:{self.output}"

    @property
    def limit(self) -> float:
        return Bound(self.atol, self.rtol).limit(self.scale)

    @property
    def ratio(self) -> float:
        """The error as a fraction of its row's limit: above 1 fails."""
        return self.error / self.limit

    def describe(self) -> str:
        """``0.00159 (tolerance 1e-05 + 0.0001 x max|row| = 0.00424 at max|row| 42.3)``: the worst row against its
        limit."""
        return f"{self.error:.3g} (tolerance {Bound(self.atol, self.rtol).describe(self.scale)})"


@dataclasses.dataclass(frozen=True)
class GenerationCheck:
    path: str  # "prefill+decode" or "model"
    batch: int
    prompt_lengths: tuple[int, ...]
    padded_to: int  # the prompt step's length: a row shorter than it is padded (left; an encoder's input, right)
    steps: int
    token_match_rate: float
    first_divergence: int | None  # first step where a non-tie argmax differs
    ties: int
    per_step_max_abs: tuple[float, ...]  # logits, max over the batch: shown, not judged (tokens are)
    per_step_scale: tuple[float, ...]  # max |reference logit| of each step, over the batch
    per_step_match: tuple[float, ...]  # fraction of the batch whose argmax is the reference's token
    passed: bool
    target: str | None = None  # the graph set, as TensorCheck.target

    @property
    def lengths(self) -> str:
        """The prompt lengths, ``12, 8, 5``, and the padding when a run pads beyond them: ``8 (padded to 12)``."""
        padded = f" (padded to {self.padded_to})" if self.padded_to > max(self.prompt_lengths) else ""
        return ", ".join(map(str, self.prompt_lengths)) + padded

    @property
    def label(self) -> str:
        """The run in words: ``prefill+decode, batch 1`` (``..., batch 1, 8 (padded to 12)``)."""
        return f"{self.path}, batch {self.batch}" + (
            f", {self.lengths}" if self.padded_to > max(self.prompt_lengths) else ""
        )


@dataclasses.dataclass(frozen=True)
class TargetParity:
    """A target's graph set, as merged into the export's result (its checks are in the lists)."""

    backend: str
    precision: str
    passed: bool
    tolerance: Tolerance


@dataclasses.dataclass(frozen=True)
class GraphSetParity:
    """The checks of one graph set (the portable graphs, or one target's) with its own precision
    and tolerances: what every report shows per set."""

    name: str  # "portable", or the target's name
    precision: str
    tolerance: Tolerance
    tensors: tuple[TensorCheck, ...]
    generation: tuple[GenerationCheck, ...]

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors) and all(g.passed for g in self.generation)

    def worst(self, logits: bool) -> TensorCheck | None:
        """The logits check (or, ``logits=False``, the KV/other check) closest to its limit."""
        checks = [t for t in self.tensors if (t.output == "logits") == logits]
        return max(checks, key=lambda t: t.ratio, default=None)

    @property
    def token_match(self) -> float:
        """The lowest teacher-forced token match rate of its generation runs (1.0 without any)."""
        return min((g.token_match_rate for g in self.generation), default=1.0)

    @property
    def steps(self) -> int:
        return sum(g.steps for g in self.generation)


@dataclasses.dataclass
class ParityResult:
    """The checks of every graph set of an export against PyTorch. For an int4 export, the
    checks against the checkpoint's own model (these lists) measure the quantized model's
    agreement with it; ``quantized`` holds the same graph sets' checks against the quantized model
    (PyTorch on the graphs' own int4 weights, ``parity.quantized``), judged at the float
    precision's tolerances: what proves each graph computes what it should. Those always gate;
    agreement gates unless ``agreement_gates`` is off (``--parity-agreement record``)."""

    backend: str
    precision: str
    tolerance: Tolerance
    tensors: list[TensorCheck] = dataclasses.field(default_factory=list)
    generation: list[GenerationCheck] = dataclasses.field(default_factory=list)
    targets: dict[str, TargetParity] = dataclasses.field(default_factory=dict)
    quantized: ParityResult | None = None
    agreement_gates: bool = True
    # the quantized graphs (``QualityResult.graphs``) against the checkpoint's model on text (``parity.quality``):
    # judged apart from ``passed``
    quality: QualityResult | None = None

    @property
    def agreed(self) -> bool:
        """Whether every check against the checkpoint's model passed."""
        return all(t.passed for t in self.tensors) and all(g.passed for g in self.generation)

    @property
    def passed(self) -> bool:
        exact = self.quantized is None or self.quantized.passed
        return exact and (self.agreed or not self.agreement_gates)

    def failures(self) -> list[str]:
        """One line per failed check that gates, each against its own graph set's tolerances
        (those against the quantized model first, named so): ``failure_records``' text."""
        return [failure.text for failure in self.failure_records()]

    def failure_records(self) -> list[ParityFailure]:
        """``failures`` as data: each failed check that gates, with the graph call or generation
        path it belongs to and the reference it was judged against."""
        q = self.quantized
        reference = f"against {quantized_model_name(q.precision)}" if q is not None else ""
        out = [f.against(reference) for f in q.failure_records()] if q is not None else []
        if not self.agreement_gates:
            return out
        own = self._own_failures()
        agreement = [f.against("agreement with the checkpoint's model") for f in own] if q is not None else own
        return out + agreement

    def _own_failures(self) -> list[ParityFailure]:
        out: list[ParityFailure] = []
        for s in self.sets():
            out += [_tensor_failure(t, s.tolerance) for t in s.tensors if not t.passed]
            out += [_generation_failure(g, s.tolerance) for g in s.generation if not g.passed]
        return out

    def merge(self, target: str, other: ParityResult) -> ParityResult:
        """Append a target graph set's checks (in place) under the target's name (``prefill.ort``,
        ``ort:prefill+decode``), each with the tolerance of the target's own precision, so that
        ``passed``, the reports and ``kiln check`` cover every set of graphs of the export."""
        self.tensors += [dataclasses.replace(t, graph=f"{t.graph}.{target}", target=target) for t in other.tensors]
        self.generation += [dataclasses.replace(g, path=f"{target}:{g.path}", target=target) for g in other.generation]
        self.targets[target] = TargetParity(other.backend, other.precision, other.passed, other.tolerance)
        return self

    def merge_quantized(self, target: str | None, other: ParityResult) -> ParityResult:
        """A graph set's checks against the quantized model: ``quantized`` itself for the first
        set (``target`` None), merged into it under the target's name for the others."""
        if target is None:
            assert self.quantized is None, "the first graph set comes first"
            self.quantized = other
        else:
            assert self.quantized is not None, (
                "the portable graphs are checked against the quantized model before any target"
            )
            self.quantized.merge(target, other)
        return self

    def sets(self) -> list[GraphSetParity]:
        """The checks grouped by graph set, each with its own precision and tolerances: the
        portable graphs (or the engines) first, then every target in the order merged."""
        own = [("portable", None, self.precision, self.tolerance)] + [
            (name, name, t.precision, t.tolerance) for name, t in self.targets.items()
        ]
        return [
            GraphSetParity(
                name,
                precision,
                tolerance,
                tuple(t for t in self.tensors if t.target == key),
                tuple(g for g in self.generation if g.target == key),
            )
            for name, key, precision, tolerance in own
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "precision": self.precision,
            "passed": self.passed,
            "rule": RULE,  # what the tolerances' atol and rtol mean
            "tolerance": dataclasses.asdict(self.tolerance),
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
            "generation": [dataclasses.asdict(g) for g in self.generation],
            **({"targets": {name: dataclasses.asdict(t) for name, t in self.targets.items()}} if self.targets else {}),
            **(
                {"quantized": self.quantized.to_dict(), "agreement_gates": self.agreement_gates}
                if self.quantized is not None
                else {}
            ),
            **({"quality": self.quality.to_dict()} if self.quality is not None else {}),
        }


def quantized_model_name(precision: str) -> str:
    """What the second reference of a ``precision`` export is called in messages and reports:
    PyTorch on its int4 weights (``parity.quantized``) or with its Q/DQ scales (``parity.qdq_model``)."""
    return "the int4 weights' model" if "int4" in precision else "the calibrated Q/DQ model"


def _tensor_failure(t: TensorCheck, tolerance: Tolerance) -> ParityFailure:
    """``decode (batch 1):logits max abs 0.00159 (tolerance ...), cosine 0.999990 (at least 0.999999)``."""
    return ParityFailure(
        kind="tensor",
        subject=t.call,
        check=t.label,
        message=f"max abs {t.describe()}, cosine {t.cosine:.6f} (at least {tolerance.min_cosine:g})",
    )


def _generation_failure(g: GenerationCheck, tolerance: Tolerance) -> ParityFailure:
    """``generation via prefill+decode, batch 2: token match 0.500 (at least 1), first divergence at step 2``
    (``every mismatch a near-tie (3)`` where no step diverged beyond a tie)."""
    where = (
        f"first divergence at step {g.first_divergence}"
        if g.first_divergence is not None
        else f"every mismatch a near-tie ({g.ties})"
    )
    return ParityFailure(
        kind="generation",
        subject=g.path,
        check=g.label,
        message=f"token match {g.token_match_rate:.3f} (at least {tolerance.min_token_match:g}), {where}",
    )
