"""Mamba v1 through kiln's export pipeline (issue 43 item 2: MambaForCausalLM, FalconMambaForCausalLM, the
``state`` cache kind with one SSM head of ``intermediate x state_size`` per layer; JambaForCausalLM, the
``hybrid`` kind: that state on its Mamba layers, keys and values on its attention layer). The traced selective scan
(plugins/hf/mamba1_scan.py) equals transformers' own code: its sequence form from zeros and its one-token
recurrence, and a step of several tokens from a random state equals that recurrence token by token; kiln's
eager reference from an empty cache (a left-padded batch) equals its prefill's. Per
family: ``kiln export --target ort`` passes its parity (the portable and the ONNX Runtime graphs, a
left-padded row among its feeds); the manifest carries ``conv`` and ``ssm`` of fixed sizes; greedy tokens
on both graph sets (batch 1 and a left-padded batch of two) and through ``kiln generate`` equal
transformers' ``generate()``; ``--fp16`` and ``--int4 --int4-method rtn`` pass their parity."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import torch

from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.pipeline import export
from kiln.plugins.hf.build import tiny_transformers
from kiln.plugins.hf.decoder import HFDecoder
from kiln.plugins.hf.mamba1_scan import MIXERS, continues_a_state, selective_scan, token_by_token, traced_mamba1
from kiln_testing import assert_greedy_equals_hf, assert_int4_generation, assert_kiln_generate

CASES = {"mamba": "MambaMixer", "falcon-mamba": "FalconMambaMixer", "jamba": "JambaMambaMixer"}  # tiny_mamba.py
# the layers carrying a state (Jamba's layer 1 is attention: key and value, growing)
STATE_LAYERS = {"mamba": [0, 1], "falcon-mamba": [0, 1], "jamba": [0, 2]}
KERNEL, INNER, SIZE = 4, 128, 16
SHAPES = {"conv": (1, KERNEL, INNER), "ssm": (1, INNER, SIZE)}
STEPS = 16


def _save(case: str, directory: Path) -> Path:
    tiny_transformers(case, seed=1).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)  # (a numbered folder of the case's name)
    ckpt = _save(request.param, root / "ckpt")
    result = export(ckpt, root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort"))
    assert result.parity.passed, result.parity.failures()
    return ckpt, root / "out"


def _zero_cache(config: object, batch: int) -> object:
    """transformers' cache as kiln's graphs see it at prefill: every state present, zero."""
    cache = transformers.DynamicCache(config=config)
    for layer in (layer for layer in cache.layers if hasattr(layer, "recurrent_states")):  # Jamba's attention: none
        zeros = torch.zeros(batch, INNER, KERNEL), torch.zeros(batch, INNER, SIZE)
        layer.lazy_initialization(conv_states=zeros[0], recurrent_states=zeros[1], conv_kernel_size=KERNEL)
        layer.has_previous_state[0] = True
    return cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_traced_scan_equals_transformers_own_code(case: str) -> None:
    """Prefill from zeros (transformers' sequence form) and the next token (its recurrence): logits and states."""
    model, generator = tiny_transformers(case, seed=3).eval(), torch.Generator().manual_seed(3)
    ids, nxt = torch.randint(3, 128, (2, 11), generator=generator), torch.randint(3, 128, (2, 1), generator=generator)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True)
        want_next = model(input_ids=nxt, cache=want.cache, use_cache=True)
        with traced_mamba1(MIXERS[CASES[case]]):
            got = model(input_ids=ids, cache=_zero_cache(model.config, 2), use_cache=True)
            got_next = model(input_ids=nxt, cache=got.cache, use_cache=True)
    for name, a, b in (("prefill", got, want), ("decode", got_next, want_next)):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5, msg=name)
        for mine, theirs in zip(a.cache.layers, b.cache.layers, strict=True):
            if hasattr(theirs, "recurrent_states"):
                torch.testing.assert_close(mine.recurrent_states[0], theirs.recurrent_states[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(got_next.logits, got.logits[:, -1:]), "the decode step must move the logits"


def test_the_scan_from_a_state_equals_the_recurrence_and_needs_its_depth() -> None:
    """Several tokens from a random state: ``h[t] = exp(decay[t]) h[t-1] + inputs[t]`` step by step; a
    depth too small for the length (2 doubling steps cover 4 positions, not 11) does not."""
    generator = torch.Generator().manual_seed(0)
    decay = -torch.rand(2, 8, 11, 4, generator=generator) * 2
    inputs, state = torch.randn(2, 8, 11, 4, generator=generator), torch.randn(2, 8, 4, generator=generator)
    want, h = [], state
    for t in range(11):
        h = torch.exp(decay[:, :, t]) * h + inputs[:, :, t]
        want.append(h)
    states, final = selective_scan(decay, inputs, state)
    torch.testing.assert_close(states, torch.stack(want, dim=2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, h)
    short, _ = selective_scan(decay, inputs, state, depth=2)
    assert not torch.allclose(short, states, rtol=1e-3, atol=1e-3), "2 doubling steps must not cover 11 positions"


def _padded_prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, mask and positions of 7 tokens, row 0 left-padded by 3 (parity's tensor feeds)."""
    ids = torch.randint(3, 128, (batch, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(batch, 7, dtype=torch.int64)
    mask[0, :3] = 0
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _empty_past(decoder: HFDecoder, presents: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """The unified graph's empty cache (``contract.steps.empty_past``) shaped as ``presents``: keys and
    values of length 0, states of zeros."""
    return [
        tuple(
            t[:, :, :0] if name in ("key", "value") else torch.zeros_like(t)
            for name, t in zip(names, layer, strict=True)
        )
        for names, layer in zip(decoder.cache_names, presents, strict=True)
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reference_from_an_empty_cache_equals_its_prefill(case: str) -> None:
    """The eager reference of model.onnx's prompt call (several tokens from an empty cache, row 0
    left-padded) equals prefill's (no past): transformers' sequence form, which zeroes the padding. Token
    by token, Jamba's one-token recurrence reads no mask, so its padded row's states take in the padding:
    the reference the tiny Jamba's int4 export was once refused by (docs/parity.md)."""
    decoder = HFDecoder(tiny_transformers(case, seed=3).eval())
    ids, mask, pos = _padded_prompt(2)
    with torch.no_grad():
        want, presents = decoder(ids, mask, pos)
        got, states = decoder(ids, mask, pos, _empty_past(decoder, presents))
        stepped, stepped_states = token_by_token(decoder.forward, ids, mask, pos, _empty_past(decoder, presents), False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(states, presents, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ssm = STATE_LAYERS[case][0]  # its first state layer's SSM state, row 0 (padded) and row 1
    gap = [float((stepped_states[ssm][-1][row] - presents[ssm][-1][row]).abs().max()) for row in (0, 1)]
    assert gap[1] < 1e-6, gap  # the unpadded row: the recurrence equals the sequence form
    assert (gap[0] > 1e-4) == (case == "jamba"), gap  # Mamba's mixers mask each step's columns: only Jamba's leak
    torch.testing.assert_close(stepped[1], want[1], rtol=1e-5, atol=1e-6)


def test_only_an_empty_cache_takes_the_sequence_form() -> None:
    """A step continues a state (token by token) where a past position precedes it or a state is not zero."""
    decoder = HFDecoder(tiny_transformers("jamba", seed=3).eval())
    ids, mask, pos = _padded_prompt(1)
    with torch.no_grad():
        empty = _empty_past(decoder, decoder(ids, mask, pos)[1])
    assert not continues_a_state(ids, mask, empty)
    assert continues_a_state(ids[:, 1:], mask, empty), "a past position before the step"
    seeded = [
        tuple(t + 0.5 if name == "ssm" else t for name, t in zip(names, layer, strict=True))
        for names, layer in zip(decoder.cache_names, empty, strict=True)
    ]
    assert continues_a_state(ids, mask, seeded), "a state not zero"


def test_the_manifest_carries_one_ssm_head_per_layer(exported: tuple[Path, Path]) -> None:
    from kiln.exporter.artifacts import manifest as manifest_mod

    manifest, case = manifest_mod.read(exported[1]), exported[0].parent.name.rstrip("0123456789")
    assert manifest.kv_cache.kind == ("hybrid" if case == "jamba" else "state"), manifest.kv_cache
    states = [
        (t.layer, t.name, t.heads, t.length, t.width) for t in manifest.kv_cache.tensors or () if t.span == "state"
    ]
    assert states == [(i, name, *shape) for i in STATE_LAYERS[case] for name, shape in SHAPES.items()], states
    decode = manifest.graph(GraphKind.DECODE)
    assert {t.name: list(t.shape) for t in decode.outputs if t.name.startswith("present.0.")} == {
        f"present.0.{n}": ["batch", *s] for n, s in SHAPES.items()
    }


def test_greedy_tokens_equal_transformers_generate(exported: tuple[Path, Path]) -> None:
    """kiln's ORT runner on the portable and --target ort graphs, batch 1 and a left-padded batch of two."""
    assert_greedy_equals_hf(*exported, STEPS, ort=True, unified=False)


def test_kiln_generate_equals_transformers_generate(exported: tuple[Path, Path]) -> None:
    assert_kiln_generate(*exported, [5, 17, 33, 9, 101, 64, 3, 88, 12], STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_and_int4_pass_their_parity(case: str, tmp_path: Path) -> None:
    """--fp16 (its own parity, the state carried in float16), and int4 RTN on both graph sets against
    PyTorch on the same int4 weights (``assert_int4_generation``)."""
    ckpt = _save(case, tmp_path / "ckpt")
    fp16 = export(
        ckpt, tmp_path / "out16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
    )
    assert fp16.parity.passed, fp16.parity.failures()
    ssm = [t.dtype for t in fp16.manifest.graph(GraphKind.DECODE).inputs if t.name.endswith(".ssm")]
    assert ssm == ["float16"] * len(STATE_LAYERS[case]), ssm
    int4 = assert_int4_generation(ckpt, tmp_path / "out4", STEPS)
    assert int4.manifest.kv_cache.kind == ("hybrid" if case == "jamba" else "state")
