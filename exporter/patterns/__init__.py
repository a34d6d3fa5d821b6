"""Recognisers of what the tracer writes, shared by every target: each layer's attention core
(``attention``), its rotate-half rotary (``rotary``) and the cos/sin tables it reads
(``rotary_tables``), RMSNorm (``norm``), attention heads between their two forms (``heads``), and
how a rule is applied and a candidate left unfused explained (``rules``). They match and report;
each target's own folder decides what a match becomes (``targets/ort/``: ONNX Runtime's contrib
ops; ``targets/onnx/``: ONNX's own ops). Nothing here imports a target.
"""
