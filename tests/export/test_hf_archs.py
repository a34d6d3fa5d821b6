"""Every Hugging Face architecture kiln lists (``plugins.hf.archs.ARCHS``), proved on a tiny random
model per ``plugins.hf.tiny.TINY`` case (2 layers, hidden 64, the architecture's own features
on): the checkpoint is saved by transformers, exported by ``kiln export`` with ``--target ort``
(its parity check covers the portable and the ONNX Runtime graphs), and both graph sets' greedy
tokens must equal transformers' own ``generate()`` with its own cache, for batch 1 and a
left-padded batch. The first case of each architecture is also exported ``--fp16`` (which must
pass its own parity) and re-checked by ``kiln check``; the families of ``ORT_INT8`` also
``--target ort --ort-int8`` (weight-only int8: its own parity), those of ``INT4`` ``--target ort
--int4`` (RTN), proved against PyTorch on the int4 weights its graphs hold (an int4 model's tokens
are not the float checkpoint's generate()'s: ``kiln_testing.assert_int4_generation``). Which
layers ``--target ort`` fuses is asserted against ``ARCHS[arch].ort`` (what docs/architectures.md
and ``kiln plugins`` say); a test fails when a listed architecture has no case."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install -e .[hf])"
)

import torch

from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions, Precision
from kiln.exporter.parity import greedy, left_pad, make_prompts
from kiln.exporter.pipeline import export
from kiln.exporter.runners import OrtRunner
from kiln.exporter.targets.ort.moe import PROMPT_GRAPH
from kiln.plugins import load_model
from kiln.plugins.hf.archs import ARCHS
from kiln.plugins.hf.build import tiny_transformers
from kiln.plugins.hf.tiny import TINY
from kiln_testing import assert_int4_generation

STEPS = 24
# the cases whose attention --target ort leaves portable (ARCHS[arch].ort says so), and why
PORTABLE_ATTENTION = {
    "gpt2-upcast": "reorder_and_upcast_attn", "bloom": "ALiBi", "mpt": "ALiBi",
    "gpt-neox-japanese": "its own causal mask", "deepseek-v2": "multi-head latent attention",
    "deepseek-v3": "multi-head latent attention", "mamba2": "no attention", "mamba": "no attention",
    "falcon-mamba": "no attention",
}  # fmt: skip
# the cases whose last layers read an earlier layer's cache (a shared_kv layout): --target ort fuses the attention of
# the layers that carry one; a hybrid's (Mamba2 layers 0 and 2): its attention layer (Nemotron-H's: block 2); Gemma
# 4's: its sliding layers (its global layers' cache has another head dim and KV heads than the first's: portable)
CARRYING_LAYERS = {
    "gemma3n-shared-window": [0, 1, 2], "gemma4-shared-window": [0, 2], "gemma4-window": [0],
    "granitemoehybrid": [1], "granitemoehybrid-rope-dense": [1], "bamba": [1],
    "nemotronh": [2], "qwen3_5": [1], "qwen3_next": [1], "qwen3_5_moe": [1],
    "lfm2": [1], "lfm2-moe": [1], "jamba": [1],
}  # fmt: skip
# the cases with attention sinks: every GroupQueryAttention of theirs reads them as its head_sink
ATTENTION_SINKS = {"gpt-oss-window", "flint-window", "granite-swa-window", "granitemoe-swa-window"}
# the mixture-of-experts cases: the layers whose experts --target ort turns into ONNX Runtime's MoE
# op in every graph, and the reason each block left as per-expert MatMuls gives (the manifest's
# moe_not_fused; ARCHS[arch].ort says so)
MOE_LAYERS = {
    "mixtral-window": [0, 1], "qwen3-moe": [1], "qwen3-moe-unnormalised": [0, 1], "gpt-oss-window": [],
    "qwen2-moe-window": [0, 1], "olmoe": [0, 1], "hunyuan-moe": [0, 1], "flex-olmo": [0, 1], "mellum-window": [0, 1],
    "qwen3_next": [0, 1, 2], "qwen3_5_moe": [0, 1, 2], "jamba": [1],
}  # fmt: skip
# top-k before the softmax, sigmoid scores, a bias on the choice, sparsemixer
_NOT_TOPK = "the routing weights do not come from a TopK of the router"
_RELU = "the experts' first projection is not split in two halves (gate, up): its output is read by Relu"
MOE_NOT_FUSED = {
    "gpt-oss-window": dict.fromkeys(
        [0, 1], "the experts' first projection is not split in two halves (gate, up): its output is read by Add"
    ),
    "granitemoe": dict.fromkeys([0, 1], _NOT_TOPK), "granitemoeshared": dict.fromkeys([0, 1], _NOT_TOPK),
    "glm4-moe": {1: _NOT_TOPK}, "ernie4_5-moe": {1: _NOT_TOPK}, "minimax-m2": dict.fromkeys([0, 1], _NOT_TOPK),
    "phimoe-window": dict.fromkeys([0, 1], _NOT_TOPK), "aria-text": dict.fromkeys([0, 1], _NOT_TOPK),
    "cohere2-moe-window": dict.fromkeys([0, 1], _NOT_TOPK), "dots1": {1: _NOT_TOPK},
    "exaone-moe-window": {1: _NOT_TOPK}, "hy-v3": {1: _NOT_TOPK},
    "granitemoe-swa-window": dict.fromkeys([0, 1], _NOT_TOPK), "kolibri1-window": dict.fromkeys([0, 1], _NOT_TOPK),
    "laguna-window": {1: _NOT_TOPK}, "minicpm5-moe": {1: _NOT_TOPK}, "afmoe-window": {1: _NOT_TOPK},
    "solar-open": dict.fromkeys([0, 1], _NOT_TOPK),
    "minimax-m3-vl": dict.fromkeys([0, 1], "the gate/up activation is not silu(gate) * up"),
    "flint-window": {1: "the router does not take the top-k of a softmax over all experts"}, "ergo-window": {1: _RELU},
    "deepseek-v2": {1: _NOT_TOPK}, "deepseek-v3": {1: _NOT_TOPK},
    "granitemoehybrid": dict.fromkeys([0, 1, 2], _NOT_TOPK), "nemotronh": {3: _RELU},
    "lfm2-moe": dict.fromkeys([1, 2], _NOT_TOPK),
}  # fmt: skip
# the sliding-window cases (window 4, shorter than prompt + generation): the decode graph's layers
# whose GroupQueryAttention applies the window itself (local_window_size 4, the family's mask
# replaced by the padding-only bias); prefill keeps the family's mask (GQA refuses a local window
# with causal=0)
WINDOW_LAYERS = {
    "mistral-window": [0, 1], "qwen2-window": [1], "gemma2-window": [0], "gemma3-window": [0],
    "starcoder2-window": [0, 1], "mixtral-window": [0, 1], "qwen2-moe-window": [0], "phimoe-window": [0, 1],
    "olmo3-window": [0], "cohere2-window": [0], "exaone4-window": [0], "ministral-window": [0, 1],
    "gemma3-multimodal-window": [0], "mistral3-multimodal-window": [0, 1], "cohere2-moe-window": [0],
    "cwm-window": [1], "ergo-window": [1],
    "exaone-moe-window": [0], "kolibri1-window": [1], "laguna-window": [1], "mellum-window": [0],
    "modernbert-decoder-window": [1], "vaultgemma-window": [0], "afmoe-window": [0],
    "gpt-oss-window": [0], "flint-window": [1], "granite-swa-window": [0], "granitemoe-swa-window": [0],
    "gemma3n-window": [0], "gemma3n-shared-window": [0, 2], "gemma4-window": [0], "gemma4-shared-window": [0, 2],
}  # fmt: skip
# tensors transformers initialises to zeros where zeros hide what they do: the routers' correction
# biases on the expert choice (GLM-4-MoE, MiniMax-M2, Ernie 4.5-MoE, dots.llm1...), AFMoE's expert
# bias and router, Granite-SWA's attention sinks
ZERO_AT_INIT = ("e_score_correction_bias", "expert_bias", "gate_bias", "router.gate.weight", "sinks")
# the families issue 41's second pass added, each also exported --target ort --ort-int8 (its low-bit
# form; its parity), but those whose tiny model has near-tie steps that int8 weights flip (token
# match 0.75 to 0.875 of 0.9): Ergo, MiniMax-M3, Nemotron, Persimmon
ORT_INT8 = {
    "afmoe-window", "apertus1p5", "aria-text", "biogpt", "codegen", "cohere-compass", "cohere2-moe-window",
    "cwm-window", "dots1", "exaone-moe-window", "flex-olmo", "flint-window", "gpt-neox-japanese", "granite-swa-window",
    "granitemoe-swa-window", "helium", "hy-v3", "hyperclovax", "jais2", "kolibri1-window", "laguna-window",
    "mellum-window", "minicpm5-moe", "modernbert-decoder-window", "nanochat", "solar-open", "vaultgemma-window",
}  # fmt: skip
# the families issue 41's first pass added (and MPT, and issue 43's LFM2-MoE), and those left out of ORT_INT8: each
# also exported --target ort --int4 (RTN, its low-bit form), its tokens judged against PyTorch on the graphs' own int4
# weights, not the float checkpoint's, so its near-ties no longer flip against the reference
INT4 = {
    "qwen2-moe-window", "olmoe", "granitemoe", "granitemoeshared", "glm4-moe", "ernie4_5-moe", "hunyuan-moe",
    "minimax-m2", "phimoe-window", "glm", "hunyuan-dense", "seed-oss", "apertus", "arcee", "gpt-bigcode",
    "olmo3-window", "cohere2-window", "exaone4-window", "ministral-window", "ministral3-yarn", "mpt", "ergo-window",
    "minimax-m3-vl", "nemotron", "persimmon", "lfm2-moe",
}  # fmt: skip
FIRST = {
    arch: next(case for case, (a, _) in TINY.items() if a == arch)
    for arch in ARCHS
    if any(a == arch for a, _ in TINY.values())
}


def _save(case: str, directory: Path) -> Path:
    """The tiny model saved by transformers; the tensors of ``ZERO_AT_INIT`` that are zeros made
    random, so what they shift is exercised (and no expert ties with another, which ONNX Runtime's
    TopK may break otherwise than PyTorch's). A multimodal case saves its wrapper whole (vision
    tower and all)."""
    model = tiny_transformers(case, seed=1)
    state, generator = (
        {**dict(model.named_parameters()), **dict(model.named_buffers())},
        torch.Generator().manual_seed(1),
    )
    with torch.no_grad():
        for name, tensor in state.items():
            if name.endswith(ZERO_AT_INIT) and not tensor.any():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _generate(hf: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, steps: int) -> np.ndarray:
    """transformers' own greedy generate(), its own cache, no end token."""
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return np.asarray(out[:, ids.shape[1] :].numpy())


def test_every_architecture_has_a_tiny_model() -> None:
    assert set(FIRST) == set(ARCHS)
    assert {arch for arch, _ in TINY.values()} == set(ARCHS)
    assert INT4 | ORT_INT8 <= set(TINY), sorted((INT4 | ORT_INT8) - set(TINY))  # each low-bit proof names a case


def test_the_plugins_table_takes_what_this_file_exports() -> None:
    """Every architecture's row of ``kiln plugins``' table (docs/architectures.md) takes what the
    test below exports: fp32 on the portable graphs and --target ort, and --fp16."""
    from kiln.exporter.support import support
    from kiln.plugins.hf import HF

    for spec in HF.specs():
        if spec.config["architecture"] in ARCHS:
            cells = support(spec).cells
            assert cells["fp32"]["portable"].taken and cells["fp32"]["ort"].taken and cells["fp16"]["portable"].taken, (
                spec.config
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TINY))
def test_generation_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    ckpt = _save(case, tmp_path / "ckpt")
    result = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort"))
    assert result.parity.passed, result.parity.failures()
    arch = TINY[case][0]
    text = ARCHS[arch].text  # a multimodal wrapper: its text decoder is exported, as its own class
    assert result.manifest.config["architecture"] == (text.texts[0] if text else arch)
    assert result.manifest.tools["transformers"] == transformers.__version__  # what the export ran with
    genai = tmp_path / "out" / "onnx" / "genai_config.json"
    if (
        result.manifest.kv_cache.kind is not None
    ):  # a cache of its own layout: GenAI cannot size it (serving.genai.genai_refusal), none is written
        assert not genai.exists()
    else:
        stated = json.loads(genai.read_text())["model"]["decoder"]
        own = transformers.AutoConfig.from_pretrained(ckpt).get_text_config()
        assert (stated["num_attention_heads"], stated["hidden_size"], stated["num_hidden_layers"]) == (
            own.num_attention_heads,
            own.hidden_size,
            own.num_hidden_layers,
        )
    assert result.manifest.targets is not None
    ort = {GraphKind(kind): entry for kind, entry in result.manifest.targets["ort"].graphs.items()}
    fused = {kind: entry.report("attention")["layers"] for kind, entry in ort.items() if kind is not GraphKind.UNIFIED}
    expected = [] if case in PORTABLE_ATTENTION else CARRYING_LAYERS.get(case, [0, 1])
    assert fused == {GraphKind.PREFILL: expected, GraphKind.DECODE: expected}, fused
    assert PORTABLE_ATTENTION.get(case, "GQA") in ARCHS[arch].ort, ARCHS[
        arch
    ].ort  # what docs/architectures.md and kiln plugins say
    for kind, entry in ort.items():
        # decode only: the prompt graphs keep the per-expert MatMuls (measured faster there) and say so
        layers = MOE_LAYERS.get(case, []) if kind is GraphKind.DECODE else []
        why = (
            MOE_NOT_FUSED[case]
            if case in MOE_NOT_FUSED
            else {}
            if kind is GraphKind.DECODE
            else dict.fromkeys(MOE_LAYERS.get(case, []), PROMPT_GRAPH)
        )
        assert entry.report("moe").get("layers", []) == layers, (kind, entry.report("moe"))
        assert entry.report("moe").get("not_fused", []) == [f"layer {i}: {w}" for i, w in sorted(why.items())], (
            kind,
            entry.report("moe"),
        )
        graph = onnx.load(tmp_path / "out" / entry.file, load_external_data=False)
        moe = [n for n in graph.graph.node if n.op_type == "MoE" and n.domain == "com.microsoft"]
        assert len(moe) == len(layers), (kind, len(moe))
        sinks = [
            n.input[11] if len(n.input) > 11 else "" for n in graph.graph.node if n.op_type == "GroupQueryAttention"
        ]
        assert all(bool(name) == (case in ATTENTION_SINKS) for name in sinks), (
            kind,
            sinks,
        )  # GQA's head_sink: the family's own sinks
    windows = {kind: entry.report("decode_mask").get("local_window_layers", []) for kind, entry in ort.items()}
    assert windows == {GraphKind.PREFILL: [], GraphKind.DECODE: WINDOW_LAYERS.get(case, []), GraphKind.UNIFIED: []}, (
        windows
    )
    if case in WINDOW_LAYERS:
        assert ort[GraphKind.DECODE].report("decode_mask")["compact"]  # the window is GQA's now, the bias only padding
    decode = onnx.load(tmp_path / "out" / ort[GraphKind.DECODE].file, load_external_data=False)
    local = {
        n.name: {a.name: a.i for a in n.attribute}.get("local_window_size", -1)
        for n in decode.graph.node
        if n.op_type == "GroupQueryAttention"
    }
    assert local == {
        f"/layers.{i}.attn/ort/GroupQueryAttention": 4 if i in WINDOW_LAYERS.get(case, []) else -1 for i in expected
    }, local
    if MOE_LAYERS.get(case):
        assert "MoE" in ARCHS[arch].ort, ARCHS[arch].ort
    spec = load_model(ckpt).spec
    steps = min(STEPS, result.report.max_context - 9)
    onnx_dir = tmp_path / "out" / "onnx"
    sets = {
        suffix: {k: onnx_dir / f"{k.value}{suffix}.onnx" for k in (GraphKind.PREFILL, GraphKind.DECODE)}
        for suffix in ("", ".ort")
    }
    # a multimodal wrapper's own generate() on input_ids alone (no Auto class maps every wrapper)
    loader = getattr(transformers, arch) if text else transformers.AutoModelForCausalLM
    hf = loader.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    for lengths in ([9], [9, 5]):  # batch 1, and a left-padded batch
        prompts = make_prompts(spec, lengths, seed=len(lengths))
        ids, mask, _ = left_pad(prompts, 0)
        want = _generate(hf, ids, mask, steps)
        for suffix, graphs in sets.items():
            with OrtRunner(graphs) as runner:
                got, _ = greedy(runner, spec, prompts, steps)
            np.testing.assert_array_equal(got, want, err_msg=f"{case}{suffix} {lengths}")
    if FIRST[arch] == case:
        assert check_dir(tmp_path / "out").passed
        fp16 = export(
            ckpt, tmp_path / "out16", ExportOptions.from_flags(max_batch=4, parity_tokens=8, precision=Precision.FP16)
        )
        assert fp16.parity.passed, fp16.parity.failures()
    if case in ORT_INT8:  # a low-bit form: weight-only int8 on ONNX Runtime's graphs, kiln's own parity
        ort_int8 = ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort", target_flags={"ort_int8": True})
        int8 = export(ckpt, tmp_path / "out8", ort_int8)
        assert int8.parity.passed, int8.parity.failures()
        assert (
            int8.manifest.targets is not None
            and (int8.manifest.targets["ort"].record or {}).get("int8", {}).get("bits") == 8
        ), int8.manifest.targets
    if case in INT4:  # a low-bit form: int4 (RTN) on both graph sets, against PyTorch on the same int4 weights
        assert_int4_generation(ckpt, tmp_path / "out4", steps)


@pytest.mark.parametrize(("alias", "case"), [("PhiMoEForCausalLM", "phimoe-window"), ("MPTForCausalLM", "mpt")])
def test_a_checkpoints_own_class_name_loads_as_transformers_class(alias: str, case: str, tmp_path: Path) -> None:
    """Published Phi-3.5-MoE and MPT checkpoints name their remote-code class (``architectures``,
    with an ``auto_map``); kiln reads them as transformers' port (``archs.ALIASES``), as
    transformers does by ``model_type``: the same module and logits as under transformers' name."""
    ckpt = _save(case, tmp_path / "ckpt")
    canonical = load_model(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(architectures=[alias], auto_map={"AutoModelForCausalLM": f"modeling.{alias}"})
    (ckpt / "config.json").write_text(json.dumps(config))
    aliased = load_model(ckpt)
    assert aliased.spec.config["architecture"] == canonical.spec.config["architecture"] == TINY[case][0]
    ids = torch.tensor([[5, 17, 3, 29]])
    with torch.no_grad():
        want, _ = canonical.module(ids, torch.ones_like(ids), torch.arange(4)[None])
        got, _ = aliased.module(ids, torch.ones_like(ids), torch.arange(4)[None])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_llama4_chunked_attention_at_int4_and_never_as_full_attention_on_the_onnx_target(tmp_path: Path) -> None:
    """Llama 4's chunked layers (chunks of 8 tokens, shorter than every parity run): kiln generate's
    loop equals transformers' generate() on the portable and --target ort graphs; --target ort at
    int4 (RTN) passes its parity; --target onnx, whose static masks have no chunk rule, refuses the
    model by name before any work (it would attend to every earlier key), and says so in one line."""
    from kiln.errors import ConfigError
    from kiln.exporter.precision.kinds.int4 import Int4, Int4Method
    from kiln.runtime.generate import Generator

    ckpt = _save("llama4-chunked", tmp_path / "ckpt")
    fp32 = export(ckpt, tmp_path / "out", ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="ort"))
    # its decode graph's mask and NoPE temperature read the past's length: no shared in-place buffer (it would read the
    # capacity)
    assert fp32.manifest.targets is not None and fp32.manifest.targets["ort"].kv_cache == "grown", (
        fp32.manifest.targets["ort"].kv_cache
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = [5, 17, 3, 29, 11, 7, 9, 4, 8]
    want = _generate(hf, np.array([prompt]), np.ones((1, len(prompt)), dtype=np.int64), STEPS)[0].tolist()
    for target in (None, "ort"):  # kiln generate's own loop
        assert list(Generator(tmp_path / "out", target=target).run(prompt, STEPS, stop_at_eos=False).tokens) == want, (
            target
        )
    int4 = export(
        ckpt,
        tmp_path / "out4",
        ExportOptions.from_flags(
            max_batch=4, parity_tokens=8, target="ort", precision=Precision.of(Int4(method=Int4Method.RTN))
        ),
    )
    assert int4.parity.passed, int4.parity.failures()
    with pytest.raises(
        ConfigError,
        match=r"^.*--target onnx does not apply chunked attention \(this Llama4ForCausalLM model attends within chunks "
        r"of 8 tokens",
    ) as refused:
        export(ckpt, tmp_path / "outx", ExportOptions.from_flags(max_batch=4, parity_tokens=8, target="onnx"))
    assert "\n" not in str(refused.value) and not (tmp_path / "outx" / "onnx").exists(), str(refused.value)
