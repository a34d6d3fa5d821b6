"""LFM2's short convolution in one form at any length, patched in while a graph is traced.

transformers 5.25's ``Lfm2ShortConv`` (and ``Lfm2MoeShortConv``) convolves through its module's
``causal_conv1d_forward``, which takes the one-token update (``causal_conv1d_update``, writing the
window in place) when a step is one token long, and the model's ``create_recurrent_attention_mask``
drops the padding mask at one token: with a dynamic ``seq`` each is a guard torch.export refuses, as
in Mamba2's mixer. So while ``torch.compiler.is_exporting()`` both take the one form of
``mamba2_scan`` (the cached window and the new columns concatenated and convolved; the step's columns
of the 2-D mask always applied, a decode step's token never being padding). Eager runs (kiln's
PyTorch reference) keep transformers' own code. The layer has no SSM state: its cache is the conv
window alone (plugins/hf/recurrent_state.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from kiln.plugins.hf.mamba2_scan import conv_forward, padding_mask
from kiln.plugins.hf.trace_rewrites import Rewrite, while_exporting

__all__ = ["SHORT_CONVS", "short_conv_rewrites_for"]

# the short-convolution classes, and the transformers module whose functions each one calls
SHORT_CONVS = {
    "Lfm2ShortConv": "transformers.models.lfm2.modeling_lfm2",
    "Lfm2MoeShortConv": "transformers.models.lfm2_moe.modeling_lfm2_moe",
}
_NAMES = ("causal_conv1d_forward", "create_recurrent_attention_mask")


@contextlib.contextmanager
def _traced_short_conv(module_name: str) -> Iterator[None]:
    """``module_name``'s convolution and padding mask in the one-form code while inside (restored on exit)."""
    module: Any = importlib.import_module(module_name)
    saved = [getattr(module, n) for n in _NAMES]
    for name, new in zip(_NAMES, (conv_forward, padding_mask), strict=True):
        setattr(module, name, new)
    try:
        yield
    finally:
        for name, old in zip(_NAMES, saved, strict=True):
            setattr(module, name, old)


def short_conv_rewrites_for(model: nn.Module) -> Rewrite:
    """What enters ``_traced_short_conv`` while torch.export traces a model with a short convolution
    (``SHORT_CONVS``), and nothing otherwise."""
    found = next((name for name in SHORT_CONVS if any(type(m).__name__ == name for m in model.modules())), None)
    name = found or "Lfm2ShortConv"
    return while_exporting(model, name, functools.partial(_traced_short_conv, SHORT_CONVS[name]))
