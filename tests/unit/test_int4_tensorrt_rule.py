"""TensorRT's int4 block sizes (``lowbit_check.tensorrt_int4_blocks``), read from the graphs' int4
DequantizeLinear ``block_size``: 64 and 128 build, every other block kiln writes is ONNX Runtime's only,
and trtexec.sh's writer refuses such a graph before it writes anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kiln.errors import EngineError
from kiln.exporter.contract.io import DECODER_KINDS, graph_io
from kiln.exporter.engine import BuildOptions
from kiln.exporter.engine.profiles import engine_profiles
from kiln.exporter.engine.trtexec import write_script
from kiln.exporter.int4.quantize import Int4Quantizer, QuantizeInt4
from kiln.exporter.precision.int8 import Int8Policy
from kiln.exporter.precision.kinds.int4 import INT4_BLOCKS, TENSORRT_INT4_BLOCKS, Int4Method
from kiln.exporter.precision.lowbit_check import tensorrt_int4_blocks, tensorrt_int4_reason
from kiln.plugins.native import spec_of
from kiln_testing import placeholder_export, tiny_config, typed_manifest

FLOAT = ir.DataType.FLOAT
K, N = 256, 8


def int4_model(*blocks: int) -> ir.Model:
    """One MatMul per block, ``x [2, K] @ W_i [K, N]``, each weight int4 in blocks of ``blocks[i]``."""
    rng = np.random.default_rng(0)
    x = ir.val("x", FLOAT, [2, K])
    nodes, inits, outputs = [], [], []
    for i in range(len(blocks)):
        w = ir.val(f"w{i}", const_value=ir.tensor(rng.standard_normal((K, N)).astype(np.float32), name=f"w{i}"))
        node = ir.node("MatMul", [x, w], name=f"/layers.{i}/fc/MatMul")
        node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = f"y{i}", FLOAT, ir.Shape([2, N])
        nodes.append(node)
        inits.append(w)
        outputs.append(node.outputs[0])
    graph = ir.Graph([x], outputs, nodes=nodes, initializers=inits, opset_imports={"": 21}, name="g")
    model = ir.Model(graph, ir_version=10)
    for i, block in enumerate(blocks):  # one pass per weight: the later ones kept float, the earlier ones int4 already
        later = tuple(node.name or "" for node in nodes[i + 1 :])
        QuantizeInt4(Int4Quantizer(Int4Method.RTN, block), Int8Policy(keep_float=later), FLOAT)(model)
    return model


@pytest.mark.parametrize("block", INT4_BLOCKS)
def test_only_64_and_128_build(block: int) -> None:
    model = int4_model(block)
    assert [n.attributes.get_int("block_size") for n in model.graph if n.op_type == "DequantizeLinear"] == [block]
    assert tensorrt_int4_blocks(model) == (() if block in TENSORRT_INT4_BLOCKS else (block,))


def test_every_block_outside_is_named_once_in_order() -> None:
    blocks = tensorrt_int4_blocks(int4_model(32, 128, 16, 32))
    assert blocks == (16, 32)
    assert tensorrt_int4_reason(blocks) == (
        "int4 DequantizeLinear block_size 16, 32, outside TensorRT's int4 block sizes (64, 128):"
        " for ONNX Runtime only, not TensorRT"
    )


def test_trtexec_writer_refuses_before_writing(tmp_path: Path) -> None:
    spec, graphs = spec_of(tiny_config()), {}
    for kind in DECODER_KINDS:
        io = graph_io(spec, kind)
        inputs, outputs = [t.to_dict() for t in io.inputs], [t.to_dict() for t in io.outputs]
        graphs[kind.value] = {"file": f"onnx/{kind.value}.onnx", "inputs": inputs, "outputs": outputs}
    m = {"manifest_version": 2, "precision": "int4", "limits": {"max_batch": 8, "max_context": 48}, "graphs": graphs}
    directory = placeholder_export(tmp_path / "export", m)
    ir.save(int4_model(128, 16), directory / "onnx" / "decode.onnx")  # what TensorRT's parser would be given
    with pytest.raises(EngineError) as info:
        write_script(directory, engine_profiles(typed_manifest(m), BuildOptions()), BuildOptions())
    assert str(info.value) == (
        "engine: onnx/decode.onnx: int4 DequantizeLinear block_size 16, outside TensorRT's int4 block sizes (64, 128):"
        " for ONNX Runtime only, not TensorRT; for engines, re-export with --int4-block 64 or 128"
        " (and --int4-float for a weight whose K 64 does not divide)"
    )
    assert not (directory / "engines").exists()
