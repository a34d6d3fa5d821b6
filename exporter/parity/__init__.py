"""The parity stage: every graph against the PyTorch model, tensor by tensor and token by token.

- Tensor level: each output of each graph against PyTorch on the same inputs (left-padded
  batches, non-empty past), judged row by row by ``|a - b| <= atol + rtol * max|b| of the row``
  (``tolerances``: per precision, for the logits and for the KV cache) and by cosine; max rel
  and the top-1 agreement of the logits are shown.
- Generation level: PyTorch generates greedily with its KV cache; the graphs are then fed the
  same tokens (teacher forcing) through prefill + decode, and through model.onnx alone, and at
  every step their argmax and logits are compared with PyTorch's. If every step's argmax
  agrees, the graphs' own greedy generation is the same token sequence (by induction), and a
  divergence is pinned to its first step with the logit error of every step recorded.
  A mismatch where PyTorch's own two logits are within twice that row's logits limit is a tie,
  which no runtime can be blamed for; it is counted apart and does not fail the check. Batch 1
  and a padded batch run (at ``--max-batch 1``, one shorter prompt padded at batch 1).
"""

from __future__ import annotations

from kiln.exporter.parity.driver import (
    Candidate,
    ParitySettings,
    QuantizedModel,
    check_parity,
    parity_plan,
    quantized_model,
    run_parity,
)
from kiln.exporter.parity.generation import (
    encoder_states,
    generation_parity,
    greedy,
    left_pad,
    make_prompts,
)
from kiln.exporter.parity.results import (
    GenerationCheck,
    ParityResult,
    TargetParity,
    TensorCheck,
)
from kiln.exporter.parity.tensors import tensor_feeds, tensor_parity
from kiln.exporter.parity.tolerances import RULE, Bound, Tolerance

__all__ = [
    "Bound",
    "RULE",
    "Tolerance",
    "TensorCheck",
    "GenerationCheck",
    "ParityResult",
    "tensor_feeds",
    "tensor_parity",
    "generation_parity",
    "greedy",
    "make_prompts",
    "left_pad",
    "encoder_states",
    "TargetParity",
    "Candidate",
    "ParitySettings",
    "QuantizedModel",
    "check_parity",
    "quantized_model",
    "parity_plan",
    "run_parity",
]
