"""The parity stage: every graph against the PyTorch model, tensor by tensor and token by token.

- Tensor level: each output of each graph against PyTorch on the same inputs (left-padded
  batches, non-empty past), judged row by row by ``|a - b| <= atol + rtol * max|b| of the row``
  (``tolerances``: per precision, for the logits and for the KV cache) and by cosine; max rel
  and the top-1 agreement of the logits are shown.
- Generation level (verify, do not regenerate): each graph set generates greedily through
  prefill + decode as users run it, and model.onnx is fed those tokens in two chunks with its
  cache (the prompt, then the generated tokens); PyTorch then scores every sequence
  teacher-forced in batched forwards, and at every step the token the graphs chose must be
  PyTorch's argmax at that prefix. If every step agrees, the sequence is PyTorch's own greedy
  sequence (by induction), and a divergence is pinned to its first step with the logit error of
  every step recorded. A mismatch where PyTorch's own two logits are within twice that row's
  logits limit is a tie, which no runtime can be blamed for; it is counted apart and does not
  fail the check. Batch 1 and a padded batch run (at ``--max-batch 1``, one shorter prompt
  padded at batch 1).
"""

from __future__ import annotations

from kiln.exporter.parity.driver import (
    Candidate,
    ParitySettings,
    QuantizedModel,
    check_parity,
    parity_plan,
    quantized_model,
)
from kiln.exporter.parity.generation import (
    candidate_run,
    encoder_states,
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
from kiln.exporter.parity.scoring import generation_parity
from kiln.exporter.parity.tensors import tensor_feeds, tensor_parity
from kiln.exporter.tolerance import RULE, Bound, Tolerance

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
    "candidate_run",
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
]
