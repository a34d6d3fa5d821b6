"""The one-token forms of the recurrent mixers (issue 43: the decode step of a recurrent layer is the recurrence,
not the scan on one position). At a traced length of one (mamba2_scan.py ``one_token``: the decode graph,
traced on its own because the families set ``LoadedModel.decode_traced``) Mamba2, Mamba v1 and Gated DeltaNet
take their recurrent update; the unified graph and prefill keep the scan. Each update equals the scan at
length one and transformers' own one-token code, from a zero and a random state, in float32; and the decode
graph of an export holds none of the scan's machinery (no CumSum or Trilu in a mixer: the unified graph has them)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import onnx
import torch

from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln.plugins.hf.build import tiny_model, tiny_transformers
from kiln.plugins.hf.gated_deltanet import gated_delta_rule, recurrent_step, traced_rule
from kiln.plugins.hf.mamba1_scan import selective_scan, step_state
from kiln.plugins.hf.mamba2_scan import _scan, _step, one_token

TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_only_a_python_one_is_one_token() -> None:
    assert one_token(1) and not one_token(3), "one_token: the Python int 1 only"
    assert not one_token(torch.tensor(1)), "a tensor is no traced static length"


@pytest.fixture(scope="module")
def mamba2_mixer() -> Any:
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=16, n_groups=2, conv_kernel=4, chunk_size=8
    )
    mixer = Mamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():  # away from the init's constants, so each parameter's role shows
        mixer.A_log.copy_(torch.randn(8))
        mixer.D.copy_(torch.randn(8))
        mixer.dt_bias.copy_(torch.randn(8))
    return mixer


@pytest.mark.parametrize("seeded", [False, True])
def test_the_mamba2_step_equals_the_scan_and_transformers_update(mamba2_mixer: Any, seeded: bool) -> None:
    from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update

    gen = torch.Generator().manual_seed(int(seeded))
    x, dt = torch.randn(2, 1, 8, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    b, c = torch.randn(2, 1, 2, 16, generator=gen), torch.randn(2, 1, 2, 16, generator=gen)
    state = torch.randn(2, 8, 8, 16, generator=gen) if seeded else torch.zeros(2, 8, 8, 16)
    with torch.no_grad():
        out, final = _step(mamba2_mixer, x, dt, b, c, state)
        scan_out, scan_final = _scan(mamba2_mixer, x, dt, b, c, state)
        theirs = state.clone()
        A = -torch.exp(mamba2_mixer.A_log.float())[:, None, None].expand(8, 8, 16)
        want = mamba2_selective_state_update(
            theirs, x[:, 0], dt[:, 0, :, None].expand(2, 8, 8), A, b[:, 0], c[:, 0],
            D=mamba2_mixer.D[:, None].expand(8, 8), dt_bias=mamba2_mixer.dt_bias[:, None].expand(8, 8),
            dt_softplus=True,
        )  # fmt: skip
    assert out.shape == (2, 1, 8, 8) and final.shape == (2, 8, 8, 16), (out.shape, final.shape)
    torch.testing.assert_close(out, scan_out, **TOL, msg="output: step vs scan")
    torch.testing.assert_close(final, scan_final, **TOL, msg="state: step vs scan")
    torch.testing.assert_close(out[:, 0], want, **TOL, msg="output: step vs transformers")
    torch.testing.assert_close(final, theirs, **TOL, msg="state: step vs transformers")
    assert final.abs().max() > 0 and not torch.equal(final, state), "the step must move the state"


@pytest.mark.parametrize("seeded", [False, True])
def test_the_mamba1_step_equals_the_scan_and_transformers_update(seeded: bool) -> None:
    from transformers.models.mamba.modeling_mamba import mamba_selective_state_update

    gen = torch.Generator().manual_seed(2 + int(seeded))
    x, dt, z = (torch.randn(2, 12, generator=gen) for _ in range(3))
    b, c = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    a, d = -torch.rand(12, 6, generator=gen) * 3, torch.randn(12, generator=gen)
    state = torch.randn(2, 12, 6, generator=gen) if seeded else torch.zeros(2, 12, 6)
    step = torch.nn.functional.softplus(dt)
    decay = (a * step[..., None])[:, :, None]  # [B, I, 1, N] as scan_forward builds them
    inputs = (step[..., None] * b[:, None] * x[..., None])[:, :, None]
    states, final = step_state(decay, inputs, state)
    scan_states, scan_final = selective_scan(decay, inputs, state)
    theirs = state.clone()
    want = mamba_selective_state_update(theirs, x, dt, a, b, c, D=d, dt_softplus=True, z=z)
    out = (torch.einsum("bitn,btn->bit", states, c[:, None]) + x[..., None] * d[:, None])[..., 0] * torch.nn.SiLU()(z)
    torch.testing.assert_close(states, scan_states, **TOL, msg="states: step vs scan")
    torch.testing.assert_close(final, scan_final, **TOL, msg="state: step vs scan")
    torch.testing.assert_close(final, theirs, **TOL, msg="state: step vs transformers")
    torch.testing.assert_close(out, want, **TOL, msg="output: step vs transformers")
    assert not torch.equal(final, state), "the step must move the state"


@pytest.mark.parametrize("seeded", [False, True])
def test_the_deltanet_step_equals_the_chunk_and_transformers_recurrence(seeded: bool) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    gen = torch.Generator().manual_seed(4 + int(seeded))
    q, k = (torch.randn(2, 1, 2, 16, generator=gen) for _ in range(2))  # 2 key heads for 4 value heads
    v = torch.randn(2, 1, 4, 16, generator=gen)
    g, beta = -2 * torch.rand(2, 1, 4, generator=gen), torch.rand(2, 1, 4, generator=gen)
    state = torch.randn(2, 4, 16, 16, generator=gen) if seeded else None
    kw: dict[str, Any] = dict(initial_state=state, use_qk_l2norm_in_kernel=True)
    got, got_state = recurrent_step(q, k, v, g, beta, **kw)
    chunk, chunk_state = gated_delta_rule(q, k, v, g, beta, steps=7, **kw)
    want, want_state = qwen.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True, **kw)
    assert got.shape == (2, 1, 4, 16) and got_state.shape == (2, 4, 16, 16), (got.shape, got_state.shape)
    for name, out, final in (("chunk", chunk, chunk_state), ("transformers", want, want_state)):
        torch.testing.assert_close(got, out, **TOL, msg=f"output: step vs {name}")
        torch.testing.assert_close(got_state, final, **TOL, msg=f"state: step vs {name}")
    dispatched, _ = traced_rule(q, k, v, g, beta, steps=7, **kw)
    assert torch.equal(dispatched, got), "traced_rule at one token must take recurrent_step"
    longer = [t.expand(-1, 3, *t.shape[2:]) for t in (q, k, v, g, beta)]
    torch.testing.assert_close(traced_rule(*longer, steps=7, **kw)[0], gated_delta_rule(*longer, steps=7, **kw)[0])


# a mixer's scope in the graphs' node names, per tiny case (plugins/hf/tiny_recurrent.py, tiny_mamba.py,
# tiny_qwen3_5.py), and the ops only its scan uses
MIXER_SCOPES = {"granitemoehybrid": ".mamba/", "mamba": ".mixer/", "qwen3_5": ".linear_attn/"}
SCAN_OPS = ("CumSum", "Trilu")


def _mixer_ops(path: Path, scope: str) -> collections.Counter[str]:
    graph = onnx.load(path, load_external_data=False).graph
    return collections.Counter(n.op_type for n in graph.node if scope in n.name)


@pytest.fixture(scope="module", params=sorted(MIXER_SCOPES))
def decode_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    tiny_transformers(request.param, seed=1).save_pretrained(root / "ckpt", safe_serialization=True)
    result = export(root / "ckpt", root / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8))
    assert result.parity.passed, result.parity.failures()
    return request.param, root / "out" / "onnx"


def test_the_families_trace_their_decode_step() -> None:
    for case in MIXER_SCOPES:
        assert tiny_model(case, seed=0).decode_traced, f"{case}: its decode must be traced at one token"
    assert not tiny_model("lfm2", seed=0).decode_traced, "lfm2's short convolution has no step form of its own"
    assert not tiny_model("llama", seed=0).decode_traced, "an attention-only decoder derives its decode"


def test_the_decode_graph_runs_no_scan(decode_export: tuple[str, Path]) -> None:
    case, onnx_dir = decode_export
    decode, unified = (_mixer_ops(onnx_dir / f"{name}.onnx", MIXER_SCOPES[case]) for name in ("decode", "model"))
    assert sum(unified.values()) > 0 and sum(decode.values()) > 0, f"{case}: no node in {MIXER_SCOPES[case]}"
    assert all(decode[op] == 0 for op in SCAN_OPS), f"{case}: the decode graph still scans: {decode}"
    assert any(unified[op] > 0 for op in SCAN_OPS), f"{case}: the unified graph must keep the scan: {unified}"
    assert sum(decode.values()) < sum(unified.values()), f"{case}: {sum(decode.values())} nodes vs {unified}"
