"""Parity tolerances: the one rule every output is judged by, and why it is that rule (the rule
and the ``Tolerance`` type live in ``exporter.tolerance``; each precision kind declares its own
figures, ``precision.TOLERANCES`` names them by precision).

For every row (the last axis: one position's logits over the vocabulary, one head's key or value
at one position, one position's encoder state) and every element ``a`` of the candidate against
``b`` of the reference::

    |a - b| <= atol + rtol * max|b over the row|

Why the row's largest magnitude, and not numpy's element-wise ``atol + rtol * |b|`` (Polygraphy's
default is element-wise too): rounding error in a float32 output is proportional to the magnitudes that
were summed to make it (its row's inputs), not to the element. A logit of 0.01 beside logits of
40 carries the same absolute error as its neighbours, so the element-wise form either fails it
(rtol * 0.01 is nothing) or needs an atol that no longer scales with the model. A per-tensor scale
is robust too, but one outlier row (a key or hidden-state outlier in the hundreds, typical of
trained checkpoints) would loosen every other row; a row's own scale does not.

fp32's figures: rtol 1e-4 is the old absolute 1e-4 at unit scale (about 840 float32 ulps of the
row's scale); atol 1e-5 judges rows whose values are all near zero. Nothing much tighter is
robust on an ill-conditioned model: on a tiny BART with its weights x8, PyTorch's own float32
differs from its float64 by up to 7e-3 of a row's scale (where attention is near a tie), and the
export's tensor errors reach 0.39 of this limit (1.6e-3 in a row of logits up to 40). What a real
bug does is far outside it (tests/export/test_parity_scale.py, four models): one typical
weight's sign flipped in the exported weights, 690 to 2900 times the limit (on the large native
model its logits only 6 times, with cosine 0.99999995, above min_cosine: the rule refuses what
cosine passes); one padding position attended, 550 to 23000 times. Cosine and token-level
equality stay as they were.

fp16 and the low-bit forms keep their former absolute figures as atol (set on unit-scale models)
and add an rtol so that they scale too (each kind's figures say how, beside them).
"""

from __future__ import annotations

from kiln.exporter.tolerance import FP32, RULE, Bound, Tolerance

__all__ = ["Bound", "Tolerance", "RULE", "FP32"]
