"""Gated DeltaNet hybrids through kiln's export pipeline (issue 43 item 2: the ``hybrid`` cache kind of
``plugins/cache_layout.py`` with a DeltaNet state; plugins/hf/gated_deltanet.py, tiny_qwen3_5.py): the
one-form delta rule equals transformers' chunked and recurrent forms; ``kiln export`` of a tiny Qwen3.5
text decoder (DeltaNet, gated attention, DeltaNet layers) passes its parity, carries ``conv``/``ssm`` of
fixed sizes on the DeltaNet layers and growing ``key``/``value`` on the attention layer; ``kiln generate``
and kiln's ORT runner on a left-padded batch of two (prefill + decode and the unified graph alone) give
transformers' ``generate()`` tokens, and a left-padded row's state after the prompt is its unpadded
state; ``--fp16``, ``--int4 --int4-method rtn`` and ``--target ort`` pass their parity. Qwen3-Next and
Qwen3.5-MoE (the same layers with experts): tests/export/test_hf_archs.py (``--target ort`` and ``--fp16``
parity, greedy tokens of batch 1 and a left-padded batch on both graph sets)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import torch

from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.contract.steps import prompt_feeds
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import make_prompts
from kiln.exporter.pipeline import export
from kiln.exporter.runners import OrtRunner
from kiln.plugins import load_model
from kiln.plugins.hf.build import tiny_transformers
from kiln.plugins.hf.gated_deltanet import gated_delta_rule, solve_unit_lower
from kiln_testing import assert_greedy_equals_hf, assert_int4_generation, assert_kiln_generate, hf_model

# plugins/hf/tiny_qwen3_5.py: layers 0 and 2 DeltaNet (conv window 4 x (2 * 2 * 16 + 4 * 16), state 4 x 16 x 16),
# layer 1 attention (2 KV heads of 16)
STATE = {"conv": (1, 4, 128), "ssm": (4, 16, 16)}
STEPS = 16
PROMPT = [5, 17, 33, 9, 101, 64, 3, 88, 12]


def _save(case: str, directory: Path) -> Path:
    tiny_transformers(case, seed=1).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    ckpt = _save("qwen3_5", root / "ckpt")
    result = export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    return ckpt, root / "out"


@pytest.mark.parametrize("length", [1, 3, 9, 70])
@pytest.mark.parametrize("seeded", [False, True])
def test_the_one_form_delta_rule_equals_transformers_chunked_and_recurrent_forms(length: int, seeded: bool) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    generator = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, 2, 16, generator=generator) for _ in range(2))
    v = torch.randn(2, length, 4, 16, generator=generator)
    g, beta = -2 * torch.rand(2, length, 4, generator=generator), torch.rand(2, length, 4, generator=generator)
    state = torch.randn(2, 4, 16, 16, generator=generator) if seeded else None
    got, got_state = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True, steps=7)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        want, want_state = getattr(qwen, name)(q, k, v, g=g, beta=beta, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name}: output")
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5, msg=f"{name}: state")


@pytest.mark.parametrize("length", [1, 2, 5, 8, 17])
def test_the_doubling_solve_is_exact_from_enough_steps_and_only_then(length: int) -> None:
    """``(I - L)^-1 B`` by ``ceil(log2(length))`` doublings equals the triangular solve; one fewer does not."""
    generator = torch.Generator().manual_seed(length)
    lower = (torch.rand(3, length, length, generator=generator, dtype=torch.float64) * 0.5 + 0.5).tril(-1)
    rhs = torch.randn(3, length, 5, generator=generator, dtype=torch.float64)
    eye = torch.eye(length, dtype=torch.float64)
    want = torch.linalg.solve_triangular(eye - lower, rhs, upper=False, unitriangular=True)
    steps = max(0, (length - 1).bit_length())
    torch.testing.assert_close(solve_unit_lower(lower, rhs, steps), want, msg=f"{steps} doublings")
    if length > 2:
        short = solve_unit_lower(lower, rhs, steps - 1)
        assert not torch.allclose(short, want, atol=1e-6), f"{steps - 1} doublings must not solve {length} rows"


def test_the_manifest_carries_each_layers_own_cache(qwen3_5: tuple[Path, Path]) -> None:
    cache = manifest_mod.read(qwen3_5[1]).kv_cache
    assert cache.kind == "hybrid", cache
    want = [(0, n, *s, "state") for n, s in STATE.items()]
    want += [(1, n, 2, None, 16, "sequence") for n in ("key", "value")]
    want += [(2, n, *s, "state") for n, s in STATE.items()]
    got = [(t.layer, t.name, t.heads, t.length, t.width, t.span) for t in cache.tensors or ()]
    assert got == want, got


def test_kiln_generate_equals_transformers_generate(qwen3_5: tuple[Path, Path]) -> None:
    assert_kiln_generate(*qwen3_5, PROMPT, STEPS)


def test_a_left_padded_batch_equals_transformers_generate(qwen3_5: tuple[Path, Path]) -> None:
    _assert_padded_batch(*qwen3_5)


def test_a_left_padded_rows_state_is_its_unpadded_state(qwen3_5: tuple[Path, Path]) -> None:
    """The prefill graph's DeltaNet state for a prompt shorter than the conv window, left-padded beside a longer
    one, equals that prompt's alone (the padding neither decays nor writes the state), as transformers' does."""
    ckpt, out = qwen3_5
    spec = load_model(ckpt).spec
    prompts = make_prompts(spec, [9, 3], seed=3)
    names = [f"present.{i}.{n}" for i in (0, 2) for n in STATE]
    with OrtRunner({GraphKind.PREFILL: out / manifest_mod.read(out).graph(GraphKind.PREFILL).file}) as runner:
        padded = runner.run(GraphKind.PREFILL, prompt_feeds(prompts, 0))
        alone = runner.run(GraphKind.PREFILL, prompt_feeds(prompts[1:], 0))
    hf = hf_model(ckpt)
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        layers = hf(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).cache.layers
    for name in names:
        np.testing.assert_allclose(padded[name][1], alone[name][0], rtol=1e-5, atol=1e-6, err_msg=name)
    for i in (0, 2):
        conv = layers[i].conv_states[0].transpose(1, 2).numpy()  # [1, K, C]: kiln's [1, 1, K, C] without its head
        np.testing.assert_allclose(padded[f"present.{i}.conv"][1], conv, rtol=1e-5, atol=1e-6, err_msg=f"{i} conv")
        ssm = layers[i].recurrent_states[0][0].numpy()
        np.testing.assert_allclose(padded[f"present.{i}.ssm"][1], ssm, rtol=1e-4, atol=1e-5, err_msg=f"{i} ssm")


def _assert_padded_batch(ckpt: Path, out: Path) -> None:
    """kiln's ORT runner on prefill + decode and on the unified graph alone, batch 1 and a left-padded batch of two."""
    assert_greedy_equals_hf(ckpt, out, STEPS)


@pytest.mark.slow
def test_fp16_int4_and_the_ort_target_pass_their_parity(qwen3_5: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt = qwen3_5[0]
    fp16 = export(
        ckpt, tmp_path / "out16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert fp16.parity.passed, fp16.parity.failures()
    inputs = fp16.manifest.graph(GraphKind.DECODE).inputs
    assert {t.dtype for t in inputs if t.name.startswith("past_key_values.")} == {"float16"}
    ort = export(ckpt, tmp_path / "out-ort", ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort"))
    assert ort.parity.passed, ort.parity.failures()
    assert ort.manifest.kv_cache.kind == "hybrid"
    assert_int4_generation(ckpt, tmp_path / "out4", STEPS)
