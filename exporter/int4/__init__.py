"""int4, weight-only, in one place: the quantizer and its pass (``quantize``), the numbers' arithmetic
(RTN, packing, dequantization: ``numbers``), GPTQ's solve (``gptq``) over the Hessians captured layer by
layer (``hessians``), the proof that judges the graphs on the quantizer's own numbers (``proof``), and
``kiln check``'s run of the quantizer again from the checkpoint (``rerun``).

The kind's declaration (its flags and options, read by the CLI without importing torch) is
``precision.kinds.int4``; the ort target's MatMulNBits packing of these numbers is the ort target's own
(``targets.ort.int4``)."""
