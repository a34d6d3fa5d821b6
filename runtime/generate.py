"""``kiln generate``: text generation through an export's prefill and decode graphs on ONNX
Runtime, with IOBinding so the KV cache never goes through numpy between steps. Tokens are
greedy by default; ``runtime.sampling`` picks them otherwise (the ``choose`` of ``Generator.run``).

The steps are the contract's step loop (``exporter.contract.steps``, the one parity and
calibration run) over IOBinding sessions: each step's ``present.*`` outputs stay OrtValues and
are bound as the next step's ``past_*`` inputs; logits are the only output copied out (to
choose the next token). What this does NOT avoid: kiln's portable decode graph
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import GenerateError
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.artifacts.verify import require_verified
from kiln.exporter.contract.io import ENCODER_MASK, ENCODER_STATES, GraphKind
from kiln.exporter.contract.steps import Chooser, encoder_decoder_feeds, prompt_feeds, run_steps
from kiln.inputs import TOKENIZER_MAX_BYTES, read_input
from kiln.runtime.features import features_input, read_features, refuse_mismatch, speech_feeds
from kiln.runtime.kv_strategies import ConcatKv, KvStrategy, SharedKv, StaticKv, kv_strategy
from kiln.runtime.sampling import Sampler, SamplingOptions
from kiln.runtime.text import TextStream

__all__ = [
    "ConcatKv",
    "GenerateOptions",
    "Generation",
    "generate_command",
    "Generator",
    "KvStrategy",
    "SharedKv",
    "StaticKv",
    "find_tokenizer",
    "load_tokenizer",
    "parse_ids",
]


@dataclasses.dataclass(frozen=True)
class Generation:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # new tokens, as chosen (greedy by default) or forced
    prefill_s: float  # the prompt's forward pass and first token
    decode_s: float  # all decode steps together
    logits: np.ndarray | None = None  # [steps, vocab] float32, with keep_logits
    finish_reason: str = "length"  # "eos" (the end token came), "stop" (on_token said so) or "length"

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1  # the first new token comes from the prefill
        return steps / self.decode_s if steps and self.decode_s > 0 else 0.0


class Generator:
    """The prefill and decode sessions of one verified kiln export directory, batch 1."""

    def __init__(
        self, directory: Path, threads: int = 2, target: str | None = None, adapter: Path | None = None
    ) -> None:
        from kiln.exporter.runners import ort_session

        manifest = require_verified(directory)
        self._adapter = _adapter_values(manifest, adapter) if adapter is not None else {}
        ple = manifest.export.ple
        if ple is not None and ple.tables == "input":
            raise GenerateError(
                f"{directory}: exported with --ple-tables input; kiln generate runs graphs with the tables as constants"
            )
        if manifest.model.encoder_dim is not None and not manifest.model.has_encoder:
            raise GenerateError(
                f"{directory}: a cross-attention decoder needs its encoder's output (encoder_hidden_states); "
                "kiln generate has no encoder to run"
            )
        files = {kind: manifest.graph(kind).file for kind in (GraphKind.PREFILL, GraphKind.DECODE)}
        if target is not None:
            targets = manifest.targets or {}
            if target not in targets:
                raise GenerateError(f"{directory}: has no --target {target} graphs; export it with --target {target}")
            files = {kind: targets[target].graphs[kind.value].file for kind in files}
        kv = kv_strategy(manifest, target)
        self.directory = directory
        self.manifest = manifest
        self.max_context = manifest.limits.max_context
        self.eos = manifest.model.eos_token_id
        self._prefill = ort_session(directory / files[GraphKind.PREFILL], threads=threads, spinning=False)
        self._decode = ort_session(directory / files[GraphKind.DECODE], threads=threads, spinning=False)
        _check_slots(self._prefill, self._decode, self._adapter, target)
        # an encoder-decoder: the prompt is the encoder's input; the decoder starts from its start token
        self._encoder = (
            self._encoder_session(directory, manifest, threads, target) if manifest.model.has_encoder else None
        )
        self.features = features_input(manifest)  # a speech encoder's input (--features), else None
        self._kv = kv
        self.kv_cache = (
            "static-buffer" if isinstance(kv, StaticKv) else "shared-buffer" if isinstance(kv, SharedKv) else "concat"
        )  # how each step's cache is written
        self._vocab = manifest.model.vocab_size

    def run(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        stop_at_eos: bool = True,
        forced: Sequence[int] | None = None,
        keep_logits: bool = False,
        choose: Chooser | None = None,
        on_token: Callable[[int], bool] | None = None,
        features: np.ndarray | None = None,
    ) -> Generation:
        """Up to ``max_new_tokens`` tokens after ``prompt``, each picked by ``choose`` (default:
        greedy; ``forced`` tokens instead, for teacher-forced parity). ``on_token`` sees every new
        token as it comes and ends the generation by returning True (a stop string). A speech
        encoder-decoder's encoder reads ``features`` (``runtime.features``) and ``prompt`` is its
        decoder's prefix."""
        if (features is None) != (self.features is None):
            raise GenerateError(
                f"{self.directory}: log-mel features are {'needed' if features is None else 'not taken'} here"
            )
        self._check(prompt, max_new_tokens)
        steps = _BoundSteps(
            self._prefill,
            self._decode,
            self._kv,
            self._vocab,
            capacity=len(prompt) + max_new_tokens,
            adapter=self._adapter,
        )
        pick: Chooser = (lambda step, logits: np.array([forced[step]])) if forced is not None else choose or _greedy
        tokens: list[int] = []
        kept: list[np.ndarray] = []
        start = time.perf_counter()
        prefill_s, reason = 0.0, "length"
        first = self._first_feeds(prompt) if features is None else speech_feeds(self._encoder, features, list(prompt))
        for step in run_steps(steps, self._kv.pairs, first, max_new_tokens, pick):
            if step.index == 0:
                prefill_s = time.perf_counter() - start
                start = time.perf_counter()
            tokens.append(int(step.tokens[0]))
            if keep_logits:
                kept.append(step.logits[0])
            if on_token is not None and on_token(tokens[-1]):
                reason = "stop"
            elif stop_at_eos and tokens[-1] == self.eos:
                reason = "eos"
            if reason != "length":
                break
        decode_s = time.perf_counter() - start
        return Generation(
            tuple(prompt), tuple(tokens), prefill_s, decode_s, np.stack(kept) if keep_logits else None, reason
        )

    @staticmethod
    def _encoder_session(directory: Path, manifest: Manifest, threads: int, target: str | None) -> Any:
        """The encoder graph's session: ``target``'s own encoder graph where it wrote one."""
        from kiln.exporter.runners import ort_session

        entry = manifest.graphs.get(GraphKind.ENCODER.value)
        if entry is None or manifest.model.decoder_start_token_id is None:
            raise GenerateError(
                f"{directory}: the manifest says encoder-decoder but has no encoder graph or decoder start "
                "token; re-export it"
            )
        written = (manifest.targets or {}).get(target) if target is not None else None
        own = written.graphs.get(GraphKind.ENCODER.value) if written is not None else None
        return ort_session(directory / (own.file if own is not None else entry.file), threads=threads, spinning=False)

    @property
    def history_start(self) -> list[int] | None:
        """An encoder-decoder's decoder history begins at its start token (what a repetition
        penalty counts), not at the prompt, which is the encoder's input; None otherwise."""
        start = self.manifest.model.decoder_start_token_id
        speech = self.features is not None  # its prompt is the decoder's own prefix
        return [start] if self._encoder is not None and start is not None and not speech else None

    def _first_feeds(self, prompt: Sequence[int]) -> dict[str, Any]:
        if self._encoder is None:
            return prompt_feeds([list(prompt)], 0)
        start = self.manifest.model.decoder_start_token_id
        assert start is not None, "checked when the encoder session opened"
        encoder = self._encoder

        def encode(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            (states,) = encoder.run([ENCODER_STATES], {"input_ids": ids, "attention_mask": mask})
            return np.asarray(states)

        return encoder_decoder_feeds(encode, [list(prompt)], start, self.manifest.model.pad_token_id or 0)

    def _check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        if not prompt:
            raise GenerateError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens must be at least 1, found {max_new_tokens}")
        if self._encoder is not None and self.features is None:  # encoder ids and decoder output: a limit each
            longest = max(len(prompt), max_new_tokens)
            if longest > self.max_context:
                raise GenerateError(
                    f"the encoder's input ({len(prompt)} tokens) or the {max_new_tokens} new tokens exceed the "
                    f"export's context limit {self.max_context}"
                )
        elif len(prompt) + max_new_tokens - 1 > self.max_context:
            raise GenerateError(
                f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed the export's context limit "
                f"{self.max_context}"
            )
        if any(not 0 <= t < self._vocab for t in prompt):
            raise GenerateError(
                f"token ids must be in [0, {self._vocab}); found {[t for t in prompt if not 0 <= t < self._vocab][:5]}"
            )


class _BoundSteps:
    """An export's prefill and decode sessions as the step loop's runner, through IOBinding: the
    caches stay OrtValues between steps (bound by the ``KvStrategy``), the decode step's logits
    land in one preallocated buffer, and only the logits are read into numpy."""

    def __init__(
        self, prefill: Any, decode: Any, kv: KvStrategy, vocab: int, capacity: int, adapter: dict[str, Any]
    ) -> None:
        from onnxruntime import OrtValue

        self._adapter = adapter  # an adapter file's OrtValues by slot input (--adapter), bound to every run
        self._prefill, self._kv, self._capacity = prefill, kv, capacity
        self._names = ["logits", *kv.presents]  # the order prefill's outputs are bound in
        self._step_names = ["logits", *kv.step_presents]  # and decode's
        self._decode = decode.io_binding()
        for name, value in adapter.items():
            self._decode.bind_ortvalue_input(name, value)
        self._decode.bind_ortvalue_output("logits", OrtValue.ortvalue_from_shape_and_type([1, 1, vocab], np.float32))
        self._session = decode

    def run(self, kind: GraphKind, feeds: dict[str, Any]) -> dict[str, Any]:
        if kind is GraphKind.PREFILL:
            binding = self._prefill.io_binding()
            for name, value in self._adapter.items():
                binding.bind_ortvalue_input(name, value)
            binding.bind_output("logits", "cpu")
            if isinstance(self._kv, StaticKv):  # the prompt writes into the buffers too
                self._kv.bind_prompt(binding)
            else:
                for name in self._names[1:]:
                    binding.bind_output(name, "cpu")
        else:
            binding = self._decode
            self._kv.bind(binding, feeds)
        for name in ("input_ids", "attention_mask", "position_ids", ENCODER_MASK, ENCODER_STATES):
            if name in feeds and (name != ENCODER_STATES or kind is GraphKind.PREFILL):
                binding.bind_cpu_input(name, feeds[name])
        (self._prefill if kind is GraphKind.PREFILL else self._session).run_with_iobinding(binding)
        outputs = dict(
            zip(self._names if kind is GraphKind.PREFILL else self._step_names, binding.get_outputs(), strict=True)
        )
        if kind is GraphKind.PREFILL:
            self._kv.start(outputs, capacity=self._capacity)
        return outputs


def _check_slots(prefill: Any, decode: Any, adapter: dict[str, Any], target: str | None) -> None:
    """Every tensor of the adapter is a slot input of both graphs: the portable graphs of a
    ``--lora-slots`` export have them, and so do its ``--target ort`` graphs (they keep the
    portable graphs' slots); a target's graphs without them are refused by name."""
    for session in (prefill, decode):
        names = {
            i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())
        }  # a slot is the latter
        if missing := sorted(set(adapter) - names):
            raise GenerateError(
                f"--adapter with --target {target or 'portable'}: its graphs have no LoRA slot input "
                f"{missing[0]} (and {len(missing) - 1} more)"
            )


def _adapter_values(manifest: Manifest, adapter: Path) -> dict[str, Any]:
    """The adapter file's tensors as OrtValues by slot input, once the file is checked against the
    export's slots. They are bound as inputs: ONNX Runtime (1.32) ignores ``RunOptions``' active
    adapters in ``run_with_iobinding`` (it warns "won't have an effect"); GenAI's ``og.Adapters``
    goes through ``Run``, where they apply."""
    import onnxruntime as ort

    from kiln.errors import ConfigError
    from kiln.exporter.lora.adapter_file import read_adapter_file

    try:
        tensors = read_adapter_file(adapter, manifest.lora, f"--adapter {adapter}")
    except ConfigError as exc:
        raise GenerateError(str(exc)) from None
    return {
        name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in tensors.items()
    }  # each OrtValue keeps its array alive


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """``kiln generate``'s options besides the prompt."""

    max_new_tokens: int = 32
    stop_at_eos: bool = True
    stops: tuple[str, ...] = ()  # --stop: the text ends before the first of these
    sampling: SamplingOptions = SamplingOptions()  # greedy by default
    target: str | None = None  # "ort": the export's --target ort graphs
    threads: int = 2
    adapter: Path | None = None  # --adapter FILE: kiln adapter's file, active for the whole generation

    def __post_init__(self) -> None:
        if any(not s for s in self.stops):
            raise GenerateError("--stop is empty: give the text that ends the generation")


def _decoder_start(manifest: Manifest, directory: Path) -> list[int]:
    """A speech encoder-decoder's decoder prefix when ``--ids`` gives none: its start token."""
    start = manifest.model.decoder_start_token_id
    if start is None:
        raise GenerateError(
            f"{directory}: the manifest names no decoder_start_token_id; give the decoder's prefix with --ids"
        )
    return [start]


def generate_command(
    directory: Path,
    prompt: str | None,
    ids: str | None,
    options: GenerateOptions,
    on_text: Callable[[str], None] | None = None,
    features: Path | None = None,
) -> dict[str, Any]:
    """``kiln generate``: continue ``prompt`` (text, tokenized with the export's tokenizer) or
    ``ids`` ("1,2,3"); ``on_text`` gets the new text as it comes (token ids, space-separated,
    when the export has no tokenizer). Returns the JSON summary (``text`` decoded whenever the
    export has a tokenizer, with --ids too). ``features``: a speech encoder-decoder's log-mel
    input (``runtime.features``), its decoder's prefix ``ids`` or its start token."""
    if features is None and (prompt is None) == (ids is None):
        raise GenerateError("give exactly one of --prompt TEXT or --ids 1,2,3")
    generator = Generator(directory, options.threads, target=options.target, adapter=options.adapter)
    tokenizer = find_tokenizer(directory, generator.manifest)
    refuse_mismatch(directory, generator.features is not None, features, prompt)
    array = read_features(features, generator.features) if features is not None and generator.features else None
    if array is not None:
        prompt_ids = parse_ids(ids) if ids is not None else _decoder_start(generator.manifest, directory)
    elif prompt is not None:
        if not prompt.strip():
            raise GenerateError("the prompt is empty: give some text")
        prompt_ids = load_tokenizer(directory, generator.manifest).encode(prompt).ids
    else:
        assert ids is not None  # exactly one of the two, checked above
        prompt_ids = parse_ids(ids)
    if options.stops and tokenizer is None:
        raise GenerateError(
            f"{directory}: --stop needs the export's tokenizer.json to find the text, and the export has none"
        )
    stream = TextStream(tokenizer, options.stops) if tokenizer is not None else None
    count = [0]

    def on_token(token: int) -> bool:
        piece = stream.add(token) if stream is not None else f"{' ' if count[0] else ''}{token}"
        count[0] += 1
        if on_text is not None and piece:
            on_text(piece)
        return stream is not None and stream.stopped

    sampler = Sampler(options.sampling, generator.history_start or prompt_ids)
    result = generator.run(
        prompt_ids,
        options.max_new_tokens,
        stop_at_eos=options.stop_at_eos,
        choose=sampler.choose,
        on_token=on_token,
        features=array,
    )
    if stream is not None and on_text is not None and (rest := stream.rest()):
        on_text(rest)
    return {
        "prompt_ids": list(result.prompt),
        "tokens": list(result.tokens),
        "text": stream.text if stream is not None else None,
        "finish_reason": result.finish_reason,
        "sampling": options.sampling.to_dict(),
        "prefill_tokens_per_s": result.prefill_tokens_per_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "kv_cache": generator.kv_cache,
    }


def _greedy(step: int, logits: np.ndarray) -> np.ndarray:
    tokens: np.ndarray = logits.argmax(-1)
    return tokens


def find_tokenizer(directory: Path, manifest: Manifest) -> Any | None:
    """The export's tokenizer (``manifest.tokenizer``), or None when it has none."""
    from tokenizers import Tokenizer

    rel = manifest.tokenizer
    if not rel or not (directory / rel).exists():
        return None
    text = read_input(
        directory / rel, GenerateError, TOKENIZER_MAX_BYTES, what="a tokenizer.json"
    )  # no FIFO, no device
    return Tokenizer.from_str(text.decode("utf-8"))


def load_tokenizer(directory: Path, manifest: Manifest) -> Any:
    """The export's tokenizer, or a GenerateError saying to pass ids."""
    tokenizer = find_tokenizer(directory, manifest)
    if tokenizer is None:
        raise GenerateError(
            f"{directory}: the export has no tokenizer.json (its checkpoint had none); pass token ids with --ids"
        )
    return tokenizer


def parse_ids(text: str) -> list[int]:
    """``"1,2, 3"`` -> ``[1, 2, 3]``; a GenerateError on anything else."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise GenerateError(f"--ids: expected comma-separated integers, found {text!r}") from None
    if not ids:
        raise GenerateError("--ids is empty: give at least one token id")
    return ids
