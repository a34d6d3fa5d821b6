"""Calibration without a model: the data readers (``calibration.data``), the caches
(``calibration.cache``) and the range methods on a tiny MatMul graph (``calibration.methods``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

import kiln
from kiln import newfile
from kiln.calibration import Calibration
from kiln.calibration.cache import TRT_CACHE_VERSION, cache_key, read_cache, trt_calibration_cache, write_cache
from kiln.calibration.data import CHUNK, SYNTHETIC, CalibrationData, load_calibration_data
from kiln.calibration.methods import CalibMethod, collect_ranges, mse_threshold
from kiln.errors import CalibrationError
from kiln.plugins.native import spec_of
from kiln_testing import tiny_config

TOKENIZER = Path(kiln.__file__).parent / "demo" / "checkpoint" / "tokenizer.json"
VOCAB = 1024  # the demo tokenizer's
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 3


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def ids_of(text: str) -> list[int]:
    return list(Tokenizer.from_file(str(TOKENIZER)).encode(text).ids)


def load(
    source: str | Path, *, samples: int = 4, window: int = 8, vocab: int = VOCAB, tokenizer: Path | None = TOKENIZER
) -> CalibrationData:
    return load_calibration_data(str(source), tokenizer=tokenizer, vocab_size=vocab, samples=samples, window=window)


# ---------------------------------------------------------------- data


def test_text_file(tmp_path: Path) -> None:
    path = tmp_path / "calib.txt"
    path.write_text(TEXT)
    ids = ids_of(TEXT)
    assert len(ids) >= 4 * 8
    data = load(path)
    assert data.source == str(path)
    assert len(data.windows) == 4
    for i, window in enumerate(data.windows):
        assert window.dtype == np.int64 and window.tolist() == ids[i * 8 : (i + 1) * 8]
    assert data.sha256 == hashlib.sha256(np.array(ids[:32], dtype=np.int64).tobytes()).hexdigest()


def test_window_and_sample_counts(tmp_path: Path) -> None:
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(10, dtype=np.int64))
    assert [w.tolist() for w in load(path, samples=5, window=4).windows] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]  # 10 // 4 windows, the rest dropped
    assert [w.tolist() for w in load(path, samples=1, window=4).windows] == [[0, 1, 2, 3]]
    assert [w.tolist() for w in load(path, samples=3, window=128).windows] == [
        list(range(10))
    ]  # shorter data: one window of it all
    np.save(path, np.array([7, 9], dtype=np.int32))
    assert [w.tolist() for w in load(path).windows] == [[7, 9]]
    # the digest is of the ids used, so it changes with the windows taken
    assert load(path, samples=1, window=1).sha256 != load(path, samples=1, window=2).sha256


def test_text_needs_a_tokenizer_of_the_model(tmp_path: Path) -> None:
    path = tmp_path / "calib.txt"
    path.write_text(TEXT)
    with pytest.raises(
        CalibrationError,
        match=exact(
            f"calibration: {path}: text calibration data needs the checkpoint's tokenizer.json, and the "
            "checkpoint has none; pass token ids as .npy/.npz"
        ),
    ):
        load(path, tokenizer=None)
    with pytest.raises(
        CalibrationError,
        match=exact(
            f"calibration: {TOKENIZER}: the tokenizer has 1024 tokens but the model's vocabulary has 101: it "
            "does not belong to this checkpoint"
        ),
    ):
        load(path, vocab=101)


def test_text_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "calib.txt"
    path.write_bytes(b"\xff\xfe\x00abc\x80")
    with pytest.raises(
        CalibrationError,
        match=exact(f"calibration: {path}: not UTF-8 text; use .txt, .jsonl (field 'text'), .npy or .npz"),
    ):
        load(path)


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "calib.jsonl"
    records = ["def f(x):", "    return x * 2", "print(f(3))"]
    path.write_text(
        "\n".join(
            [json.dumps({"text": records[0], "id": 1}), "", "  ", *(json.dumps({"text": r}) for r in records[1:])]
        )
        + "\n"
    )
    data = load(path, samples=100, window=4)
    ids = ids_of("\n".join(records))  # records joined by newlines, blank lines skipped
    n = len(ids) // 4
    assert [w.tolist() for w in data.windows] == [ids[i * 4 : (i + 1) * 4] for i in range(n)]


def test_text_is_read_only_as_far_as_the_samples_need(tmp_path: Path) -> None:
    """A text file is tokenized a window of characters at a time until the samples have their
    tokens: the rest is never read (here it is not even UTF-8), and the windows are those of the
    whole text's tokenization (the windows split where the tokenizer starts a word)."""
    heldout = (TOKENIZER.parent / "heldout.txt").read_text()
    text = (heldout * (4 * CHUNK // len(heldout) + 1))[: 4 * CHUNK]
    path = tmp_path / "calib.txt"
    path.write_bytes(text.encode() + b"\xff\xfe" * 1000)
    ids = ids_of(text)
    data = load(path, samples=32, window=128)
    assert len(ids) > 32 * 128 and len(data.windows) == 32
    assert [w.tolist() for w in data.windows] == [ids[i * 128 : (i + 1) * 128] for i in range(32)]
    whole = tmp_path / "whole.txt"
    whole.write_text(text)
    everything = load(whole, samples=10**6, window=128)  # every chunk of it
    assert np.concatenate(everything.windows).tolist() == ids[: len(everything.windows) * 128]


def test_a_huge_one_line_text_costs_what_the_samples_need(tmp_path: Path) -> None:
    """A 20 MB text on one line: the samples' tokens in well under a second (it was tokenized
    whole: 78 s and 8.4 GiB for 50 MB)."""
    import time

    path = tmp_path / "big.txt"
    path.write_text(TEXT.replace("\n", " ") * (20_000_000 // len(TEXT)))
    start = time.perf_counter()
    data = load(path, samples=32, window=128)
    assert time.perf_counter() - start < 1.0
    assert len(data.windows) == 32


def test_jsonl_is_read_only_as_far_as_the_samples_need(tmp_path: Path) -> None:
    path = tmp_path / "calib.jsonl"
    records = [json.dumps({"text": TEXT}) for _ in range(2 * CHUNK // len(TEXT) + 2)]
    path.write_text("\n".join([*records, "{not json"]) + "\n")
    data = load(path, samples=4, window=8)  # the broken last line is never reached
    assert [w.tolist() for w in data.windows] == [ids_of(TEXT)[i * 8 : (i + 1) * 8] for i in range(4)]
    with pytest.raises(CalibrationError, match=re.escape(f"{path}:{len(records) + 1}: not a JSON line")):
        load(path, samples=10**6, window=8)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            ['{"text": "a"}', '{"text": "b"}', "{not json"],
            "{path}:3: not a JSON line (Expecting property name enclosed in double quotes)",
        ),
        (['{"text": "a"}', '{"body": "b"}'], "{path}:2: each line needs a string field 'text'"),
        (['{"text": 3}'], "{path}:1: each line needs a string field 'text'"),
        (["", '["text", "a"]'], "{path}:2: each line needs a string field 'text'"),
    ],
    ids=["bad line", "no text field", "text not a string", "not an object"],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationError, match=exact("calibration: " + message.format(path=path))):
        load(path)


def test_npy_and_npz_token_ids(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 101, (3, 7))
    np.save(tmp_path / "ids.npy", ids.astype(np.uint16))
    np.savez(tmp_path / "ids.npz", first=ids, second=np.zeros(3, dtype=np.int64))  # the first array is read
    for name in ("ids.npy", "ids.npz"):
        data = load(tmp_path / name, samples=10, window=5, vocab=101, tokenizer=None)  # no tokenizer needed
        assert [w.tolist() for w in data.windows] == [ids.ravel()[i * 5 : (i + 1) * 5].tolist() for i in range(4)]
    (tmp_path / "IDS.NPY").write_bytes((tmp_path / "ids.npy").read_bytes())
    assert len(load(tmp_path / "IDS.NPY", vocab=101).windows) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_npy_float_ids_refused(tmp_path: Path, dtype: type) -> None:
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(10).astype(dtype))
    with pytest.raises(
        CalibrationError, match=exact(f"calibration: {path}: token ids must be integers, found dtype {np.dtype(dtype)}")
    ):
        load(path)


def test_npy_out_of_vocabulary_refused(tmp_path: Path) -> None:
    path = tmp_path / "ids.npy"
    np.save(path, np.array([5, 101, 3, 200, -1, 7], dtype=np.int64))
    with pytest.raises(
        CalibrationError,
        match=exact(
            f"calibration: {path}: 3 token ids are outside the vocabulary [0, 101) (e.g. 101); is this data "
            "tokenized for another model?"
        ),
    ):
        load(path, vocab=101)


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "ids.npy"
    path.write_bytes(b"definitely not numpy")
    with pytest.raises(CalibrationError, match="^" + re.escape(f"calibration: {path}: not a readable numpy file (")):
        load(path)
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)  # pickles are never loaded
    with pytest.raises(CalibrationError, match="^" + re.escape(f"calibration: {path}: not a readable numpy file (")):
        load(path)
    missing = tmp_path / "nope.txt"
    with pytest.raises(CalibrationError, match=exact(f"calibration: {missing}: calibration data file not found")):
        load(missing)
    directory = f"calibration: {tmp_path}: a directory, not a regular file; kiln reads only regular files"
    with pytest.raises(CalibrationError, match=exact(directory)):
        load(tmp_path)


def test_empty_and_one_token_data(tmp_path: Path) -> None:
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros(0, dtype=np.int64))
    with pytest.raises(CalibrationError, match=exact(f"calibration: {empty}: the calibration data is empty")):
        load(empty)
    text = tmp_path / "empty.txt"
    text.write_text("")
    with pytest.raises(CalibrationError, match=exact(f"calibration: {text}: the calibration data is empty")):
        load(text)
    one = tmp_path / "one.npy"
    np.save(one, np.array([4], dtype=np.int64))
    with pytest.raises(
        CalibrationError, match=exact(f"calibration: {one}: the calibration data has 1 token; at least 2 are needed")
    ):
        load(one)


def test_empty_npz(tmp_path: Path) -> None:
    path = tmp_path / "empty.npz"
    np.savez(path)
    with pytest.raises(
        CalibrationError,
        match=exact(f"calibration: {path}: the .npz file holds no array; the calibration data is empty"),
    ):
        load(path)


def test_synthetic_warns_and_is_reproducible() -> None:
    with pytest.warns(
        UserWarning, match=re.escape("calibrating on SYNTHETIC random tokens: activation ranges will be poor")
    ):
        data = load_calibration_data(SYNTHETIC, tokenizer=None, vocab_size=101, samples=3, window=16)
    assert data.source == "synthetic" and len(data.windows) == 3
    assert all(w.shape == (16,) and w.dtype == np.int64 and 0 <= w.min() and w.max() < 101 for w in data.windows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = load_calibration_data(SYNTHETIC, tokenizer=None, vocab_size=101, samples=3, window=16)
        other = load_calibration_data(SYNTHETIC, tokenizer=None, vocab_size=101, samples=3, window=16, seed=1)
    assert again.sha256 == data.sha256 and [w.tolist() for w in again.windows] == [w.tolist() for w in data.windows]
    assert other.sha256 != data.sha256


# ---------------------------------------------------------------- caches

RANGES = {"prefill": {"x": (-1.5, 1.5), "/layers.0/h": (-0.25, 0.25)}, "decode": {"x": (-2.0, 2.0)}}


def test_cache_key_depends_on_everything_it_names() -> None:
    base = cache_key("w" * 64, "d" * 64, {"method": "max", "samples": 4})
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert cache_key("w" * 64, "d" * 64, {"samples": 4, "method": "max"}) == base  # key order does not matter
    assert (
        len(
            {
                base,
                cache_key("v" * 64, "d" * 64, {"method": "max", "samples": 4}),
                cache_key("w" * 64, "e" * 64, {"method": "max", "samples": 4}),
                cache_key("w" * 64, "d" * 64, {"method": "max", "samples": 5}),
            }
        )
        == 4
    )


def test_write_then_read_cache(tmp_path: Path) -> None:
    key = cache_key("w", "d", {"method": "max"})
    directory = tmp_path / "cache" / "nested"
    path = write_cache(directory, key, RANGES, {"method": "max"})
    assert path == directory / f"{key}.json"
    assert sorted(p.name for p in directory.iterdir()) == [f"{key}.json"]  # no temporary file left
    stored = json.loads(path.read_text())
    assert stored == {
        "key": key,
        "settings": {"method": "max"},
        "ranges": {g: {t: list(r) for t, r in v.items()} for g, v in RANGES.items()},
    }
    back = read_cache(directory, key)
    assert back == RANGES and all(
        isinstance(r, tuple) and all(isinstance(v, float) for v in r) for g in back.values() for r in g.values()
    )


def test_read_cache_of_missing_corrupt_or_other_files(tmp_path: Path) -> None:
    key = cache_key("w", "d", {})
    assert read_cache(tmp_path / "none", key) is None
    path = tmp_path / f"{key}.json"
    for content in (b'{"key": "', b"\xff\xfe", b"[1, 2]", json.dumps({"key": "other", "ranges": {}}).encode(), b""):
        path.write_bytes(content)
        assert read_cache(tmp_path, key) is None, content
    # a file written for another key (renamed by hand) is not used either
    write_cache(tmp_path, "abc", RANGES, {})
    os.replace(tmp_path / "abc.json", path)
    assert read_cache(tmp_path, key) is None


@pytest.mark.parametrize(
    "ranges", [None, {"prefill": {"x": [1.0]}}, []], ids=["no ranges", "short range", "ranges a list"]
)
def test_read_cache_of_a_damaged_file_with_the_right_key(tmp_path: Path, ranges: object) -> None:
    key = cache_key("w", "d", {})
    data: dict[str, object] = {"key": key, "settings": {}}
    if ranges is not None:
        data["ranges"] = ranges
    (tmp_path / f"{key}.json").write_text(json.dumps(data))
    assert read_cache(tmp_path, key) is None


def test_write_cache_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails before the rename leaves the previous cache file whole."""
    key = cache_key("w", "d", {})
    write_cache(tmp_path, key, RANGES, {})

    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(newfile.os, "replace", fail)  # the cache is written through kiln.newfile
    with pytest.raises(OSError, match="disk full"):
        write_cache(tmp_path, key, {"prefill": {"x": (-9.0, 9.0)}}, {})
    monkeypatch.undo()
    assert read_cache(tmp_path, key) == RANGES


def test_trt_calibration_cache() -> None:
    text = trt_calibration_cache({"x": (-2.54, 1.0), "a/b": (0.0, 0.127), "zero": (0.0, 0.0)})
    lines = text.split("\n")
    assert lines[0] == f"TRT-{TRT_CACHE_VERSION}-EntropyCalibration2" == "TRT-101300-EntropyCalibration2"
    assert text.endswith("\n") and lines[-1] == ""
    assert [line.split(": ")[0] for line in lines[1:-1]] == ["a/b", "x", "zero"]  # sorted
    want = {"x": np.float32(2.54 / 127), "a/b": np.float32(0.127 / 127), "zero": np.float32(0.0)}
    for line in lines[1:-1]:
        name, hexed = line.split(": ")
        assert hexed == np.array([want[name]], dtype=">f4").tobytes().hex()
        assert struct.unpack(">f", bytes.fromhex(hexed))[0] == want[name]
    assert trt_calibration_cache({"x": (-1.0, 1.0)}) == "TRT-101300-EntropyCalibration2\nx: 3c010204\n"
    assert trt_calibration_cache({}, version=100500) == "TRT-100500-EntropyCalibration2\n"


def test_calibration_prepare_and_finish_use_the_cache(tmp_path: Path) -> None:
    spec = spec_of(tiny_config())
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(300, dtype=np.int64) % 101)
    kwargs = dict(
        spec=spec,
        tokenizer=None,
        weights_sha256="a" * 64,
        samples=2,
        method="max",
        percentile=99.9,
        context=48,
        graph_settings={"opset": 19},
        cache_dir=tmp_path / "cache",
    )
    first = Calibration.prepare(str(ids), **kwargs)
    assert not first.cache_hit and first.ranges == {}
    assert first.settings == {
        "method": "max",
        "percentile": None,
        "samples": 2,
        "window": 48,
        "decode_steps": 4,
        "opset": 19,
    }
    assert [len(w) for w in first.data.windows] == [48, 48]
    first.ranges = {g: dict(r) for g, r in RANGES.items()}
    out = tmp_path / "out"
    info = first.finish(out)
    assert info == {
        "source": str(ids),
        "data_sha256": first.data.sha256,
        "key": first.key,
        "cache": "written",
        "settings": first.settings,
    }
    assert sorted(p.name for p in out.iterdir()) == ["decode.trt-calibration.cache", "prefill.trt-calibration.cache"]
    assert (out / "decode.trt-calibration.cache").read_text() == trt_calibration_cache(RANGES["decode"])
    second = Calibration.prepare(str(ids), **kwargs)
    assert second.cache_hit and second.key == first.key and second.ranges == RANGES
    assert second.finish(tmp_path / "out2")["cache"] == "reused"
    other = Calibration.prepare(str(ids), **{**kwargs, "method": "percentile"})
    assert not other.cache_hit and other.key != first.key and other.settings["percentile"] == 99.9


# ---------------------------------------------------------------- methods


def quantization_mse(values: np.ndarray, t: float) -> float:
    """Mean squared error of symmetric int8 quantization of ``values`` clipped at ``t``."""
    step = t / 127.0
    q = np.clip(np.rint(values / step), -127, 127) * step
    return float(((values - q) ** 2).mean())


def test_mse_threshold_on_a_laplacian() -> None:
    values = np.random.default_rng(0).laplace(size=200_000)
    hist, edges = np.histogram(np.abs(values), bins=2048)
    t = mse_threshold(hist.astype(np.float64), edges)
    top = float(edges[-1])
    assert t in edges and 0 < t < 0.9 * top  # a long tail: clipping it pays
    assert quantization_mse(values, t) < 0.8 * quantization_mse(values, top)
    # the histogram model's optimum is the true one up to a few percent, over a grid of thresholds
    grid = [float(e) for e in edges[8::8]]
    assert quantization_mse(values, t) <= 1.05 * min(quantization_mse(values, g) for g in grid)


def test_mse_threshold_on_a_uniform_sample_keeps_the_range() -> None:
    values = np.random.default_rng(1).uniform(-1, 1, size=100_000)
    hist, edges = np.histogram(np.abs(values), bins=2048)
    t = mse_threshold(hist.astype(np.float64), edges)
    assert 0.95 * edges[-1] < t <= edges[-1]  # no tails: clipping costs more than rounding saves


def test_mse_threshold_of_an_all_zero_tensor() -> None:
    assert mse_threshold(np.array([5.0, 0.0]), np.array([0.0, 0.0, 0.0])) == 0.0  # no positive edge: the top one


def tiny_matmul_graph() -> ir.Model:
    """y = x @ I: the MatMul's input and output are the same activations."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="/fc/MatMul")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")],
    )
    return ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    )


def laplace_feeds() -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """Two feeds of different lengths (as prefill and decode feeds are), one outlier."""
    rng = np.random.default_rng(0)
    a = rng.laplace(size=(500, 4)).astype(np.float32)
    b = rng.laplace(size=(300, 4)).astype(np.float32)
    b[7, 2] = -60.0
    return [{"x": a}, {"x": b}], np.abs(np.concatenate([a.ravel(), b.ravel()]))


def test_collect_ranges_max() -> None:
    feeds, values = laplace_feeds()
    ranges = collect_ranges(tiny_matmul_graph(), [[f] for f in feeds], CalibMethod.MAX, 99.99)
    assert ranges == {
        "x": (-60.0, 60.0),
        "y": (-60.0, 60.0),
    }  # the max |activation| over both samples (merged across calls), symmetric (the outlier is negative)
    positive = [{"x": np.abs(f["x"]) + 1.0} for f in feeds]
    assert collect_ranges(tiny_matmul_graph(), [positive], CalibMethod.MAX, 99.99)["x"] == (
        -61.0,
        61.0,
    )  # symmetric even when all > 0


def test_collect_ranges_max_skips_a_sample_where_the_tensor_is_empty() -> None:
    """A tensor empty throughout one sample (an MoE expert's input that none of the sample's tokens
    reached) takes its range from the samples that saw it: ONNX Runtime's own merge made it (-inf, inf),
    which --int8 then refused ("scales must be finite and > 0"). Empty in every sample: no range."""
    feeds, _ = laplace_feeds()
    empty = {"x": np.zeros((0, 4), dtype=np.float32)}
    for samples in ([[feeds[1]], [empty]], [[empty], [feeds[1]]]):
        assert collect_ranges(tiny_matmul_graph(), samples, CalibMethod.MAX, 99.99) == {
            "x": (-60.0, 60.0),
            "y": (-60.0, 60.0),
        }, samples
    assert collect_ranges(tiny_matmul_graph(), [[empty]], CalibMethod.MAX, 99.99) == {}


@pytest.mark.parametrize("percentile", [99.0, 99.9])
def test_collect_ranges_percentile(percentile: float) -> None:
    feeds, values = laplace_feeds()
    ranges = collect_ranges(tiny_matmul_graph(), [[f] for f in feeds], CalibMethod.PERCENTILE, percentile)
    assert ranges.keys() == {"x", "y"} and ranges["x"] == ranges["y"]
    lo, hi = ranges["x"]
    assert lo == -hi
    bin_width = 60.0 / 2048  # ONNX Runtime's histogram of |x|, 2048 bins up to the max
    assert abs(hi - float(np.percentile(values, percentile))) <= 2 * bin_width


def test_collect_ranges_entropy_and_mse() -> None:
    feeds, values = laplace_feeds()
    entropy = collect_ranges(tiny_matmul_graph(), [[f] for f in feeds], CalibMethod.ENTROPY, 99.99)
    mse = collect_ranges(tiny_matmul_graph(), [[f] for f in feeds], CalibMethod.MSE, 99.99)
    for ranges in (entropy, mse):
        assert ranges.keys() == {"x", "y"}
        lo, hi = ranges["x"]
        assert lo == -hi and 0 < hi <= 60.0
    assert entropy["x"][1] < float(np.percentile(values, 99.99))  # entropy clips the outlier's range
    # mse: the threshold mse_threshold picks on the same |x| histogram (ONNX Runtime merges the
    # two feeds' histograms, so allow a couple of bins); one outlier in 3200 values is cheaper
    # kept than clipped under the summed squared error
    hist, edges = np.histogram(values, bins=2048, range=(0.0, 60.0))
    want = mse_threshold(hist.astype(np.float64), edges)
    assert abs(mse["x"][1] - want) <= 2 * 60.0 / 2048


def test_the_weights_identity_covers_every_checkpoint_file_and_every_merged_adapter() -> None:
    """The cache's weights key: a checkpoint that differs in any shard or in its config, or a merged adapter's
    files, weight or order, is other weights (it was one file's hash: a sharded checkpoint's first shard)."""
    from kiln.exporter.calibrate import weights_identity

    shards = {
        "config.json": "c" * 64,
        "model-00001-of-00002.safetensors": "1" * 64,
        "model-00002-of-00002.safetensors": "2" * 64,
    }
    lora = {"adapter_config.json": "a" * 64, "adapter_model.safetensors": "b" * 64}
    other = {"adapter_config.json": "a" * 64, "adapter_model.safetensors": "e" * 64}
    base = weights_identity(shards)
    assert re.fullmatch("[0-9a-f]{64}", base)
    assert weights_identity(dict(reversed(list(shards.items())))) == base  # the files' order does not matter
    assert weights_identity(shards, ()) == base
    variants = [
        weights_identity({**shards, "model-00002-of-00002.safetensors": "3" * 64}),  # the second shard
        weights_identity({**shards, "config.json": "d" * 64}),  # the config
        weights_identity({k: v for k, v in shards.items() if k != "config.json"}),  # a file fewer
        weights_identity(shards, [(lora, 1.0)]),  # an adapter merged
        weights_identity(shards, [(lora, 0.5)]),  # at another weight
        weights_identity(shards, [(other, 1.0)]),  # another adapter
        weights_identity(shards, [(lora, 1.0), (other, 1.0)]),
        weights_identity(shards, [(other, 1.0), (lora, 1.0)]),  # the sum's order, as --adapter gave it
    ]
    assert len({base, *variants}) == 1 + len(variants)
