"""Layer-by-layer GPTQ (calibration.hessians, calibration.layers): the numbers against a plain
sequential reference written here, one layer's Hessians at a time, the reference module left as
it was, each layer's own call captured (sliding-window layers), and the quantizer's contract."""

from __future__ import annotations

import copy

import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch import nn

from kiln.calibration.layers import capture, decoder_layers, hidden_of, layer_feeds
from kiln.errors import CalibrationError, ExportError
from kiln.exporter.int4.gptq import gptq
from kiln.exporter.int4.hessians import live_hessians, quantize_layerwise
from kiln.exporter.int4.numbers import dequantize, pack_int4, rtn
from kiln.exporter.int4.quantize import Int4Quantizer, module_layout
from kiln.exporter.passes.bind import ModuleWeight, Transform, WeightSource
from kiln.exporter.passes.transposes import TRANSPOSE
from kiln.exporter.precision.kinds.int4 import Int4Method
from kiln.plugins.native.build import random_model
from kiln.plugins.native.model import PLEDecoder, causal_padding_mask
from kiln_testing import RecordedProgress, tiny_config

SUBS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate", "mlp.fc1", "mlp.fc2")
NAMES = [f"model.layers.{i}.{s}.weight" for i in range(2) for s in SUBS]
BLOCK = 16
F32 = np.dtype(np.float32)


def _windows(n: int, length: int = 24, vocab: int = 101) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=length) for _ in range(n)]


def _sequential(
    model: PLEDecoder, windows: list[np.ndarray], quantized_inputs: bool = True
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The reference: every window at once through a copy of the model, layer after layer; each
    layer's Linear inputs in float64, H = 2/n X^T X, GPTQ, and (``quantized_inputs``) the layer's
    weights replaced by their dequantized numbers before it computes the next layer's input."""
    model = copy.deepcopy(model)
    ids = torch.from_numpy(np.stack(windows))
    mask, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    allowed = causal_padding_mask(mask, ids.shape[1])
    out = {}
    with torch.no_grad():
        x = model.embed(ids)
        for i, layer in enumerate(model.layers):
            inputs: dict[str, torch.Tensor] = {}
            hooks = [
                layer.get_submodule(s).register_forward_pre_hook(
                    lambda m, a, s=s, inputs=inputs: inputs.__setitem__(s, a[0].reshape(-1, a[0].shape[-1]).double())
                )
                for s in SUBS
            ]
            layer(x, allowed, pos, None, None)
            for hook in hooks:
                hook.remove()
            for s in SUBS:
                h = (2.0 / inputs[s].shape[0] * inputs[s].T @ inputs[s]).numpy()
                q, scale = gptq(layer.get_submodule(s).weight.detach().numpy().T, h, BLOCK, F32)
                out[f"model.layers.{i}.{s}.weight"] = (q, scale, h)
            for s in SUBS if quantized_inputs else ():
                q, scale, _ = out[f"model.layers.{i}.{s}.weight"]
                layer.get_submodule(s).weight.data = torch.from_numpy(np.ascontiguousarray(dequantize(q, scale).T))
            x = layer(x, allowed, pos, None, None)[0]
    return out


class _Recorder:
    """A ``quantize`` callback: GPTQ of the module's own weight, recording what it was given."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.got: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.order: list[str] = []
        self.live: list[int] = []
        self.addresses: dict[str, int] = {}

    def __call__(self, name: str, hessian: np.ndarray | None) -> np.ndarray:
        assert hessian is not None
        weight = self.model.get_parameter(name.removeprefix("model.")).detach().numpy().T
        q, scale = gptq(weight, hessian, BLOCK, F32)
        self.got[name] = (q, scale, np.array(hessian))
        self.order.append(name)
        self.live.append(live_hessians())
        self.addresses[name] = hessian.__array_interface__["data"][0]
        return np.ascontiguousarray(dequantize(q, scale).T)


@pytest.fixture(scope="module")
def streamed() -> tuple[PLEDecoder, dict[str, torch.Tensor], _Recorder, RecordedProgress]:
    model = random_model(tiny_config(), 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder, progress = _Recorder(model), RecordedProgress()
    quantize_layerwise(
        model, "layers.{}", 2, _windows(20), NAMES, (), recorder, progress
    )  # 20 windows: batches of 16 and 4
    return model, before, recorder, progress


def test_numbers_equal_a_sequential_reference(
    streamed: tuple[PLEDecoder, dict[str, torch.Tensor], _Recorder, RecordedProgress],
) -> None:
    """Each weight's Hessian (float32 sums, in batches) within 1e-6 of the float64 reference's,
    and its GPTQ numbers equal; layer 1's Hessians are those of the quantized layer 0's outputs
    (the float layer's differ by percents: the comparison can tell them apart)."""
    model, _, recorder, progress = streamed
    reference, float_inputs = _sequential(model, _windows(20)), _sequential(model, _windows(20), quantized_inputs=False)
    assert progress.stages == {"GPTQ: 14 weights, 20 windows, layer by layer": [2, 2]}
    assert sorted(recorder.got) == sorted(NAMES)
    for name in NAMES:
        q, scale, h = recorder.got[name]
        q_ref, scale_ref, h_ref = reference[name]
        assert np.abs(h - h_ref).max() <= 1e-6 * np.abs(h_ref).max(), name
        assert np.array_equal(q, q_ref), name
        np.testing.assert_allclose(scale, scale_ref, rtol=1e-6)
        if ".layers.1." in name:
            assert np.abs(h - float_inputs[name][2]).max() > 1e-2 * np.abs(h_ref).max(), name


def test_one_layer_of_hessians_at_a_time(
    streamed: tuple[PLEDecoder, dict[str, torch.Tensor], _Recorder, RecordedProgress],
) -> None:
    """Layer by layer, in order; a layer's 4 Hessians (q/k/v share one, gate/fc1 one) exist when its
    first weight is quantized, never more, none afterwards; the shared ones are one array."""
    _, _, recorder, _ = streamed
    layers = [int(name.split(".")[2]) for name in recorder.order]
    assert layers == sorted(layers)
    firsts = [layers.index(i) for i in (0, 1)]
    assert [recorder.live[i] for i in firsts] == [4, 4] and max(recorder.live) == 4
    assert live_hessians() == 0
    for i in (0, 1):
        address = {s: recorder.addresses[f"model.layers.{i}.{s}.weight"] for s in SUBS}
        assert address["attn.q_proj"] == address["attn.k_proj"] == address["attn.v_proj"]
        assert address["mlp.gate"] == address["mlp.fc1"]
        assert len({address["attn.q_proj"], address["attn.o_proj"], address["mlp.gate"], address["mlp.fc2"]}) == 4


def test_reference_module_left_as_it_was(
    streamed: tuple[PLEDecoder, dict[str, torch.Tensor], _Recorder, RecordedProgress],
) -> None:
    model, before, _, _ = streamed
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_weights_outside_the_layers_read_the_quantized_stack() -> None:
    """The LM head (--int4-all-matmuls): its Hessian is of the final norm's output over the
    quantized layers' hidden states; the layers' weights quantized earlier are applied (``done``)."""
    model = random_model(tiny_config(), 0)
    windows = _windows(6)
    recorder = _Recorder(model)
    quantize_layerwise(model, "layers.{}", 2, windows, NAMES, (), recorder, RecordedProgress())
    numbers = {name: dequantize(q, scale).T for name, (q, scale, _) in recorder.got.items()}

    def done(name: str, hessian: np.ndarray | None) -> np.ndarray:
        if name in numbers:
            assert hessian is None
            return np.ascontiguousarray(numbers[name])
        heads.append(np.array(hessian))
        return model.lm_head.weight.detach().numpy().copy()

    heads: list[np.ndarray] = []
    progress = RecordedProgress()
    quantize_layerwise(model, "layers.{}", 2, windows, ["model.lm_head.weight"], NAMES, done, progress)
    assert progress.stages == {"GPTQ: 1 weights, 6 windows, layer by layer": [3, 3]}
    quantized = copy.deepcopy(model)
    for name, values in numbers.items():
        quantized.get_parameter(name.removeprefix("model.")).data = torch.from_numpy(np.ascontiguousarray(values))
    final: list[torch.Tensor] = []
    quantized.lm_head.register_forward_pre_hook(lambda m, a: final.append(a[0].reshape(-1, a[0].shape[-1]).double()))
    ids = torch.from_numpy(np.stack(windows))
    with torch.no_grad():
        quantized(ids, torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids))
    expected = (2.0 / final[0].shape[0] * final[0].T @ final[0]).numpy()
    assert len(heads) == 1 and np.abs(heads[0] - expected).max() <= 1e-6 * np.abs(expected).max()


@pytest.mark.parametrize("case", ["gemma3-window", "qwen2-window", "gpt2"])
def test_capture_replays_each_layer_with_its_own_call(case: str) -> None:
    """Hugging Face decoders: the layers run one at a time on the captured calls give the last
    layer's output of the model's own forward, exactly; with layer 0's call for every layer the
    sliding-window models' differ (each layer's mask and rotary are its own)."""
    pytest.importorskip("transformers")
    from kiln.plugins.hf import tiny_model

    loaded = tiny_model(case, seed=1)
    assert loaded.layers is not None
    layers = decoder_layers(loaded.module, loaded.layers.prefix, loaded.spec.n_layers)
    feeds = list(layer_feeds(_windows(3, length=12, vocab=loaded.spec.vocab_size)))
    own: list[torch.Tensor] = []
    hook = layers[-1].register_forward_hook(lambda m, a, out: own.append(hidden_of(out)))
    with torch.no_grad():
        loaded.module(*feeds[0])
        hook.remove()
        batch = capture(loaded.module, layers, feeds)[0][0]
        replayed, first_call = batch.hidden.clone(), batch.hidden.clone()
        for index, layer in enumerate(layers):
            replayed, first_call = batch.calls[index].run(layer, replayed), batch.calls[0].run(layer, first_call)
    assert torch.equal(replayed, own[0])
    assert torch.equal(first_call, own[0]) == (case == "gpt2")
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_a_model_that_skips_a_layer_is_refused() -> None:
    model = random_model(tiny_config(n_layers=3), 0)
    layers = [model.layers[0], model.layers[2]]  # the model calls a layer between them that is not in the list
    with pytest.raises(
        CalibrationError,
        match="GPTQ: the model changes the hidden state between decoder layers 0 and 1; it cannot be quantized layer "
        "by layer",
    ):
        capture(model, layers, layer_feeds(_windows(2)))


def _weight(model: nn.Module, name: str) -> ModuleWeight:
    return ModuleWeight(WeightSource(model), name, ir.DataType.FLOAT, (TRANSPOSE,))


def test_quantizer_runs_gptq_once_for_every_weight_wanted_then_only_for_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``numbers`` starts one layer-by-layer run with every weight the graphs registered; a weight
    wanted later gets its own run, told which weights are done (their numbers are applied). The
    weights handed one Hessian (q/k) share its factorisation."""
    import kiln.exporter.int4.quantize as int4

    model = random_model(tiny_config(), 0)
    runs: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    hessians = {k: np.eye(k) + 0.1 for k in (32, 64)}
    factored: list[int] = []
    inverse_factor = int4.inverse_factor
    monkeypatch.setattr(int4, "inverse_factor", lambda h: factored.append(h.shape[0]) or inverse_factor(h))

    def hessian(k: int) -> np.ndarray:
        return hessians[k]

    def layerwise(todo, done, quantize) -> None:  # type: ignore[no-untyped-def]
        runs.append((tuple(sorted(todo)), tuple(sorted(done))))
        for name in todo:
            shape = tuple(model.get_parameter(name.removeprefix("model.")).shape)  # [N, K]
            dq = quantize(name, hessian(shape[1]))
            assert dq.shape == shape and dq.dtype == np.float32
        for name in done:
            quantize(name, None)

    quantizer = Int4Quantizer(Int4Method.GPTQ, BLOCK, layerwise)
    names = ["model.layers.0.attn.q_proj.weight", "model.layers.0.attn.k_proj.weight"]
    for name in names:
        quantizer.want(_weight(model, name), _weight(model, name).key, name, BLOCK, ir.DataType.FLOAT)
    q_proj = _weight(model, names[0])
    packed, scale = quantizer.numbers(q_proj, q_proj.key, names[0], BLOCK, ir.DataType.FLOAT)
    q_ref, scale_ref = gptq(q_proj.numpy(), hessian(32), BLOCK, F32)
    assert np.array_equal(packed, pack_int4(q_ref)) and np.array_equal(scale, scale_ref)
    quantizer.numbers(_weight(model, names[1]), _weight(model, names[1]).key, names[1], BLOCK, ir.DataType.FLOAT)
    assert runs == [(tuple(sorted(names)), ())] and factored == [32]
    later = "model.layers.1.mlp.fc2.weight"
    quantizer.numbers(_weight(model, later), _weight(model, later).key, later, BLOCK, ir.DataType.FLOAT)
    assert runs[1] == ((later,), tuple(sorted(names))) and factored == [32, 64]


def test_module_layout_undoes_transposes_only() -> None:
    model = random_model(tiny_config(), 0)
    name = "model.layers.0.attn.o_proj.weight"
    weight = _weight(model, name)
    values = weight.numpy()
    assert np.array_equal(module_layout(weight, values), model.layers[0].attn.o_proj.weight.detach().numpy())
    with pytest.raises(
        ExportError,
        match=r"GPTQ: the graph weight model.layers.0.attn.o_proj.weight is the module tensor through 'odd'",
    ):
        module_layout(weight.then(Transform("odd", lambda w: w)), values)


def _textbook_gptq(weight: np.ndarray, hessian: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ as the paper first states it (OBQ's update, one row at a time): quantize row i, spread
    its error over the rows not yet quantized through H^-1, remove row i from H^-1; no Cholesky,
    no lazy batches. Damping, dead channels and each block's clip search as kiln's."""
    from kiln.exporter.int4.gptq import CLIP_RATIOS, PERCDAMP
    from kiln.exporter.int4.numbers import clip_scales

    w, h = weight.astype(np.float64).copy(), hessian.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead], w[dead] = 1.0, 0.0
    h[np.diag_indices(len(h))] += PERCDAMP * np.mean(np.diag(h))
    inverse = np.linalg.inv(h)
    q, scale = np.zeros(w.shape, np.int8), np.zeros((len(w) // block, w.shape[1]), np.float32)
    for i in range(len(w)):
        if i % block == 0:
            scale[i // block] = clip_scales(w[i : i + block][None], F32, CLIP_RATIOS)[0]
        s = scale[i // block].astype(np.float64)
        q[i] = np.clip(np.rint(w[i] / s), -8, 7)
        w[i + 1 :] -= np.outer(inverse[i + 1 :, i] / inverse[i, i], w[i] - q[i] * s)
        inverse -= np.outer(inverse[:, i], inverse[i]) / inverse[i, i]
    return q, scale


def test_gptq_equals_the_textbook_algorithm() -> None:
    """Lazy batches of 128 rows over two blocks of 64 and the Cholesky factor give the textbook
    numbers; a dead input channel's weights are zero."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 192)) * rng.uniform(0.2, 3.0, 192)
    x[:, 5] = 0.0
    hessian = (2.0 / 512 * x.T @ x).astype(np.float32)
    weight = (rng.standard_normal((192, 24)) * 0.05).astype(np.float32)
    q, scale = gptq(weight, hessian, 64, F32)
    q_ref, scale_ref = _textbook_gptq(weight, hessian, 64)
    assert np.array_equal(q, q_ref) and np.array_equal(q[5], np.zeros(24, np.int8))
    np.testing.assert_allclose(scale, scale_ref, rtol=1e-6)
    rtn_error = weight - dequantize(*rtn(weight, 64, F32))
    gptq_error = weight - dequantize(q, scale)
    assert np.einsum("kn,kj,jn->", gptq_error, hessian, gptq_error) < 0.8 * np.einsum(
        "kn,kj,jn->", rtn_error, hessian, rtn_error
    )
