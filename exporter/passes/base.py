"""Running a list of passes on onnx-ir's pass infrastructure, with kiln's errors.

``onnx_ir.passes.Sequential`` wraps whatever a pass raises in a ``PassError`` naming the pass.
A ``KilnError`` (a graph that breaks the contract, a rule a quantized graph violates) is a
message for the user, not a bug: ``run_passes`` re-raises it as the same class with the
failing pass and graph named in front; anything else keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import onnx_ir as ir

from kiln.errors import ExportError, KilnError
from kiln.exporter.passes.reports import Report

__all__ = ["GraphRewrite", "run_passes", "pass_name"]


def pass_name(pass_: ir.passes.PassBase) -> str:
    return repr(pass_) if isinstance(pass_, GraphRewrite) else type(pass_).__name__


def run_passes(model: ir.Model, passes: Sequence[ir.passes.PassBase], *, graph: str) -> ir.Model:
    """``model`` after every pass in order (in place where the passes are)."""
    for pass_ in passes:
        try:
            model = pass_(model).model
        except ir.passes.PostconditionError as exc:  # a KilnError raised by ensures() is wrapped
            if not isinstance(exc.__cause__, KilnError):
                raise
            raise type(exc.__cause__)(f"pass {pass_name(pass_)} on the {graph} graph: {exc.__cause__.args[0]}") from exc
        except KilnError as exc:
            message = exc.args[0] if exc.args else ""
            raise type(exc)(f"pass {pass_name(pass_)} on the {graph} graph: {message}") from exc
    return model


R = TypeVar("R")


class GraphRewrite(ir.passes.InPlacePass, Generic[R]):
    """An in-place rewrite function (``rewrite(model) -> what it did``) as a pass: ``result``
    holds what it returned, and, given a ``reporter``, ``report`` what the manifest records of it
    under ``name`` (``passes.reports``). Postcondition: the graph's input and output names are
    those it had (a rewrite replaces what computes the contract, never the contract itself)."""

    def __init__(
        self,
        rewrite: Callable[[ir.Model], R],
        name: str | None = None,
        reporter: Callable[[R], Report | None] | None = None,
    ) -> None:
        super().__init__()
        self.rewrite = rewrite
        self.result: R | None = None
        self.report_name = name or repr(self)
        self._reporter = reporter
        self._io: tuple[list[str | None], list[str | None]] = ([], [])

    def __repr__(self) -> str:
        return getattr(self.rewrite, "__name__", type(self).__name__)

    @property
    def report(self) -> Report | None:
        """What the manifest records of this rewrite (None: it has not run, or reports nothing)."""
        return self._reporter(self.result) if self._reporter is not None and self.result is not None else None

    def requires(self, model: ir.Model) -> None:
        self._io = ([v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs])

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.result = self.rewrite(model)
        return ir.passes.PassResult(model, modified=bool(self.result))

    def ensures(self, model: ir.Model) -> None:
        now = ([v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs])
        if now != self._io:
            raise ExportError(f"{self!r} changed the graph's inputs/outputs from {self._io} to {now}")
