"""``kiln generate``: greedy text generation through an export's prefill and decode graphs on
ONNX Runtime, with IOBinding so the KV cache never goes through numpy between steps.

Each step's ``present.*`` outputs stay OrtValues and are bound as the next step's ``past_*``
inputs; the attention mask is a view of one preallocated row of ones; logits are the only
output copied out (to take the argmax). What this does NOT avoid: kiln's portable decode graph
computes ``present = Concat(past, new)``, so the graph itself allocates and writes the whole
cache every step (O(past) bytes per token). The ``--target ort`` decode graph avoids that
(``target="ort"``, :class:`SharedKv`): its GroupQueryAttention writes the new token's key and
value in place when past and present are bound to the same buffer of fixed capacity (the
attention mask carries the length), so the cache is copied once, after the prompt, and never
again.

Parity: with ``forced`` tokens and ``keep_logits`` the loop is teacher-forced and returns every
step's logits, so it can stand in for ``parity.greedy`` as the candidate side of a generation
check through the exact code path users run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import GenerateError
from kiln.exporter.io_contract import kv_pairs
from kiln.exporter.targets.ort import shares_kv_buffer
from kiln.exporter.verify import require_verified

__all__ = ["ConcatKv", "Generation", "Generator", "KvStrategy", "SharedKv", "load_tokenizer", "parse_ids"]


@dataclasses.dataclass(frozen=True)
class Generation:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # new tokens, greedy (or forced)
    prefill_s: float  # the prompt's forward pass and first token
    decode_s: float  # all decode steps together
    logits: np.ndarray | None = None  # [steps, vocab] float32, with keep_logits

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1  # the first new token comes from the prefill
        return steps / self.decode_s if steps and self.decode_s > 0 else 0.0


class KvStrategy:
    """How KV tensors move from one step's outputs to the next step's inputs."""

    def __init__(self, n_layers: int) -> None:
        self._pairs = kv_pairs(n_layers)
        self.presents = [present for _, present in self._pairs]  # bound after ``logits``, in this order

    def start(self, prefill: dict[str, Any], capacity: int) -> None:
        """Take the prompt's presents (OrtValues by name) before the first decode step."""

    def bind(self, binding: Any, previous: dict[str, Any]) -> None:
        """Bind past inputs (from ``previous`` outputs by name) and present outputs."""
        raise NotImplementedError


class ConcatKv(KvStrategy):
    """For graphs that grow the cache with Concat: the runtime allocates each step's presents
    (total length); they are bound, as OrtValues, as the next step's pasts."""

    def bind(self, binding: Any, previous: dict[str, Any]) -> None:
        for past, present in self._pairs:
            binding.bind_ortvalue_input(past, previous[present])
            binding.bind_output(present, "cpu")


class SharedKv(KvStrategy):
    """For decode graphs whose attention writes the new key/value in place (the ``--target ort``
    graphs' GroupQueryAttention: it writes row ``total - 1`` and reads rows ``< total`` of a
    past buffer of any capacity, and aliases present to past when both are bound to one buffer):
    one ``[1, n_kv, capacity, head_dim]`` buffer per cache tensor, filled from the prompt's
    presents once and then bound as both input and output of every step (bound once: an
    IOBinding keeps its bindings between runs)."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers)
        self._buffers: dict[str, Any] = {}
        self._bound: Any = None

    def start(self, prefill: dict[str, Any], capacity: int) -> None:
        from onnxruntime import OrtValue

        for past, present in self._pairs:
            prompt = prefill[present].numpy()  # [1, n_kv, n, head_dim]
            buffer = np.zeros((*prompt.shape[:2], capacity, prompt.shape[3]), dtype=prompt.dtype)
            buffer[:, :, : prompt.shape[2]] = prompt
            self._buffers[past] = OrtValue.ortvalue_from_numpy(buffer)
        self._bound = None

    def bind(self, binding: Any, previous: dict[str, Any]) -> None:
        if binding is self._bound:
            return
        for past, present in self._pairs:
            binding.bind_ortvalue_input(past, self._buffers[past])
            binding.bind_ortvalue_output(present, self._buffers[past])
        self._bound = binding


class Generator:
    """The prefill and decode sessions of one verified kiln export directory, batch 1."""

    def __init__(self, directory: Path, threads: int = 2, target: str | None = None) -> None:
        from kiln.exporter.bench import session

        manifest = require_verified(directory)
        ple = manifest["export"].get("ple")
        if ple and ple.get("tables") == "input":
            raise GenerateError(f"{directory}: exported with --ple-tables input; kiln generate runs graphs with the tables as constants")
        if manifest["model"].get("encoder_dim") is not None:
            raise GenerateError(f"{directory}: a cross-attention decoder needs its encoder's output (encoder_hidden_states); kiln generate has no encoder to run")
        graphs = manifest["graphs"]
        n_layers = int(manifest["model"]["n_layers"])
        kv: KvStrategy = ConcatKv(n_layers)
        if target is not None:
            targets = manifest.get("targets") or {}
            if target not in targets:
                raise GenerateError(f"{directory}: has no --target {target} graphs; export it with --target {target}")
            graphs = targets[target]["graphs"]
            if shares_kv_buffer(manifest):
                kv = SharedKv(n_layers)
        self.directory = directory
        self.manifest = manifest
        self.max_context = int(manifest["limits"]["max_context"])
        self.eos = manifest["model"]["eos_token_id"]
        self._prefill = session(directory / graphs["prefill"]["file"], threads)
        self._decode = session(directory / graphs["decode"]["file"], threads)
        self._kv = kv
        self.kv_cache = "shared-buffer" if isinstance(kv, SharedKv) else "concat"  # how each step's cache is written
        self._vocab = int(manifest["model"]["vocab_size"])

    def run(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        stop_at_eos: bool = True,
        forced: Sequence[int] | None = None,
        keep_logits: bool = False,
    ) -> Generation:
        from onnxruntime import OrtValue

        if not prompt:
            raise GenerateError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens must be at least 1, found {max_new_tokens}")
        if len(prompt) + max_new_tokens - 1 > self.max_context:
            raise GenerateError(f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed the export's context limit {self.max_context}")
        if any(not 0 <= t < self._vocab for t in prompt):
            raise GenerateError(f"token ids must be in [0, {self._vocab}); found {[t for t in prompt if not 0 <= t < self._vocab][:5]}")
        n = len(prompt)
        mask = np.ones((1, n + max_new_tokens), dtype=np.int64)  # views of it are every step's mask
        logits_out = OrtValue.ortvalue_from_shape_and_type([1, 1, self._vocab], np.float32)
        kept: list[np.ndarray] = []
        tokens: list[int] = []

        def take(logits: np.ndarray) -> int:
            row = logits.reshape(-1, self._vocab)[-1].astype(np.float32)
            if keep_logits:
                kept.append(row)  # astype made it a copy
            step = len(tokens)
            tokens.append(int(forced[step]) if forced is not None else int(row.argmax()))
            return tokens[-1]

        names = ["logits", *self._kv.presents]  # the order outputs are bound in
        start = time.perf_counter()
        binding = self._prefill.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([prompt], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", mask[:, :n])
        binding.bind_cpu_input("position_ids", np.arange(n, dtype=np.int64)[None, :])
        binding.bind_output("logits", "cpu")
        for name in self._kv.presents:
            binding.bind_output(name, "cpu")
        self._prefill.run_with_iobinding(binding)
        outputs = dict(zip(names, binding.get_outputs(), strict=True))
        token = take(outputs["logits"].numpy())
        self._kv.start(outputs, capacity=n + max_new_tokens)
        prefill_s = time.perf_counter() - start

        start = time.perf_counter()
        binding = self._decode.io_binding()
        binding.bind_ortvalue_output("logits", logits_out)
        for step in range(1, max_new_tokens):
            if stop_at_eos and token == self.eos:
                break
            total = n + step
            binding.bind_cpu_input("input_ids", np.asarray([[token]], dtype=np.int64))
            binding.bind_cpu_input("attention_mask", mask[:, :total])
            binding.bind_cpu_input("position_ids", np.asarray([[total - 1]], dtype=np.int64))
            self._kv.bind(binding, outputs)
            self._decode.run_with_iobinding(binding)
            outputs = dict(zip(names, binding.get_outputs(), strict=True))
            token = take(logits_out.numpy())
        decode_s = time.perf_counter() - start
        return Generation(tuple(prompt), tuple(tokens), prefill_s, decode_s, np.stack(kept) if keep_logits else None)


def load_tokenizer(directory: Path, manifest: dict[str, Any]) -> Any:
    """The export's tokenizer (``manifest['tokenizer']``), or a GenerateError saying to pass ids."""
    from tokenizers import Tokenizer

    rel = manifest.get("tokenizer")
    if not rel or not (directory / rel).is_file():
        raise GenerateError(f"{directory}: the export has no tokenizer.json (its checkpoint had none); pass token ids with --ids")
    return Tokenizer.from_file(str(directory / rel))


def parse_ids(text: str) -> list[int]:
    """``"1,2, 3"`` -> ``[1, 2, 3]``; a GenerateError on anything else."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise GenerateError(f"--ids: expected comma-separated integers, found {text!r}") from None
    if not ids:
        raise GenerateError("--ids is empty: give at least one token id")
    return ids
