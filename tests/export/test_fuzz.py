"""Fuzzed inputs (issue 25): configs, safetensors headers and manifests drawn by hypothesis (the
same examples every run by default; fresh ones with ``--hypothesis-profile explore``: conftest.py),
and a deterministic sweep of every field of each JSON input kiln reads (issue 38): manifest.json,
a native and a Hugging Face config.json, model.safetensors.index.json, genai_config.json (kiln
bench) and adapter_config.json (kiln adapter), each field set to another type and to an
out-of-range value of its own.

Each example must end in success or in one ``KilnError`` (the CLI: exit 1 and one line), never
in another exception, within a bounded time, and the whole run within bounded memory; no file
of a sentinel folder the fuzzed paths point at is opened by Python code or changed. (Files that
C++ code opens, ONNX Runtime's external data, are covered by ``kiln verify``'s checks, which
every command runs before a graph is loaded: ``test_tampered.py``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import resource
import shutil
import signal
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.cli import main
from kiln.errors import KilnError
from kiln.exporter.artifacts.hashing import hash_tree
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln.plugins import load_model
from kiln_testing import tiny_config, write_checkpoint

SECONDS = 20.0  # the longest one example may take (the allocator tracebacks took 8-86 s)
GROWTH = 2 << 30  # the most the run may raise this process's peak memory


@contextlib.contextmanager
def _watching(sentinel: Path) -> Iterator[list[str]]:
    """Python-level opens of anything under ``sentinel`` while the block runs (an audit hook
    cannot be removed: it stays, inert, once the block is done)."""
    opened: list[str] = []
    active = [True]
    root = str(sentinel.resolve())

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event == "open" and args and isinstance(args[0], (str, bytes, Path)):
            path = str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode(errors="replace")).resolve())
            if path.startswith(root):
                opened.append(path)

    sys.addaudithook(hook)
    try:
        yield opened
    finally:
        active[0] = False


def _sentinel(root: Path) -> Path:
    folder = root / "secret"
    folder.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "weights.bin", "model.safetensors", "config.json"):
        (folder / name).write_text('{"secret": true}')
    return folder


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- configs and safetensors headers ---------------------------------------------------------

_INTS = st.one_of(
    st.sampled_from([0, -2, 10**6, 10**7, 10**9, 10**400, 2**31]), st.integers(1, 64)
)  # the extremes first: hypothesis favours earlier branches
_VALUES = st.one_of(_INTS, st.sampled_from(["64", "", None, 1.5, True, [], {}]))
_NATIVE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_context")
_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
)


def _safetensors(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@st.composite
def _header(draw: st.DrawFn, names: list[str]) -> bytes:
    """A safetensors file whose header may lie: shapes, dtypes and offsets drawn apart from the data."""
    if draw(st.booleans()) and draw(st.booleans()):
        return draw(st.binary(max_size=64))  # not a safetensors file at all
    header: dict[str, Any] = {}
    offset = 0
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        shape = draw(
            st.lists(st.one_of(st.integers(1, 8), st.sampled_from([0, -1, 10**9, 10**12])), min_size=1, max_size=3)
        )
        size = draw(st.sampled_from([0, 4, 16, 64]))
        header[name] = {
            "dtype": draw(st.sampled_from(["F32", "BF16", "F16", "I64", "XX"])),
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    return _safetensors(header, bytes(draw(st.sampled_from([offset, max(0, offset - 4), offset + 4]))))


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail (``TimeoutError`` in the main thread) when the block runs past ``seconds``: a hang
    or a slow allocation is a finding, not a stuck test run. The alarm repeats every second:
    library code that swallows one exception (an ``except Exception`` in a ``__getattr__``)
    meets the next."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the example ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _load_outcome(ckpt: Path) -> None:
    """Load the checkpoint: success or one KilnError, within ``SECONDS``."""
    with _deadline(SECONDS):
        try:
            load_model(ckpt)
        except KilnError as exc:
            assert "\n" not in str(exc), str(exc)


def _checkpoint(root: Path, config: dict[str, Any], weights: bytes) -> Path:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(weights)
    return root


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_native_configs_and_headers(tmp_path: Path, data: st.DataObject) -> None:
    base = tiny_config()
    config = json.loads((write_checkpoint(tmp_path / "valid", base) / "config.json").read_text())
    for field in data.draw(st.lists(st.sampled_from(_NATIVE_FIELDS), max_size=3, unique=True)):
        config[field] = data.draw(_VALUES)
    names = ["embed.weight", "layers.0.attn.q_proj.weight", "lm_head.weight", "layers.0.ple.table.weight"]
    valid = (tmp_path / "valid" / "model.safetensors").read_bytes()
    weights = (
        valid if data.draw(st.booleans(), label="the real weights") else data.draw(_header(names))
    )  # a lying config is the common case
    peak = _peak()
    _load_outcome(_checkpoint(tmp_path / "ckpt", config, weights))
    assert _peak() - peak < GROWTH


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_hf_configs_and_headers(tmp_path: Path, data: st.DataObject) -> None:
    pytest.importorskip(
        "transformers", reason="Hugging Face checkpoints load through transformers (pip install 'kiln[hf]')"
    )
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 32,
        "max_position_embeddings": 32,
    }
    for field in data.draw(st.lists(st.sampled_from(_HF_FIELDS), max_size=3, unique=True)):
        config[field] = data.draw(_VALUES)
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ]
    peak = _peak()
    _load_outcome(_checkpoint(tmp_path / "ckpt", config, data.draw(_header(names))))
    assert _peak() - peak < GROWTH


# --- manifests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    out = root / "export"
    export(write_checkpoint(root / "ckpt", tiny_config()), out, ExportOptions.from_flags(max_batch=2, parity_tokens=2))
    return out


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path into a JSON value (``files`` entries aside: hashes are made true again)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if prefix == () and key == "files":
                continue
            yield prefix + (key,)
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield prefix + (i,)
            yield from _paths(item, prefix + (i,))


def _replace(data: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _manifest_values(sentinel: Path) -> st.SearchStrategy[Any]:
    outside = [
        str(sentinel / "tokenizer.json"),
        "../secret/tokenizer.json",
        "../../secret/weights.bin",
        "onnx/../../secret/config.json",
        "/etc/passwd",
        "",
    ]
    return st.one_of(
        _VALUES,
        st.sampled_from(outside),
        st.sampled_from([-1, 10**12, float("nan"), "onnx/decode.onnx", "onnx/prefill.onnx"]),
    )


def _one_line_or_success(result: Any) -> None:
    """Exit 0, or exit 1 with one ``error:`` line on stderr (or, from kiln verify, its listing of
    the differences on stdout and nothing on stderr)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code != 0:
        lines = result.stderr.strip().splitlines()
        listing = not lines and " differences from manifest.json:" in result.stdout.splitlines()[0]
        assert result.exit_code == 1 and (listing or (len(lines) == 1 and lines[0].startswith("error: "))), (
            result.stdout,
            result.stderr,
        )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_manifests(pristine: Path, tmp_path: Path, data: st.DataObject) -> None:
    sentinel = _sentinel(tmp_path)
    before = _digest(sentinel)
    directory = tmp_path / "export"
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(pristine, directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    paths = list(_paths(manifest))
    for _ in range(data.draw(st.integers(1, 3))):
        _replace(manifest, data.draw(st.sampled_from(paths)), data.draw(_manifest_values(sentinel)))
        paths = list(_paths(manifest))
    manifest["files"] = hash_tree(directory, exclude=("manifest.json",))
    (directory / "manifest.json").write_text(json.dumps(manifest))
    peak = _peak()
    with _watching(sentinel) as opened, _deadline(3 * SECONDS):
        for args in (
            ["verify", str(directory)],
            ["generate", str(directory), "--ids", "1,2", "--max-new-tokens", "2"],
            ["triton", str(directory), "--name", "fuzz"],
        ):
            _one_line_or_success(CliRunner().invoke(main, args))
    assert opened == [] and _digest(sentinel) == before
    assert _peak() - peak < GROWTH


# --- every manifest field, each mutated (a deterministic sweep beside the random draws above) ---


# Fields kiln records for people and for provenance, which neither change how the export runs nor
# how it is judged, so kiln verify takes any value of them: the tools' versions, the source
# checkpoint's own config and where it was, the family's name, the token ids a host stops or pads by
# (any id is a claim no graph contradicts), the trained PLE rows (the tables the graphs hold are
# checked), the tensor count (the weights file's bytes and hash are), an encoder's width (its
# graphs check their inputs at run time: kiln generate refuses in one line), the quality record (kiln
# check measures quality again; its threshold is the export's --quality-gate, a choice any user makes,
# and it judges the quantization, never the proof).
DESCRIPTIVE = {
    "tools",
    "config",
    "family",
    "checkpoint.reference",
    "checkpoint.resolved",
    "model.bos_token_id",
    "model.eos_token_id",
    "model.pad_token_id",
    "model.decoder_start_token_id",
    "model.encoder_dim",
    "export.ple.trained_rows",
    "weights.tensors",
    "parity.quality",
}


def _descriptive(path: tuple[Any, ...]) -> bool:
    """Whether the field at ``path`` is one of DESCRIPTIVE's or inside one."""
    return any(".".join(map(str, path[:n])) in DESCRIPTIVE for n in range(1, len(path) + 1))


def _field_paths(manifest: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every key path of the manifest (``files`` aside), a list's first element standing for the rest
    (every graph's every input reads the same code)."""
    return [path for path in _paths(manifest) if all(not isinstance(key, int) or key == 0 for key in path)]


def _mutations(value: Any) -> list[Any]:
    """A value of another JSON type, and one of the same type that is out of any range or set."""
    if isinstance(value, bool):
        return ["yes", None]
    if isinstance(value, int):
        return ["64", -(10**12)]
    if isinstance(value, float):
        return [None, float("inf")]
    if isinstance(value, str):
        return [12345, "../../" + value if value else "bogus"]
    if isinstance(value, list):
        return [{}, value[:0] if value else [None]]
    if isinstance(value, dict):
        return [[], {}]
    return ["bogus", 7]


def test_every_manifest_field_mutated_ends_in_one_line(pristine: Path, tmp_path: Path) -> None:
    """Issue 38: each field of a real manifest, set to another type and to an out-of-range value of its
    own type (hashes made true again, so only the claim differs), through kiln verify, generate and check:
    success or one line, never a traceback, never a file opened or changed outside the export."""
    sentinel = _sentinel(tmp_path)
    before = _digest(sentinel)
    original = json.loads((pristine / "manifest.json").read_text())
    directory = tmp_path / "export"
    shutil.copytree(pristine, directory)
    cases = refused = 0
    broken: list[str] = []
    accepted: list[str] = []
    with _watching(sentinel) as opened:
        for path in _field_paths(original):
            for value in _mutations(_value_at(original, path)):
                manifest = json.loads(json.dumps(original))
                _replace(manifest, path, value)
                manifest["files"] = hash_tree(directory, exclude=("manifest.json",))
                (directory / "manifest.json").write_text(json.dumps(manifest))
                results = [
                    CliRunner().invoke(main, args)
                    for args in (
                        ["verify", str(directory)],
                        ["generate", str(directory), "--ids", "1,2", "--max-new-tokens", "2"],
                    )
                ]
                for result in results:
                    try:
                        _one_line_or_success(result)
                    except AssertionError as exc:
                        broken.append(f"{'.'.join(map(str, path))} = {value!r}: {str(exc).splitlines()[0][:300]}")
                cases, refused = cases + 1, refused + (results[0].exit_code != 0)
                if results[0].exit_code == 0 and not _descriptive(path):
                    accepted.append(f"{'.'.join(map(str, path))} = {value!r}")
    assert broken == []
    assert accepted == []  # every field but the descriptive ones is checked against the files
    assert opened == [] and _digest(sentinel) == before
    assert cases >= 250 and refused >= 180, (cases, refused)  # the sweep's size when written: a smaller one checks less


def _value_at(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


# --- every field of the other JSON inputs, each mutated (the same sweep, input by input) ------


def _sweep(original: dict[str, Any], attempt: Any) -> tuple[int, int, list[str]]:
    """Each field of ``original`` (``_field_paths``), set to each of ``_mutations``, handed to
    ``attempt`` (which writes it, runs kiln, asserts success or one line and returns whether kiln
    refused it): the cases, the refusals, and what broke the promise."""
    cases = refused = 0
    broken: list[str] = []
    for path in _field_paths(original):
        for value in _mutations(_value_at(original, path)):
            data = json.loads(json.dumps(original))
            _replace(data, path, value)
            try:
                refused += bool(attempt(data))
            except (
                Exception
            ) as exc:  # an assertion, a deadline, or an exception that is not a KilnError: each a finding
                first = str(exc).splitlines()[0][:300] if str(exc) else ""
                broken.append(f"{'.'.join(map(str, path))} = {value!r}: {type(exc).__name__}: {first}")
            cases += 1
    return cases, refused, broken


def _cli(args: list[str]) -> bool:
    """``kiln ARGS`` in this process within ``SECONDS``: success or one line (``_one_line_or_success``); True when
    refused."""
    with _deadline(SECONDS):
        result = CliRunner().invoke(main, args)
    _one_line_or_success(result)
    return result.exit_code != 0


def _loads_or_refuses(ckpt: Path, weights: bytes) -> Callable[[dict[str, Any]], bool]:
    """A sweep's attempt on a config.json: the checkpoint at ``ckpt`` with ``weights`` loads (False)
    or is refused in one KilnError line (True); anything else fails the test."""

    def attempt(config: dict[str, Any]) -> bool:
        written = _checkpoint(ckpt, config, weights)
        with _deadline(SECONDS):
            try:
                load_model(written)
            except KilnError as exc:
                assert "\n" not in str(exc), str(exc)
                return True
        return False

    return attempt


def test_every_config_field_mutated_ends_in_one_line(tmp_path: Path) -> None:
    """Issue 38: each field of a native config.json (PLE's too), each mutated, loads or is one KilnError."""
    original = json.loads((write_checkpoint(tmp_path / "valid", tiny_config()) / "config.json").read_text())
    weights = (tmp_path / "valid" / "model.safetensors").read_bytes()

    cases, refused, broken = _sweep(original, _loads_or_refuses(tmp_path / "ckpt", weights))
    assert broken == []
    assert cases >= 50 and refused >= 40, (cases, refused)  # the sweep's size when written (52, 48)


def test_every_hf_config_field_mutated_ends_in_one_line(tmp_path: Path) -> None:
    """The same for a Hugging Face config.json as transformers saves it (every field it writes)."""
    pytest.importorskip(
        "transformers", reason="Hugging Face checkpoints load through transformers (pip install 'kiln[hf]')"
    )
    from kiln_testing import save_base

    valid = save_base("llama", tmp_path / "valid")
    original = json.loads((valid / "config.json").read_text())
    weights = (valid / "model.safetensors").read_bytes()

    cases, refused, broken = _sweep(original, _loads_or_refuses(tmp_path / "ckpt", weights))
    assert broken == []
    assert cases >= 50 and refused >= 40, (cases, refused)  # (56, 48)


def test_every_shard_index_field_mutated_ends_in_one_line(tmp_path: Path) -> None:
    """``model.safetensors.index.json`` of a sharded Hugging Face checkpoint (its total size, every
    tensor's shard), each field mutated: loads or is one KilnError."""
    pytest.importorskip(
        "transformers", reason="Hugging Face checkpoints load through transformers (pip install 'kiln[hf]')"
    )
    from kiln.plugins.hf import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("llama", seed=1).module.model.save_pretrained(ckpt, safe_serialization=True, max_shard_size="20KB")
    index = ckpt / "model.safetensors.index.json"
    original = json.loads(index.read_text())
    assert len(set(original["weight_map"].values())) > 1, "not sharded"

    def attempt(data: dict[str, Any]) -> bool:
        index.write_text(json.dumps(data))
        with _deadline(SECONDS):
            try:
                load_model(ckpt)
            except KilnError as exc:
                assert "\n" not in str(exc), str(exc)
                return True
        return False

    cases, refused, broken = _sweep(original, attempt)
    assert broken == []
    assert cases >= 45 and refused >= 40, (cases, refused)  # (50, 45)


def test_every_genai_config_field_mutated_ends_in_one_line(pristine: Path, tmp_path: Path) -> None:
    """Issue 38, item 6: ``genai_config.json`` (an export's ``onnx/``, as ONNX Runtime GenAI's builder
    writes one), each field mutated, through ``kiln bench`` of that directory: success or one line."""
    directory = Path(shutil.copytree(pristine / "onnx", tmp_path / "genai"))
    original = json.loads((directory / "genai_config.json").read_text())
    args = ["bench", str(directory), "--no-torch", "--runs", "3", "--prefill-seq", "2", "--past", "2"]

    def attempt(config: dict[str, Any]) -> bool:
        (directory / "genai_config.json").write_text(json.dumps(config))
        return _cli(args)

    assert not attempt(original)  # the unmutated directory is timed
    cases, refused, broken = _sweep(original, attempt)
    assert broken == []
    assert cases >= 75 and refused >= 15, (cases, refused)  # (78, 15)


@pytest.fixture(scope="module")
def slots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A PEFT adapter and a tiny Llama exported with LoRA slots for it (kiln adapter's inputs)."""
    pytest.importorskip("peft", reason="adapters are PEFT's (pip install -e .[hf])")
    from kiln_testing import make_adapter, save_base

    root = tmp_path_factory.mktemp("fuzz-adapter")
    ckpt = save_base("llama", root / "ckpt")
    export(ckpt, root / "slots", ExportOptions.from_flags(max_batch=1, parity_tokens=2, lora_slots=4))
    return make_adapter(ckpt, root / "peft", ["q_proj", "v_proj"], seed=2), root / "slots"


def test_every_adapter_config_field_mutated_ends_in_one_line(slots: tuple[Path, Path], tmp_path: Path) -> None:
    """Issue 38: ``adapter_config.json``, each field mutated, through ``kiln adapter --no-check`` (its
    reader, ``plugins.hf.adapter.read_adapter``, is ``kiln export --adapter``'s too): success or one
    line; the export it reads unchanged."""
    peft_dir, exported = slots
    adapter = Path(shutil.copytree(peft_dir, tmp_path / "peft"))
    original = json.loads((adapter / "adapter_config.json").read_text())
    before = hash_tree(exported)
    args = [
        "adapter",
        str(adapter),
        "--export",
        str(exported),
        "--no-check",
        "--out",
        str(tmp_path / "a.onnx_adapter"),
        "--force",
    ]

    def attempt(config: dict[str, Any]) -> bool:
        (adapter / "adapter_config.json").write_text(json.dumps(config))
        return _cli(args)

    assert not attempt(original)
    cases, refused, broken = _sweep(original, attempt)
    assert broken == []
    assert hash_tree(exported) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx_adapter", "peft"]
    assert cases >= 85 and refused >= 30, (cases, refused)  # (88, 33)
