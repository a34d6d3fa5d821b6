"""Mamba2's recurrent state behind kiln's decoder contract (issue 43 item 2, first step):
``HFDecoder`` carries per layer ``conv`` ``[batch, 1, conv_kernel, conv_dim]`` and ``ssm``
``[batch, heads, head_dim, state_size]`` (plugins/hf/recurrent_state.py); a prefill from zero states
is transformers' prefill; the forms traced (plugins/hf/mamba2_scan.py) equal transformers' own; and
one graph of any step length, traced through kiln's wrapper and run by ONNX Runtime, greedy-decodes
the tokens of transformers' ``generate()`` at batch 1 and in a left-padded batch. The pipeline,
the manifest and ``kiln generate`` do not know this cache kind yet (Mamba2 is still refused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import onnxruntime as ort
import torch
from torch.export import Dim

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.trace.wrapper import GraphModule
from kiln.plugins.hf.decoder import HFDecoder
from kiln.plugins.hf.mamba2_scan import traced_mamba2

LAYERS, HEADS, HEAD_DIM, STATE, KERNEL, VOCAB = 2, 8, 16, 16, 4, 128
CONV_DIM = 2 * 64 + 2 * STATE  # expand * hidden_size + 2 * n_groups * state_size


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        expand=2,
        state_size=STATE,
        n_groups=1,
        conv_kernel=KERNEL,
        chunk_size=8,  # shorter than the longest step below: transformers' own scan runs several chunks
        tie_word_embeddings=False,
    )
    return transformers.Mamba2ForCausalLM(config).eval()


def _states(batch: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shapes = ((batch, 1, KERNEL, CONV_DIM), (batch, HEADS, HEAD_DIM, STATE)) * LAYERS
    return [scale * torch.randn(s, generator=gen) for s in shapes]


def _step(model: Any, ids: torch.Tensor, past: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)] if past is not None else None
    with torch.no_grad():
        logits, presents = HFDecoder(model)(ids, torch.ones_like(ids), torch.zeros_like(ids), pairs)
    return logits, [t for pair in presents for t in pair]


def test_a_prefill_from_zero_states_is_the_prefill_from_an_empty_cache(model: Any) -> None:
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    logits, states = _step(model, ids, None)
    assert [tuple(t.shape) for t in states] == [(2, 1, KERNEL, CONV_DIM), (2, HEADS, HEAD_DIM, STATE)] * LAYERS, [
        t.shape for t in states
    ]
    zero_logits, zero_states = _step(model, ids, _states(2, 0.0))
    assert torch.equal(logits, zero_logits), (logits - zero_logits).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(states, zero_states, strict=True)), "the states differ"
    assert any(t.abs().max() > 0 for t in states), "a prefill left every state at zero: nothing is carried"


@pytest.mark.parametrize("seq", [1, 3, 20])
def test_the_traced_forms_equal_transformers_own_from_a_state(model: Any, seq: int) -> None:
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
    past = _states(2, 0.5)
    want_logits, want = _step(model, ids, past)
    module = transformers.models.mamba2.modeling_mamba2
    stock = module.mamba2_scan_forward
    with traced_mamba2():
        assert module.mamba2_scan_forward is not stock, "traced_mamba2 patched nothing"
        got_logits, got = _step(model, ids, past)
    assert module.mamba2_scan_forward is stock, "traced_mamba2 left its patch in place"
    assert torch.allclose(got_logits, want_logits, atol=1e-5), (got_logits - want_logits).abs().max()
    for name, a, b in zip(("conv", "ssm") * LAYERS, got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5), f"{name}: {(a - b).abs().max()}"


def _export(model: Any, path: Path) -> ort.InferenceSession:
    wrapper = GraphModule(HFDecoder(model), GraphKind.UNIFIED, LAYERS, last_logits_only=False).eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    mask, batch = torch.ones(2, 25, dtype=torch.int64), Dim("batch", min=1, max=4)
    step = {0: batch, 1: Dim("seq", min=1, max=64)}
    names = [
        f"{kind}.{i}.{n}" for kind in ("past_key_values", "present") for i in range(LAYERS) for n in ("conv", "ssm")
    ]
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (ids, mask, torch.arange(20).expand(2, 20).contiguous(), _states(2, 0.5)),  # positions: not ids, or aliased
            dynamic_shapes=(step, {0: batch, 1: Dim.AUTO}, step, [{0: batch}] * (2 * LAYERS)),
            input_names=["input_ids", "attention_mask", "position_ids", *names[: 2 * LAYERS]],
            output_names=["logits", *names[2 * LAYERS :]],
            dynamo=True,
            optimize=False,
        )
    assert program is not None
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _greedy(session: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray, steps: int) -> np.ndarray:
    """The unified graph's loop: every step (the prompt first) reads the states and returns their replacement."""
    names = [i.name for i in session.get_inputs()][3:]
    states = [t.numpy() for t in _states(ids.shape[0], 0.0)]
    out = []
    for _ in range(steps):
        feeds = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": np.zeros_like(ids),
            **dict(zip(names, states, strict=True)),
        }
        logits, *states = session.run(None, feeds)
        ids = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones_like(ids)], axis=1)
        out.append(ids)
    return np.concatenate(out, axis=1)


def test_one_graph_of_any_length_decodes_the_tokens_of_generate(model: Any, tmp_path: Path) -> None:
    session = _export(model, tmp_path / "model.onnx")
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["past_key_values.1.conv"] == ["batch", 1, KERNEL, CONV_DIM], shapes
    assert shapes["past_key_values.1.ssm"] == ["batch", HEADS, HEAD_DIM, STATE], shapes
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=gen)
    padded = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:, 3:]], 1), prompt.flip(1)])
    padded_mask = torch.ones(2, 7, dtype=torch.int64)
    padded_mask[0, :3] = 0
    for ids, mask in ((prompt, torch.ones_like(prompt)), (padded, padded_mask)):
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)[:, ids.shape[1] :]
        got = _greedy(session, ids.numpy(), mask.numpy(), 12)
        assert np.array_equal(got, want.numpy()), f"batch {ids.shape[0]}: {got.tolist()} != {want.tolist()}"
    ones = np.ones((1, 1), np.int64)
    bad = {"input_ids": ones, "attention_mask": ones, "position_ids": ones}
    bad.update({n: np.zeros([1, *s[1:]], np.float32) for n, s in shapes.items() if n.startswith("past_key_values.")})
    bad["past_key_values.0.conv"] = np.zeros((1, 1, KERNEL - 1, CONV_DIM), np.float32)
    with pytest.raises(Exception, match="past_key_values.0.conv"):  # a window of the wrong length is refused by name
        session.run(None, bad)
