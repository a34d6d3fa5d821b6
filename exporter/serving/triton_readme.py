"""The README of a Triton model repository written by ``kiln triton``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kiln.exporter.artifacts.manifest import Manifest

__all__ = ["readme"]

IDLE_MICROSECONDS = 60_000_000  # a sequence (and its KV state) is dropped after 60 s without a request


class TritonModel(Protocol):
    """A model of the repository as the README reads it (``triton.TritonModel`` is one; named
    here, it would import back the module that imports this one)."""

    @property
    def config(self) -> dict[str, Any]: ...


def _shape(dims: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _tensor_lines(tensors: Sequence[Mapping[str, Any]]) -> list[str]:
    """README lines for config tensors (their dims exclude the batch dim)."""
    return [f"- `{t['name']}`: {t['data_type']}, [batch, {', '.join(map(str, t['dims']))}]" for t in tensors]


def readme(manifest: Manifest, models: Sequence[TritonModel]) -> str:
    """The repository's README: how to drive each model, every name and shape from the manifest."""
    return "\n".join(_readme_ort(manifest, models[0].config) + _readme_trt(models)) + "\n"


def _readme_ort(manifest: Manifest, ort: dict[str, Any]) -> list[str]:
    """The README's part on the ONNX Runtime model, which keeps the KV cache as implicit state."""
    layers = manifest.model.n_layers
    kv_dtype = manifest.kv_cache.dtype
    states = ort["sequence_batching"]["state"]
    first = states[0]
    out: list[str] = [
        f"# Triton model repository for {ort['name']}",
        "",
        "Written by `kiln triton` from `manifest.json`; every name, data type and shape below is the",
        "manifest's. Start the server with `tritonserver --model-repository <this folder>`. Shapes are",
        f"given as the client sends them, batch first; `max_batch_size` is {ort['max_batch_size']}, so the",
        "dims in `config.pbtxt` leave the batch dim out. -1 is a dim the client chooses.",
        "",
        f"## `{ort['name']}`: ONNX Runtime, KV cache kept by the server",
        "",
        f"`{ort['name']}/1/model.onnx/` holds the graph and its weights file. The KV cache is implicit state:",
        "after each request Triton keeps `present.{i}.key`/`present.{i}.value` and feeds them back as",
        f"`past_key_values.{{i}}.key`/`past_key_values.{{i}}.value` (i = 0..{layers - 1}, {kv_dtype},",
        f"shape per sequence {_shape(first['dims'])} without the batch dim) on the next request of the same sequence.",
        "The states (input <- output):",
        "",
    ]
    out += [f"- `{s['input_name']}` <- `{s['output_name']}`: {s['data_type']}, {_shape(s['dims'])}" for s in states]
    out += [
        "",
        "Inputs the client sends on every request:",
        "",
    ]
    out += _tensor_lines(ort["input"])
    out += ["", "Outputs:", ""]
    out += _tensor_lines(ort["output"])
    out += [
        "",
        "Driving one sequence (pick a correlation id, e.g. 42; the gRPC or HTTP client's `infer` takes",
        "`sequence_id`, `sequence_start` and `sequence_end`):",
        "",
        "1. Prefill: one request with `sequence_start=True`, `input_ids` = the P prompt ids ([1, P] int64),",
        "   `attention_mask` = ones [1, P], `position_ids` = [[0, 1, ..., P-1]]. Triton feeds the zero",
        f"   initial state (past length 0, dims {_shape(first['initial_state'][0]['dims'])}). The next token is "
        "the argmax of",
        "   `logits[0, -1]`.",
        "2. Decode, step t = 1, 2, ...: `input_ids` = [[next token]], `attention_mask` = ones [1, P + t]",
        "   (the whole context including this token), `position_ids` = [[P + t - 1]], same `sequence_id`,",
        "   `sequence_start=False`. Repeat until an end token or the context limit",
        f"   ({manifest.limits.max_context} tokens in all).",
        "3. Send `sequence_end=True` on the last request so that Triton frees the sequence's state",
        f"   (an idle sequence is dropped after {IDLE_MICROSECONDS // 1_000_000} s, `max_sequence_idle_microseconds`).",
        "",
        "Requests of different sequences are batched only when their tensors have the same shapes (Triton",
        "does not batch variable-shape inputs of different shapes unless ragged batching is enabled).",
        "A batch of prompts can also be sent as one sequence: left-pad them to one length with",
        "`attention_mask` 0 on the padding and `position_ids` counting real tokens only (0 on padding).",
        "",
        "Unverified (no Triton server was available when this was written): that the server accepts a",
        "zero-length initial state dim. If it refuses it, keep the cache in the client instead (the",
        "TensorRT models that `kiln build` makes possible, or `model.onnx` run by the client with",
        "`past_key_values.*` as ordinary inputs).",
    ]
    return out


def _readme_trt(models: Sequence[TritonModel]) -> list[str]:
    """The README's part on the TensorRT models, whose client carries the KV tensors."""
    out: list[str] = []
    for model in models[1:]:
        cfg = model.config
        out += [
            "",
            f"## `{cfg['name']}`: TensorRT, stateless, dynamic batching",
            "",
            f"`{cfg['name']}/1/model.plan`; instance group KIND_GPU with optimization profile 0.",
            "",
            "Inputs:",
            "",
        ]
        out += _tensor_lines(cfg["input"])
        out += ["", "Outputs:", ""]
        out += _tensor_lines(cfg["output"])
    if len(models) > 1:
        prefill, decode = models[1].config["name"], models[2].config["name"]
        out += [
            "",
            "## Driving the TensorRT models",
            "",
            f"1. `{prefill}` with `input_ids`, `attention_mask` (ones [1, P]) and `position_ids` ([[0..P-1]]);",
            "   keep every `present.{i}.key`/`present.{i}.value` output ([1, kv heads, P, head dim]).",
            f"2. `{decode}` with `input_ids` [[next token]], `attention_mask` ones [1, P + t], `position_ids`",
            "   [[P + t - 1]] and the previous step's `present.{i}.*` sent as `past_key_values.{i}.*`; its",
            "   `present.{i}.*` outputs are one position longer. Repeat.",
        ]
    return out
