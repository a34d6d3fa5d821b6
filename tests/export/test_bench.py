"""kiln bench: feeds built from real graphs' declared inputs (kiln's, Optimum-style and
GenAI-style names), the tables, the slope fit, the CLI's errors. No timing is asserted."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from kiln.cli import main
from kiln.errors import BenchError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.options import ExportOptions
from kiln.exporter.pipeline import export
from kiln.exporter.runners import ort_session
from kiln.runtime.bench import load_warning, render
from kiln.runtime.decoder_dirs import open_decoder_dir
from kiln.runtime.feeds import Sizes, build_feeds, declared_inputs, resolve_dim
from kiln.runtime.roofline import BandwidthProbe, read_bandwidths, weights_bytes_per_step
from kiln.runtime.sweep import fit_line, render_sweep, runs_at
from kiln.runtime.timing import Timed
from kiln.runtime.torch_row import TorchWorker
from kiln_testing import tiny_config, write_checkpoint

N_KV, HD, VOCAB = 2, 4, 7


@pytest.fixture(scope="module")
def kiln_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    ckpt = write_checkpoint(root / "ckpt", tiny_config())
    export(ckpt, root / "kiln", ExportOptions.from_flags(max_batch=1, parity_tokens=2))
    return root / "kiln"


def _hf_graph(dims: dict[str, str], *, shared: bool = False, position_ids: bool = False) -> onnx.ModelProto:
    """A one-layer decoder-shaped graph with Hugging Face names: logits from the ids, presents =
    Concat(past, new) (or past itself, for a shared buffer), a 8x7 MatMul weight and a 7x8 table."""
    b, s, p, t = dims["batch"], dims["seq"], dims["past"], dims["total"]
    hd = dims.get("head", HD)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [b, s]),
        helper.make_tensor_value_info("attention_mask", i64, [b, t]),
    ]
    if position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, [b, s]))
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"]),  # [b, s, 8]
        helper.make_node("MatMul", ["emb", "w"], ["logits"]),  # [b, s, 7]
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, [b, s, VOCAB])]
    for kind in ("key", "value"):
        past, present = f"past_key_values.0.{kind}", f"present.0.{kind}"
        inputs.append(helper.make_tensor_value_info(past, f32, [b, N_KV, p, hd]))
        outputs.append(helper.make_tensor_value_info(present, f32, [b, N_KV, t, hd]))
        if shared:
            nodes.append(helper.make_node("Identity", [past], [present]))
        else:
            nodes += [
                helper.make_node("Slice", ["emb", "zero", "hd", "two"], [f"e_{kind}"]),  # [b, s, hd]
                helper.make_node("Unsqueeze", [f"e_{kind}", "one"], [f"u_{kind}"]),  # [b, 1, s, hd]
                helper.make_node("Mul", [f"u_{kind}", "ones"], [f"new_{kind}"]),  # [b, n_kv, s, hd]
                helper.make_node("Concat", [past, f"new_{kind}"], [present], axis=2),
            ]
    inits = [
        helper.make_tensor("table", f32, [VOCAB, 8], np.arange(56, dtype=np.float32).tolist()),
        helper.make_tensor("w", f32, [8, VOCAB], np.ones(56, dtype=np.float32).tolist()),
        helper.make_tensor("zero", i64, [1], [0]),
        helper.make_tensor("hd", i64, [1], [HD]),
        helper.make_tensor("two", i64, [1], [2]),
        helper.make_tensor("one", i64, [1], [1]),
        helper.make_tensor("ones", f32, [1, N_KV, 1, 1], [1.0] * N_KV),
    ]
    graph = helper.make_graph(nodes, "hf_like", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)


@pytest.fixture(scope="module")
def optimum_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("optimum")
    dims = {
        "batch": "batch_size",
        "seq": "sequence_length",
        "past": "past_sequence_length",
        "total": "past_sequence_length + sequence_length",
    }
    onnx.save(_hf_graph(dims, position_ids=True), str(root / "model.onnx"))
    (root / "config.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def genai_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("genai")
    dims = {
        "batch": "batch_size",
        "seq": "sequence_length",
        "past": "past_sequence_length",
        "total": "total_sequence_length",
        "head": "kv_cache_dim",
    }
    onnx.save(_hf_graph(dims, shared=True), str(root / "model.onnx"))
    decoder = {
        "filename": "model.onnx",
        "head_size": HD,
        "num_hidden_layers": 1,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
    }
    (root / "genai_config.json").write_text(
        json.dumps({"model": {"decoder": decoder}, "search": {"past_present_share_buffer": True}})
    )
    return root


def test_dims_of_every_tool_resolve() -> None:
    sizes = Sizes(seq=3, past=10, encoder=5, named=(("kv_cache_dim", 64),))
    cases = {
        "batch": 1,
        "batch_size": 1,
        "seq": 3,
        "sequence_length": 3,
        "past_seq": 10,
        "past_sequence_length": 10,
        "total_seq": 13,
        "total_sequence_length": 13,
        "past_sequence_length + sequence_length": 13,
        "past_sequence_length + 1": 11,
        "encoder_seq": 5,
        "encoder_sequence_length": 5,
        "kv_cache_dim": 64,
        16: 16,
    }
    for dim, want in cases.items():
        assert resolve_dim(dim, sizes) == want, dim
    shared = Sizes(seq=1, past=10, capacity=11)
    assert resolve_dim("past_sequence_length", shared, kv_buffer=True) == 11  # the buffer, not the valid part
    assert resolve_dim("past_sequence_length", shared) == 10
    with pytest.raises(BenchError, match=r"input x: unknown dim name 'num_beams'; known: batch, seq"):
        resolve_dim("num_beams", sizes, where="input x")
    with pytest.raises(BenchError, match="neither a size nor a name"):
        resolve_dim(None, sizes, where="input x")


def test_feeds_for_kiln_graphs_run(kiln_dir: Path) -> None:
    d = open_decoder_dir(kiln_dir)
    assert d.tool == "kiln" and d.label == "kiln fp32 (kiln)" and d.decode.name == "decode.onnx"
    cfg = tiny_config()
    sess = ort_session(d.decode, threads=1, spinning=False)
    feeds = build_feeds(declared_inputs(sess), Sizes(seq=1, past=5), vocab=cfg.vocab_size)
    assert feeds["past_key_values.1.value"].shape == (1, cfg.n_kv_heads, 5, cfg.d_model // cfg.n_heads)
    assert feeds["attention_mask"].tolist() == [[1] * 6]
    assert feeds["position_ids"].tolist() == [[5]]
    assert (
        feeds["input_ids"].dtype == np.int64
        and 0 <= feeds["input_ids"].min()
        and feeds["input_ids"].max() < cfg.vocab_size
    )
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    assert out["present.0.key"].shape == (1, cfg.n_kv_heads, 6, cfg.d_model // cfg.n_heads)
    prefill = build_feeds(declared_inputs(ort_session(d.prefill, threads=1, spinning=False)), Sizes(seq=9, past=0))
    assert {k: v.shape for k, v in prefill.items()} == {
        "input_ids": (1, 9),
        "attention_mask": (1, 9),
        "position_ids": (1, 9),
    }


def test_feeds_for_optimum_names(optimum_dir: Path) -> None:
    d = open_decoder_dir(optimum_dir)
    assert (d.tool, d.prefill, d.decode, d.shared_kv_buffer) == (
        "onnx",
        optimum_dir / "model.onnx",
        optimum_dir / "model.onnx",
        False,
    )
    sess = ort_session(d.decode, threads=1, spinning=False)
    feeds = build_feeds(declared_inputs(sess), Sizes(seq=2, past=3), vocab=VOCAB)
    assert feeds["attention_mask"].shape == (1, 5) and feeds["position_ids"].tolist() == [[3, 4]]
    assert feeds["past_key_values.0.key"].shape == (1, N_KV, 3, HD)
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, feeds), strict=True))
    assert out["present.0.key"].shape == (1, N_KV, 5, HD)
    np.testing.assert_array_equal(out["present.0.key"][:, :, :3], feeds["past_key_values.0.key"])
    # only the gathered rows of the table are read per token; the MatMul weight whole
    assert weights_bytes_per_step(d.decode) == 8 * 4 + 56 * 4 + 4 * 8 + N_KV * 4


def test_genai_shared_buffer_binds_present_to_past(genai_dir: Path) -> None:
    d = open_decoder_dir(genai_dir)
    assert d.tool == "genai" and d.shared_kv_buffer
    assert d.present_to_past == {"present.0.key": "past_key_values.0.key", "present.0.value": "past_key_values.0.value"}
    assert d.roles == {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    sess = ort_session(d.decode, threads=1, spinning=False)
    timed = Timed(d, sess, Sizes(seq=1, past=6), VOCAB)
    timed()
    past = timed._values["past_key_values.0.key"]
    assert past.shape() == [1, N_KV, 7, HD]  # capacity past + 1, head size from genai_config.json


def test_directory_errors(tmp_path: Path, genai_dir: Path) -> None:
    with pytest.raises(BenchError, match="not a directory"):
        open_decoder_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        BenchError, match=r"no manifest.json, genai_config.json or model.onnx; expected a kiln export directory"
    ):
        open_decoder_dir(tmp_path / "empty")
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.onnx").write_bytes(b"")
    (two / "b.onnx").write_bytes(b"")
    with pytest.raises(BenchError, match=r"several .onnx files and no model.onnx \(a.onnx, b.onnx\)"):
        open_decoder_dir(two)
    bad = tmp_path / "genai"
    bad.mkdir()
    (bad / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "gone.onnx"}}}))
    with pytest.raises(BenchError, match="genai_config.json names gone.onnx, which does not exist"):
        open_decoder_dir(bad)


def _with_decoder(genai_dir: Path, to: Path, config: object) -> Path:
    """A copy of the GenAI directory whose genai_config.json is ``config``."""
    shutil.copytree(genai_dir, to)
    (to / "genai_config.json").write_text(json.dumps(config))
    return to


def test_a_genai_config_s_fields_are_checked_before_use(tmp_path: Path, genai_dir: Path) -> None:
    """Issue 38, item 6: a filename outside the directory was timed, 1e9 layers grew memory at 150 MB/s,
    wrong types were TypeError/AttributeError tracebacks. Each is one BenchError naming the field."""
    good = json.loads((genai_dir / "genai_config.json").read_text())
    decoder = good["model"]["decoder"]
    where = "genai_config.json: "
    cases = {
        "outside": (
            {**good, "model": {"decoder": {**decoder, "filename": "../../../other/model.onnx"}}},
            "model.decoder.filename '../../../other/model.onnx' is not a file name in ",
        ),
        "layers": (
            {**good, "model": {"decoder": {**decoder, "num_hidden_layers": 1e9}}},
            "model.decoder.num_hidden_layers must be an integer from 1 to 4096, found 1000000000.0",
        ),
        "model": ({"model": [1]}, "model must be an object, found [1]"),
        "decoder": ({"model": {"decoder": "x"}}, "model.decoder must be an object, found 'x'"),
        "filename": ({"model": {"decoder": {"filename": 3}}}, "model.decoder.filename must be a string, found 3"),
        "inputs": (
            {**good, "model": {"decoder": {**decoder, "inputs": ["input_ids"]}}},
            "model.decoder.inputs must map names to strings, found ['input_ids']",
        ),
        "search": ({**good, "search": 1}, "search must be an object, found 1"),
        "head_size": (
            {**good, "model": {"decoder": {**decoder, "head_size": "64"}}},
            "model.decoder.head_size must be an integer from 1 to 65536, found '64'",
        ),
        "patterns": (
            {
                **good,
                "model": {
                    "decoder": {**decoder, "outputs": {**decoder["outputs"], "present_key_names": "present.%s.%d"}}
                },
            },
            "'present.%s.%d' and 'past_key_values.%d.key' are not name patterns with one %d",
        ),
    }
    for case, (config, message) in cases.items():
        directory = _with_decoder(genai_dir, tmp_path / case, config)
        with pytest.raises(BenchError) as refused:
            open_decoder_dir(directory)
        assert str(refused.value).startswith(f"bench: {directory}/{where}{message}"), (case, str(refused.value))


def test_feeds_that_cannot_fit_are_refused_before_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--past 100000000`` asked for 47.7 GiB of past keys and values: refused first, with the figures
    (12 x 8 x 1e8 x 64 float32 = 2288.8 GiB here)."""
    from kiln.runtime.feeds import InputDecl

    decls = [
        InputDecl(f"past_key_values.{i}.key", np.dtype(np.float32), ("batch", 8, "past_seq", 64)) for i in range(12)
    ]
    with pytest.raises(BenchError) as refused:
        build_feeds(decls, Sizes(seq=1, past=100_000_000))
    assert str(refused.value).startswith(
        "bench: the inputs of one call at past 100000000, 1 new tokens need 2288.8 GiB, more than half of this "
        "machine's "
    )
    assert str(refused.value).endswith(" GiB of memory; choose a smaller --past or --prefill-seq")
    assert set(build_feeds(decls, Sizes(seq=1, past=4))) == {d.name for d in decls}


def test_slope_fit() -> None:
    pasts = [64, 128, 256, 512]
    fit = fit_line(pasts, [2.0 + 0.004 * p for p in pasts])
    assert fit["slope_ms_per_1k"] == pytest.approx(4.0) and fit["intercept_ms"] == pytest.approx(2.0)
    assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_residual"] < 1e-9
    bent = fit_line(pasts, [1.0, 1.0, 1.0, 9.0])  # not linear: r² says so
    assert bent["r2"] < 0.95
    with pytest.raises(ValueError, match="at least two different past lengths"):
        fit_line([64, 64], [1.0, 2.0])
    assert runs_at(64, 15) == 15 and runs_at(4096, 15) == 5


def test_render_table_and_sweep() -> None:
    result = {
        "threads": 2,
        "runs": 30,
        "prefill_seq": 128,
        "decode_past": 256,
        "baseline": "kiln fp32 (a)",
        "read_bandwidth_gb_s": 20.0,
        "read_bandwidth_best_gb_s": 25.0,
        "directories": [
            {"label": "kiln fp32 (a)", "weights_bytes_per_step": 100_000_000},
            {"label": "onnx (b)", "weights_bytes_per_step": 50_000_000},
        ],
        "median_ms": {
            "prefill": {"pytorch eager": 60.0, "kiln fp32 (a)": 30.0, "onnx (b)": 45.0},
            "decode": {"pytorch eager": 15.0, "kiln fp32 (a)": 10.0, "onnx (b)": 5.0},
        },
        "roofline": {"kiln fp32 (a)": 0.5, "onnx (b)": 0.5},
        "sweep": {
            "pasts": [64, 128],
            "runs": [5, 5],
            "median_ms": {"kiln fp32 (a)": [1.0, 2.0]},
            "fit": {"kiln fp32 (a)": fit_line([64, 128], [1.0, 2.0])},
        },
    }
    text = render(result)
    assert "| pytorch eager | 60.00 | 2.00x | 15.00 | 1.50x | - | - |" in text
    assert "| kiln fp32 (a) | 30.00 | 1.00x | 10.00 | 1.00x | 100.0 | 50% |" in text
    assert "| onnx (b) | 45.00 | 1.50x | 5.00 | 0.50x | 50.0 | 50% |" in text
    assert (
        "memory read bandwidth: median 20.0 GB/s over 30 calls interleaved with the decode steps, "
        "best 25.0 GB/s (the fastest of those and 30 calls alone); "
        "roofline = (weights bytes per step / median bandwidth) / decode step"
    ) in text.splitlines()
    assert "| kiln fp32 (a) | 1.00 | 2.00 | 15.625 | 0.00 | 1.000 |" in render_sweep(result["sweep"])


def test_best_bandwidth_is_never_below_the_median() -> None:
    """The probe's best is its fastest call of all, so never below the median of the interleaved
    calls printed beside it, even when every call alone came in a slow burst (the old "best alone",
    the best of 15 calls in a row after the runs, printed below the median so)."""
    interleaved, burst = [0.010, 0.008, 0.009, 0.011, 0.0095], [0.020] * 5
    median, best = read_bandwidths(10**9, interleaved, burst)
    assert (median, best) == (pytest.approx(10**9 / 0.0095), pytest.approx(10**9 / 0.008))
    rng = np.random.default_rng(0)
    for _ in range(200):
        samples = rng.uniform(0.005, 0.05, (2, 7)).tolist()
        median, best = read_bandwidths(10**9, samples[0], samples[1])
        assert best >= median
    base = {
        "threads": 2,
        "runs": 5,
        "prefill_seq": 8,
        "decode_past": 6,
        "baseline": "a",
        "directories": [{"label": "a", "weights_bytes_per_step": 1}],
        "median_ms": {"prefill": {"a": 1.0}, "decode": {"a": 1.0}},
    }
    median, best = read_bandwidths(10**9, interleaved, burst)
    line = render({**base, "read_bandwidth_gb_s": median / 1e9, "read_bandwidth_best_gb_s": best / 1e9}).splitlines()[1]
    printed = re.fullmatch(r"memory read bandwidth: median (\S+) GB/s over 5 calls .*, best (\S+) GB/s .*", line)
    assert printed is not None and float(printed[2]) >= float(printed[1]), line


def test_bandwidth_probe_alone_warms_up_and_counts() -> None:
    class Counted:
        done = 0

        def advance(self, steps: int = 1) -> None:
            self.done += steps

    probe, stage = BandwidthProbe(threads=1, mib=1), Counted()
    try:
        seconds = probe.alone(4, 0.0, stage)
    finally:
        probe.close()
    assert len(seconds) == 4 and min(seconds) > 0 and stage.done == 4


def test_load_warning() -> None:
    assert load_warning([1.5, 1.9], 2) is None and load_warning([2.0, 2.0], 2) is None
    assert load_warning([1.5, 2.6], 2) == (
        "WARNING: the 1-minute load average reached 2.6, above the 2 cores: other processes competed for them, "
        "and these figures are unreliable"
    )
    result = {
        "threads": 2,
        "runs": 3,
        "prefill_seq": 8,
        "decode_past": 6,
        "baseline": "a",
        "load_average": [3.0, 1.0],
        "cores": 2,
        "directories": [{"label": "a", "weights_bytes_per_step": 1}],
        "median_ms": {"prefill": {"a": 1.0}, "decode": {"a": 1.0}},
    }
    assert (
        render(result).splitlines()[0].startswith("WARNING: the 1-minute load average reached 3.0, above the 2 cores")
    )
    assert render({**result, "load_average": [1.0, 1.0]}).splitlines()[0].startswith("batch 1, 2 threads")


def _decode_feeds(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    d = open_decoder_dir(directory)
    sess = ort_session(d.decode, threads=1, spinning=False)
    return {"decode": build_feeds(declared_inputs(sess), Sizes(seq=1, past=5), vocab=tiny_config().vocab_size)}


def test_torch_row_worker_is_passive_with_the_thread_count(
    kiln_dir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's OpenMP runtime itself reads the settings (libgomp prints what it read with
    OMP_DISPLAY_ENV, when torch loads it in the worker), and torch runs with the thread count."""
    monkeypatch.setenv("OMP_DISPLAY_ENV", "TRUE")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    ref = str(manifest_mod.read(kiln_dir).checkpoint.reference)
    worker = TorchWorker(ref, _decode_feeds(kiln_dir), threads=1)
    try:
        assert worker.info["threads"] == 1 and worker.info["omp_wait_policy"] == "PASSIVE"
        (call,) = worker.calls().values()
        assert call() > 0 and worker.info["pid"] != os.getpid()
    finally:
        worker.close()
    err = capfd.readouterr().err
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in err and "OMP_NUM_THREADS = '1'" in err


def test_torch_row_worker_errors(kiln_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BenchError) as err:
        TorchWorker(str(tmp_path / "gone"), _decode_feeds(kiln_dir), threads=1)
    assert (
        str(err.value)
        == f"bench: the PyTorch row: checkpoint: {tmp_path / 'gone'}: no such checkpoint file or directory; pass "
        "--no-torch to bench without it"
    )


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def _stage_lines(stderr: str) -> list[str]:
    """LineProgress's lines (stderr not a terminal), the seconds and run clock made S and T."""
    return [re.sub(r" in \d+\.\d s \(run \d+:\d\d:\d\d\)$", " in S s (run T)", line) for line in stderr.splitlines()]


def test_bench_cli_side_by_side_with_sweep(kiln_dir: Path, optimum_dir: Path, genai_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r" / "bench.json"
    code, stdout, err = _run(
        "bench",
        str(kiln_dir),
        "--compare",
        str(optimum_dir),
        "--compare",
        str(genai_dir),
        "--runs",
        "3",
        "--prefill-seq",
        "8",
        "--past",
        "6",
        "--sweep",
        "4,8,16",
        "--sweep-runs",
        "3",
        "--out",
        str(out),
    )
    assert code == 0, err
    data = json.loads(out.read_text())
    labels = {"kiln fp32 (kiln)", f"onnx ({optimum_dir.name})", f"genai ({genai_dir.name})"}
    assert set(data["median_ms"]["decode"]) == labels | {"pytorch eager"}
    assert data["baseline"] == "kiln fp32 (kiln)" and data["decode_past"] == 6 and data["prefill_seq"] == 8
    assert set(data["roofline"]) == labels and data["read_bandwidth_gb_s"] > 0 and data["read_bandwidth_best_gb_s"] > 0
    assert len(data["load_average"]) == 2 and "load average" in stdout
    assert data["sweep"]["pasts"] == [4, 8, 16] and set(data["sweep"]["fit"]) == labels
    assert (
        data["pytorch"] == {"threads": 2, "omp_wait_policy": "PASSIVE", "process": "worker"}
        and data["cores"] == os.cpu_count()
    )
    assert (
        "pytorch eager: 2 threads, OMP_WAIT_POLICY=PASSIVE, in a worker process (as ONNX Runtime: no spinning)"
        in stdout
    )
    assert (
        Path(data["sweep"]["plot"]) == out.with_suffix(".png")
        and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    )
    assert "| kiln fp32 (kiln) |" in stdout and "slope ms/1k past" in stdout
    assert data["read_bandwidth_best_gb_s"] >= data["read_bandwidth_gb_s"]
    # the sweep: 3 rows warmed up twice, runs_at's 5 runs at least
    sweep = [f"sweep: decode step (past {p}) {part}" for p in (4, 8, 16) for part in ("warm-up: 6/6", "runs: 5/5")]
    stages = [
        "load kiln fp32 (kiln): 2/2",
        f"load onnx ({optimum_dir.name}): 1/1",
        f"load genai ({genai_dir.name}): 1/1",
        "load pytorch eager: 1/1",
        "prefill (seq 8) warm-up: 4/4",
        "prefill (seq 8) runs: 3/3",
        "decode step (past 6) warm-up: 5/5",
        "decode step (past 6) runs: 3/3",  # 4 rows and the bandwidth probe
        "memory read bandwidth alone: 3/3",
        *sweep,
    ]
    assert _stage_lines(err) == [f"{stage} in S s (run T)" for stage in stages]


def test_bench_cli_json_prints_no_progress(kiln_dir: Path) -> None:
    """--json: stdout is the JSON alone and stderr holds no stage lines (as kiln export --json)."""
    code, stdout, err = _run("bench", str(kiln_dir), "--no-torch", "--runs", "3", "--prefill-seq", "8", "--json")
    assert (code, err) == (0, "")
    assert json.loads(stdout)["runs"] == 3


def test_bench_cli_errors(kiln_dir: Path, optimum_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = _run("bench", str(tmp_path / "empty"))
    want = (
        f"error: bench: {tmp_path / 'empty'}: no manifest.json, genai_config.json or model.onnx; "
        "expected a kiln export directory or an ONNX decoder directory (Optimum, ONNX Runtime GenAI builder)"
    )
    assert code == 1 and err.strip().splitlines() == [want]
    code, _, err = _run("bench", str(optimum_dir), "--runs", "3")
    assert (
        code == 1
        and "a PyTorch row needs a kiln export directory whose manifest names its checkpoint; pass --no-torch" in err
    )
    code, _, err = _run("bench", str(kiln_dir), "--sweep", "8,x")
    assert code == 2 and "expected comma-separated integers, found '8,x'" in err
    # the result files: never inside a directory it times, an existing one only with --force (before any timing)
    report = kiln_dir / "reports" / "parity.json"
    before = report.read_bytes()
    code, _, err = _run("bench", str(kiln_dir), "--no-torch", "--out", str(report), "--force")
    assert (code, err.strip().splitlines()) == (
        1,
        [f"error: config: {report}: inside {kiln_dir}, which this command reads; write the result outside it"],
    )
    notes = tmp_path / "notes.json"
    notes.write_text("mine")
    code, _, err = _run("bench", str(kiln_dir), "--no-torch", "--out", str(notes))
    assert (code, err.strip().splitlines()) == (
        1,
        [f"error: config: {notes}: already exists; pass --force to replace it"],
    )
    code, _, err = _run(
        "bench",
        str(kiln_dir),
        "--no-torch",
        "--out",
        str(tmp_path / "new.json"),
        "--plot",
        str(notes),
        "--sweep",
        "4,8",
    )
    assert (code, err.strip().splitlines()) == (
        1,
        [f"error: config: {notes}: already exists; pass --force to replace it"],
    )
    assert report.read_bytes() == before and notes.read_text() == "mine" and not (tmp_path / "new.json").exists()
    code, _, err = _run("bench", str(kiln_dir), "--no-torch", "--no-roofline", "--runs", "3", "--sweep", "8,64")
    assert code == 1 and "--sweep past 64 does not fit the export's context limit 48" in err


def test_rotary_caches_count_by_the_rows_a_step_reads(tmp_path: Path) -> None:
    """GroupQueryAttention's cos/sin caches [max_context, rotary_dim / 2] are read at the step's
    positions, like an embedding: a step counts one row of each, the MatMul weight whole."""
    from onnx import TensorProto, helper, numpy_helper

    cache = numpy_helper.from_array(np.zeros((256, 16), np.float32), "cos_cache")
    sin = numpy_helper.from_array(np.zeros((256, 16), np.float32), "sin_cache")
    weight = numpy_helper.from_array(np.zeros((8, 8), np.float32), "w")
    inputs = ["q", "", "", "", "", "", "", "cos_cache", "sin_cache"]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["q"]),
        helper.make_node("GroupQueryAttention", inputs, ["y"], domain="com.microsoft"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [cache, sin, weight],
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert weights_bytes_per_step(path) == 8 * 8 * 4 + 2 * 16 * 4
