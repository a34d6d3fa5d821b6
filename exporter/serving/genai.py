"""``genai_config.json`` (and ``tokenizer_config.json``) for ONNX Runtime GenAI beside ``model.onnx``.

The format is the one ``src/config.cpp`` of microsoft/onnxruntime-genai parses (its JSON
elements reject unknown keys, so nothing else is written):

- ``model.type = "decoder"``: the generic decoder-only LLM type (``ModelType::IsLLM`` in
  ``src/models/model_type.h``); ``model.decoder`` names ``model.onnx`` (``model.ort.onnx`` for an
  ``--int4 --target ort`` export: ``genai_graph``) and its I/O, with the KV names as ``%d``
  templates over the layer index.
- ``search.past_present_share_buffer = false``: kiln's graphs grow the cache with ``Concat``
  (``present`` = ``past`` + new), they do not write into a preallocated ``max_length`` buffer.
- ``search.do_sample = false``: greedy, so generation is deterministic and comparable.

How GenAI builds the inputs (``src/models/position_inputs.cpp``, checked against 0.18.0): it pads a
batch on the *right* with ``pad_token_id``, derives ``attention_mask`` (0 for trailing pads) and
``position_ids`` (the column index of each real token) from the token ids, and keeps the padded
slots in the KV cache, masked out. kiln's graphs honour both inputs, so this gives the same tokens
as kiln's left-padded reference. A prompt whose *last* tokens equal ``pad_token_id`` loses them
to the mask, and with a batch of more than one, *leading* pad ids are treated as real tokens.

Recurrent caches (``kv_cache.kind`` ``state``/``hybrid``) are refused, LFM2's too: GenAI 0.18.0 has
model types of its own for LFM2 (``lfm2``, ``lfm2_moe``: ``decoder.layer_types``, ``conv_cache_size``,
``past_conv_names``/``present_conv_names`` templates) that carry a conv window per conv layer, but
it takes the window's shape from the graph and refuses any input not of rank 3 ("expected conv state
input to be rank 3 [B, H, L]"), and kiln's contract carries every cache tensor at rank 4. A batch
would not agree either: GenAI pads it on the right, so a shorter row's trailing pads (zeroed, masked)
would end its conv window. tests/export/test_genai_lfm2.py runs GenAI on kiln's LFM2 graph to show it.

Graphs exported with ``--ple-tables input`` take the PLE tables as inputs that GenAI does not
know; feed them once per generator with ``generator.set_model_input(name, table)``.

The tokenizer (onnxruntime-extensions, ``operators/tokenizer/tokenizer_jsconfig.hpp``) needs a
``tokenizer_config.json`` beside ``tokenizer.json``; its ``tokenizer_class`` picks the
implementation. Only BPE ``tokenizer.json`` files (byte-level or not) are mapped here, to the
generic ``PreTrainedTokenizerFast``; for any other model type no ``tokenizer_config.json`` is
written and GenAI runs on token ids only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.contract.io import GraphKind, past_names, present_names
from kiln.exporter.precision.kinds.plan import Precision
from kiln.exporter.targets import target
from kiln.inputs import TOKENIZER_MAX_BYTES, read_input

__all__ = [
    "GENAI_CONFIG",
    "TOKENIZER_CONFIG",
    "MODEL_TYPE",
    "PAST_KEY_TEMPLATE",
    "PAST_VALUE_TEMPLATE",
    "PRESENT_KEY_TEMPLATE",
    "PRESENT_VALUE_TEMPLATE",
    "genai_config",
    "genai_graph",
    "genai_refusal",
    "tokenizer_config",
    "write_genai_config",
]

GENAI_CONFIG = "genai_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MODEL_TYPE = "decoder"
# GenAI's %d templates for kiln's KV names; _check_io proves they agree with io_contract for every layer.
PAST_KEY_TEMPLATE = "past_key_values.%d.key"
PAST_VALUE_TEMPLATE = "past_key_values.%d.value"
PRESENT_KEY_TEMPLATE = "present.%d.key"
PRESENT_VALUE_TEMPLATE = "present.%d.value"
_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # onnxruntime-extensions: BPE, generic model name "PreTrained"
# where a family's config (the manifest's) states the attention heads and the hidden width: the
# native family's own names; every other family by Hugging Face's standard names (plugins.hf
# writes them also for configs of other field names, GPT-2's n_head / n_embd)
_SIZE_KEYS = {"native": ("n_heads", "d_model")}
_STANDARD_SIZE_KEYS = ("num_attention_heads", "hidden_size")


def _check_io(manifest: Manifest) -> None:
    """model.onnx must have every tensor GenAI binds by name; otherwise one ``ArtifactError``."""
    graph = manifest.graph(GraphKind.UNIFIED)
    inputs = {t.name for t in graph.inputs}
    outputs = {t.name for t in graph.outputs}
    n_layers = manifest.model.n_layers
    wanted_in = {"input_ids", "attention_mask", "position_ids"}
    wanted_out = {"logits"}
    for i in range(n_layers):
        key, value = past_names(i)
        if (PAST_KEY_TEMPLATE % i, PAST_VALUE_TEMPLATE % i) != (key, value) or (
            PRESENT_KEY_TEMPLATE % i,
            PRESENT_VALUE_TEMPLATE % i,
        ) != present_names(i):
            raise AssertionError(
                f"GenAI name templates disagree with kiln.exporter.contract.io at layer {i}"
            )  # a kiln bug
        wanted_in.update((key, value))
        wanted_out.update(present_names(i))
    missing = sorted(wanted_in - inputs) + sorted(wanted_out - outputs)
    if missing:
        raise ArtifactError(
            f"genai: {graph.file} lacks {missing[:4]} that ONNX Runtime GenAI binds by name; re-export the "
            "directory with this kiln"
        )


def genai_graph(manifest: Manifest) -> str:
    """The graph GenAI runs: ``model.onnx``, or for an ``--int4 --target ort`` export
    ``model.ort.onnx`` (MatMulNBits bits=4: what is fast on ONNX Runtime; the portable int4
    graph's DequantizeLinear would also run). Same I/O contract either way."""
    for name, entry in (manifest.targets or {}).items():  # the first target that says GenAI runs its graph
        if target(name).serves_genai(Precision.parse(entry.precision)):
            return entry.graphs[GraphKind.UNIFIED.value].file
    return manifest.graph(GraphKind.UNIFIED).file


def genai_refusal(manifest: Manifest) -> str | None:
    """Why GenAI cannot run an export's cache (None: it can): its decoder sizes every cache
    tensor by one ``head_size`` and ``num_key_value_heads``, which a cache of per-tensor shapes
    (multi-head latent attention's latent and rope key) does not have, and it carries no SSM state
    and a conv window only at rank 3 (``_conv_window_refusal``). Read from the manifest's
    ``kv_cache.kind`` and from the unified graph's own cache inputs, so no config of other shapes
    than the graph's is ever written."""
    model = manifest.model
    shapes = {
        (t.shape[1], t.shape[3])
        for t in manifest.graph(GraphKind.UNIFIED).inputs
        if t.name.startswith("past_key_values.") and len(t.shape) == 4
    }
    if manifest.kv_cache.kind is None and shapes <= {(model.n_kv_heads, model.head_dim)}:
        return None
    kind = manifest.kv_cache.kind or "per-tensor"
    if kind == "shared_kv":
        return (
            "genai: no genai_config.json for a shared_kv cache (its last layers read another layer's keys and "
            "values, kv_cache.reads): ONNX Runtime GenAI gives every layer a cache of its own; run the portable "
            "graphs (kiln generate)"
        )
    if kind == "per_layer":
        return (
            "genai: no genai_config.json for a per_layer cache (keys and values of each layer's own heads and "
            "width, kv_cache.tensors): ONNX Runtime GenAI sizes every cache tensor by one head_size and "
            "num_key_value_heads; run the portable graphs (kiln generate)"
        )
    if kind in ("state", "hybrid"):
        return _conv_window_refusal(manifest) or (
            f"genai: no genai_config.json for a {kind} cache (a recurrent state per layer, conv and ssm of fixed "
            "sizes, kv_cache.tensors): ONNX Runtime GenAI's decoder carries keys and values only; run the portable "
            "graphs (kiln generate)"
        )
    return (
        f"genai: no genai_config.json for a {kind} cache (multi-head latent attention: a latent and a rope key "
        "per layer, of two widths):"
        f" ONNX Runtime GenAI sizes every cache tensor by one head_size; run the portable graphs (kiln generate)"
    )


def _conv_window_refusal(manifest: Manifest) -> str | None:
    """The refusal of a cache whose recurrent layers carry a conv window and no SSM state (LFM2's short
    convolutions), naming the window's shape in the unified graph; None for any other cache.

    GenAI's ``lfm2`` model type (``ConvKeyValueCache``, ``src/models/kv_cache.cpp``) binds each conv
    layer's window by ``past_conv_names``/``present_conv_names`` but shapes it from the graph input and
    throws for any rank but 3 (``[batch, hidden, conv_L_cache - 1]``, what its builder writes); kiln's
    contract carries every cache tensor as ``[batch, heads, length, width]``."""
    names = {t.name for t in manifest.kv_cache.tensors or ()}
    if "conv" not in names or "ssm" in names:
        return None
    shape = next(t.shape for t in manifest.graph(GraphKind.UNIFIED).inputs if t.name.endswith(".conv"))
    return (
        f"genai: no genai_config.json for a {manifest.kv_cache.kind} cache of short convolutions (a conv window "
        f"alone per conv layer, kv_cache.tensors): ONNX Runtime GenAI's lfm2 model type takes that window only as "
        f"a rank-3 [batch, hidden, conv_L_cache - 1] input, kiln's graphs carry it as "
        f"[{', '.join(map(str, shape))}] (every cache tensor [batch, heads, length, width]); run the portable "
        "graphs (kiln generate)"
    )


def genai_config(manifest: Manifest) -> dict[str, Any]:
    """The ``genai_config.json`` of an export, from its manifest alone."""
    if (why := genai_refusal(manifest)) is not None:
        raise ArtifactError(why)
    _check_io(manifest)
    model = manifest.model
    n_kv, head_dim = model.n_kv_heads, model.head_dim
    context = manifest.limits.max_context
    tokens: dict[str, int] = {}
    if model.bos_token_id is not None:
        tokens["bos_token_id"] = model.bos_token_id
    if model.eos_token_id is not None:
        tokens["eos_token_id"] = model.eos_token_id  # absent: generation runs to max_length
    # absent pad id: 0, as kiln.exporter.parity.left_pad does
    tokens["pad_token_id"] = model.pad_token_id if model.pad_token_id is not None else 0
    return {
        "model": {
            "type": MODEL_TYPE,
            **tokens,
            "context_length": context,
            "vocab_size": model.vocab_size,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": Path(genai_graph(manifest)).name,
                "head_size": head_dim,
                **_attention_sizes(manifest),
                "num_key_value_heads": n_kv,
                "num_hidden_layers": model.n_layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": PAST_KEY_TEMPLATE,
                    "past_value_names": PAST_VALUE_TEMPLATE,
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": PRESENT_KEY_TEMPLATE,
                    "present_value_names": PRESENT_VALUE_TEMPLATE,
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "min_length": 0,
            "max_length": context,
            "past_present_share_buffer": False,
            "top_k": 1,
            "top_p": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "early_stopping": True,
        },
    }


def _attention_sizes(manifest: Manifest) -> dict[str, int]:
    """``num_attention_heads`` and ``hidden_size`` as the family's config states them; a size
    the config does not state is left out (GenAI sizes the cache by head_size and
    num_key_value_heads), never guessed."""
    heads_key, hidden_key = _SIZE_KEYS.get(manifest.family, _STANDARD_SIZE_KEYS)
    sizes = {"hidden_size": manifest.config.get(hidden_key), "num_attention_heads": manifest.config.get(heads_key)}
    return {name: value for name, value in sizes.items() if isinstance(value, int) and not isinstance(value, bool)}


def _token_text(tokenizer: Mapping[str, Any], token_id: int | None) -> str | None:
    """The text of a token id: an added (special) token first, else the model's vocabulary."""
    if token_id is None:
        return None
    for added in tokenizer.get("added_tokens") or []:
        if added.get("id") == token_id:
            return str(added["content"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for text, index in vocab.items():
            if index == token_id:
                return str(text)
    return None


def tokenizer_config(tokenizer: Mapping[str, Any], manifest: Manifest) -> dict[str, Any] | None:
    """A minimal ``tokenizer_config.json`` for a parsed ``tokenizer.json``; None unless it is BPE.

    ``add_bos_token``/``add_eos_token`` are false: what the tokenizer adds is what its own
    ``post_processor`` says, which onnxruntime-extensions reads from ``tokenizer.json`` too.
    """
    model_node = tokenizer.get("model") or {}
    if model_node.get("type") != "BPE":
        return None
    ids = manifest.model
    config: dict[str, Any] = {"tokenizer_class": _TOKENIZER_CLASS}
    for key, token_id in (
        ("bos_token", ids.bos_token_id),
        ("eos_token", ids.eos_token_id),
        ("pad_token", ids.pad_token_id),
    ):
        text = _token_text(tokenizer, token_id)
        if text is not None:
            config[key] = text
    if model_node.get("unk_token") is not None:
        config["unk_token"] = str(model_node["unk_token"])
    config.update(
        {
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": manifest.limits.max_context,
        }
    )
    return config


def _write_json(path: Path, data: Mapping[str, Any]) -> Path:
    try:
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise ArtifactError(
            f"genai: could not write {path} ({exc}); check the permissions and free space of {path.parent}"
        ) from exc
    return path


def write_genai_config(onnx_dir: Path, manifest: Manifest) -> list[Path]:
    """Write ``genai_config.json`` beside ``model.onnx`` in ``onnx_dir`` (and ``tokenizer_config.json``
    beside the manifest's ``tokenizer.json`` when it is BPE); return the files written.

    The manifest is only read. Its ``files`` map does not list these files until it is re-hashed.
    """
    model_file = Path(manifest.graph(GraphKind.UNIFIED).file).name
    if not (onnx_dir / model_file).is_file():
        raise ArtifactError(
            f"genai: {onnx_dir / model_file} does not exist; write genai_config.json into the directory that "
            f"holds {model_file}"
        )
    written = [_write_json(onnx_dir / GENAI_CONFIG, genai_config(manifest))]
    if manifest.tokenizer:
        tok_path = onnx_dir / Path(manifest.tokenizer).name
        if not tok_path.is_file():
            raise ArtifactError(
                f"genai: the manifest names the tokenizer {manifest.tokenizer} but {tok_path} does not exist; "
                "re-export the directory"
            )
        text = read_input(tok_path, ArtifactError, TOKENIZER_MAX_BYTES, what="a tokenizer.json")  # no FIFO, no device
        try:
            tokenizer = json.loads(text.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(
                f"genai: {tok_path} is not valid JSON ({exc}); replace it with the checkpoint's tokenizer.json"
            ) from None
        tok_config = tokenizer_config(tokenizer, manifest)
        if tok_config is not None:
            written.append(_write_json(onnx_dir / TOKENIZER_CONFIG, tok_config))
    return written
