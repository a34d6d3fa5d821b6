"""--int4's proof built apart from the graphs (issue 40): PyTorch on the quantizer's own numbers,
and every graph weight checked bit for bit against them (``exporter/int4/proof.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kiln.errors import ParityError
from kiln.exporter.int4.proof import NUMBERS_FILE, QuantizerNumbers, check_graph_weights, write_numbers
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.exporter.precision.kinds import Int4
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln_testing import save_base, tiny_config, write_checkpoint

_RTN = ExportOptions.from_flags(precision=Precision.of(Int4(method=Int4Method.RTN)), target="ort", parity_tokens=16)


def test_a_random_llama_is_proved_on_the_quantizer_numbers(tmp_path: Path) -> None:
    """A random-weight Llama's correct int4 graphs (both forms) pass the strict proof: every greedy
    token of the portable set the quantized model's argmax, the ORT set's too or a tie; the spill
    file is gone from the export."""
    out = tmp_path / "out"
    export(save_base("llama", tmp_path / "ckpt"), out, _RTN)
    report = json.loads((out / "reports" / "parity.json").read_text())
    quantized = report["quantized"]
    assert quantized["passed"] and {g["target"] for g in quantized["generation"]} == {None, "ort"}, quantized[
        "generation"
    ]
    assert all(g["token_match_rate"] == 1.0 for g in quantized["generation"] if g["target"] is None)
    assert all(g["passed"] and g["first_divergence"] is None for g in quantized["generation"])
    assert not any(p.name == NUMBERS_FILE for p in out.rglob("*")) and not (tmp_path / NUMBERS_FILE).exists()


def _one_block_off(module: str, edit: Callable[[np.ndarray], np.ndarray]) -> Callable[..., ir.Value]:
    """``int4.quantize._lazy`` with ``module``'s scale tensor written through ``edit`` (the writer's
    path only: the quantizer's own numbers stay as it made them)."""
    from kiln.exporter.int4 import quantize as int4

    lazy = int4._lazy

    def written(
        name: str, dtype: ir.DataType, shape: tuple[int, ...], make: Callable[[], ir.TensorProtocol]
    ) -> ir.Value:
        if name != f"int4/{module}.scale":
            return lazy(name, dtype, shape, make)
        return lazy(name, dtype, shape, lambda: ir.tensor(edit(np.array(make().numpy()))))

    return written


def _scale_block_off(scale: np.ndarray) -> np.ndarray:
    scale[1, 3] *= np.float32(1.1)  # one block of one column, 10% off
    return scale


def test_one_block_scale_off_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight written with one block's scale 10% off: the weight check names the graph, weight and block."""
    from kiln.exporter.int4 import quantize as int4

    monkeypatch.setattr(int4, "_lazy", _one_block_off("layers.0.attn.o_proj", _scale_block_off))
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    with pytest.raises(ParityError) as err:
        export(
            ckpt,
            tmp_path / "out",
            ExportOptions.from_flags(precision=Precision.of(Int4(method=Int4Method.RTN, block=16)), parity_tokens=4),
        )
    message = str(err.value)
    assert (
        "exported int4 weights differ from the quantizer's numbers: portable prefill.onnx: "
        "/layers.0.attn.o_proj/MatMul/weight/DequantizeLinear:" in message
    ), message
    assert (
        "layers.0.attn.o_proj's int4 weight differs from the quantizer's numbers at block 1 (rows 16-31), column "
        "3: scale " in message
    ), message
    assert "where the quantizer made " in message and not (tmp_path / "out").exists()


def test_the_proof_refuses_it_without_the_weight_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fault with the weight check skipped: the quantized model, built on the quantizer's
    numbers and not the graph's, refuses the graphs (a reference read back from the graph would copy it)."""
    from kiln.exporter.int4 import proof as int4_proof
    from kiln.exporter.int4 import quantize as int4

    monkeypatch.setattr(int4, "_lazy", _one_block_off("layers.0.mlp.fc2", lambda s: s * np.float32(1.1)))
    monkeypatch.setattr(int4_proof, "check_graph_weights", lambda numbers, sets: None)
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    with pytest.raises(ParityError) as err:
        export(
            ckpt,
            tmp_path / "out",
            ExportOptions.from_flags(
                precision=Precision.of(Int4(method=Int4Method.RTN)), parity_tokens=4, parity_agreement="record"
            ),
        )
    assert "against the int4 weights' model: " in str(err.value), str(err.value)


def test_an_ort_code_off_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One code of a packed MatMulNBits written wrong (the ORT target's own packing): named by graph, node and part."""
    from kiln.exporter.targets.ort import int4 as ort_int4

    pack = ort_int4.pack_nbits

    def wrong(q: np.ndarray, block: int) -> np.ndarray:
        q = q.copy()
        if q.shape[1] == 64:  # the packed q/k/v of a layer
            q[5, 40] = 7 if q[5, 40] != 7 else 6
        return pack(q, block)

    monkeypatch.setattr(ort_int4, "pack_nbits", wrong)
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_config())
    with pytest.raises(ParityError) as err:
        export(ckpt, tmp_path / "out", _RTN)
    message = str(err.value)
    assert (
        "ort prefill.ort.onnx: /layers.0.attn.qkv_proj/ort/packed/MatMulNBits (part 1, columns 32-47): "
        "layers.0.attn.k_proj's int4 weight" in message
    ), message
    assert "block 0 (rows 0-31), column 8: code " in message and "at row 5 where the quantizer made" in message, message


def test_check_names_a_missing_weight_and_an_unknown_one(tmp_path: Path) -> None:
    """A graph set missing one of the quantizer's weights, and one holding a weight the quantizer never made."""
    codes = np.arange(-8, 8, dtype=np.int8).repeat(4).reshape(32, 2)
    packed = (
        (codes.reshape(-1)[0::2].astype(np.int16) & 0xF) | ((codes.reshape(-1)[1::2].astype(np.int16) & 0xF) << 4)
    ).astype(np.uint8)
    scale = np.array([[0.5, 0.25], [1.0, 2.0]], np.float32)
    numbers = write_numbers(tmp_path / NUMBERS_FILE, [("a", packed, scale, (32, 2)), ("b", packed, scale, (32, 2))])
    q, got = numbers.numbers("a")
    assert np.array_equal(q, codes) and np.array_equal(got, scale)
    graph = _dq_graph(codes, scale, "a")
    ir.save(graph, tmp_path / "g.onnx")
    assert (
        check_graph_weights(numbers, [("portable", [tmp_path / "g.onnx"])])
        == "portable: holds no int4 weight for ['b'], which the quantizer made numbers for"
    )
    other: QuantizerNumbers = write_numbers(tmp_path / "z.safetensors", [("z", packed, scale, (32, 2))])
    found = check_graph_weights(other, [("portable", [tmp_path / "g.onnx"])])
    assert (
        found
        == "portable g.onnx: /a/MatMul/weight/DequantizeLinear: an int4 weight of 'a', which the quantizer made no "
        "numbers for"
    ), found
    numbers.close()
    assert not (tmp_path / NUMBERS_FILE).exists()


def _dq_graph(codes: np.ndarray, scale: np.ndarray, module: str) -> ir.Model:
    q = ir.Value(
        name="q",
        type=ir.TensorType(ir.DataType.INT4),
        shape=ir.Shape([32, 2]),
        const_value=ir.tensor(codes, dtype=ir.DataType.INT4, name="q"),
    )
    s = ir.Value(name="s", const_value=ir.tensor(scale, name="s"))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 32]))
    dq = ir.node(
        "DequantizeLinear", [q, s], {"axis": 0, "block_size": 16}, name=f"/{module}/MatMul/weight/DequantizeLinear"
    )
    mm = ir.node("MatMul", [x, dq.outputs[0]], name=f"/{module}/MatMul")
    mm.outputs[0].name = "y"
    graph = ir.Graph([x], [mm.outputs[0]], nodes=[dq, mm], initializers=[q, s], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def _packed_nbits_graph(parts: list[tuple[np.ndarray, np.ndarray]], outer: list[int], inner: list[int]) -> ir.Model:
    """One MatMulNBits over the parts' codes and scales side by side, named after no module (as a
    packed q/k/v packed again with a parallel MLP's gate/up is), its output split in ``outer`` and
    the first of those split again in ``inner``."""
    from kiln.exporter.int4.numbers import pack_nbits

    q = np.concatenate([c for c, _ in parts], axis=1)
    scale = np.concatenate([s for _, s in parts], axis=1)
    k, n = q.shape
    x = ir.val("x", ir.DataType.FLOAT, [1, k])
    b = ir.val("b", const_value=ir.tensor(pack_nbits(q, 16), name="b"))
    s = ir.val("s", const_value=ir.tensor(np.ascontiguousarray(scale.T).reshape(-1), name="s"))
    attrs = {"K": k, "N": n, "bits": 4, "block_size": 16, "accuracy_level": 0}
    mm = ir.node("MatMulNBits", [x, b, s], attrs, domain="com.microsoft", name="/graph/ort/packed/MatMulNBits")
    sizes = [ir.val(f"sizes{i}", const_value=ir.tensor(np.array(v, np.int64), name=f"sizes{i}")) for i, v in
             enumerate((outer, inner))]  # fmt: skip
    first = ir.node("Split", [mm.outputs[0], sizes[0]], {"axis": -1}, num_outputs=len(outer), name="/graph/Split")
    second = ir.node("Split", [first.outputs[0], sizes[1]], {"axis": -1}, num_outputs=len(inner), name="/qkv/Split")
    outputs = [*second.outputs, *first.outputs[1:]]
    for i, v in enumerate(outputs):
        v.name = f"y{i}"
    graph = ir.Graph(
        [x], outputs, nodes=[mm, first, second], initializers=[b, s, *sizes], opset_imports={"": 21, "com.microsoft": 1}
    )
    return ir.Model(graph, ir_version=10)


def test_a_packed_part_split_again_is_checked_part_by_part(tmp_path: Path) -> None:
    """Cohere2's layers without rotary: their q/k/v, packed for GroupQueryAttention, are packed again with
    the parallel MLP's gate and up; each of the five parts is the quantizer's weight of its module, and
    one code off in the inner split's k part is named there."""
    rng = np.random.default_rng(0)
    names = ["layers.1.attn.q_proj", "layers.1.attn.k_proj", "layers.1.attn.v_proj", "layers.1.mlp.gate_proj",
             "layers.1.mlp.up_proj"]  # fmt: skip
    widths = [4, 2, 2, 6, 6]
    parts = [(rng.integers(-8, 8, (32, w)).astype(np.int8), rng.random((2, w)).astype(np.float32)) for w in widths]

    def packed(c: np.ndarray) -> np.ndarray:
        flat = c.reshape(-1).astype(np.int16) & 0xF
        return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)

    numbers = write_numbers(
        tmp_path / NUMBERS_FILE, [(m, packed(c), sc, c.shape) for m, (c, sc) in zip(names, parts, strict=True)]
    )
    ir.save(_packed_nbits_graph(parts, [8, 6, 6], [4, 2, 2]), tmp_path / "g.onnx")
    assert check_graph_weights(numbers, [("ort", [tmp_path / "g.onnx"])]) is None
    parts[1][0][3, 1] = 7 if parts[1][0][3, 1] != 7 else 6
    ir.save(_packed_nbits_graph(parts, [8, 6, 6], [4, 2, 2]), tmp_path / "g.onnx")
    found = check_graph_weights(numbers, [("ort", [tmp_path / "g.onnx"])])
    assert found is not None and found.startswith(
        "ort g.onnx: /graph/ort/packed/MatMulNBits (part 1, columns 4-5): layers.1.attn.k_proj's int4 weight differs "
        "from the quantizer's numbers at block 0 (rows 0-15), column 1: code "
    ), found
    numbers.close()
