"""The mechanism of kiln's trace-time rewrites of transformers' code: a rewrite entered only while
torch.export traces a model that has the module it replaces (``while_exporting``; eager runs, kiln's
PyTorch reference, keep transformers' own code), and the one patch the complex rotaries need
(``patched_rotary``: a rotary class's ``forward`` and its module's ``apply_rotary_emb`` swapped for
real-arithmetic versions, restored on exit). Used by ``real_rotary`` (Llama 4), ``deepseek_rotary``
(DeepSeek-V2) and ``mamba2_scan``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Rewrite", "patched_rotary", "while_exporting"]

Rewrite = Callable[[], contextlib.AbstractContextManager[None]]


def while_exporting(model: nn.Module, module_class: str, rewrite: Rewrite) -> Rewrite:
    """What enters ``rewrite`` while torch.export traces ``model``, when it has a module of the
    class named ``module_class``, and nothing otherwise."""
    uses = any(type(m).__name__ == module_class for m in model.modules())

    def enter() -> contextlib.AbstractContextManager[None]:
        return rewrite() if uses and torch.compiler.is_exporting() else contextlib.nullcontext()

    return enter


@contextlib.contextmanager
def patched_rotary(module_name: str, rotary_class: str, forward: Any, apply: Any) -> Iterator[None]:
    """``module_name``'s ``rotary_class.forward`` and ``apply_rotary_emb`` replaced by ``forward``
    and ``apply`` while inside (restored on exit)."""
    module: Any = importlib.import_module(module_name)
    rotary_cls, original_apply = getattr(module, rotary_class), module.apply_rotary_emb
    original_forward = rotary_cls.forward
    rotary_cls.forward, module.apply_rotary_emb = forward, apply
    try:
        yield
    finally:
        rotary_cls.forward, module.apply_rotary_emb = original_forward, original_apply
