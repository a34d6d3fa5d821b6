"""``kiln bench``: prefill and decode-step latency at batch 1 of kiln's graphs side by side with
other ONNX decoder exports (Optimum, ONNX Runtime GenAI) and, optionally, PyTorch eager.

The machine is shared and noisy, so everything is measured interleaved (one call of each in
turn, a short pause between calls), ONNX Runtime's spinning threads are switched off, and
medians over many runs are reported; ratios are only meaningful inside one run. Every graph is
called through IOBinding with its inputs bound once, so what is timed is the graph, not numpy
conversions. Feeds come from each graph's declared inputs (graph_feeds), so one bench serves
every tool's naming. The past-length sweep and plot live in bench_sweep. Timings never go in tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import BenchError, ConfigError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.manifest import Manifest
from kiln.exporter.lora.adapter_file import read_adapter_file
from kiln.exporter.progress import NullProgress, Progress
from kiln.exporter.runners import ort_session
from kiln.runtime.decoder_dirs import DecoderDir, open_decoder_dirs
from kiln.runtime.feeds import Sizes, build_feeds, declared_inputs
from kiln.runtime.roofline import BandwidthProbe, read_bandwidths, weights_bytes_per_step
from kiln.runtime.timing import Timed, interleaved_seconds, medians_ms, vocab_of
from kiln.runtime.torch_row import TorchWorker

__all__ = ["BenchOptions", "load_warning", "render", "require_new_results", "run_bench"]

TORCH = "pytorch eager"
_PROBE = "memory read probe"  # not a row: the bandwidth measured among the decode steps


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    prefill_seq: int = 128
    past: int = 256
    runs: int = 30
    threads: int = 2
    pause_s: float = 0.002  # between calls, so one backend's tail does not bleed into the next
    torch: bool = True  # a PyTorch eager row (needs a kiln directory whose checkpoint loads)
    roofline: bool = True  # measure read bandwidth and report decode steps against it
    sweep: tuple[int, ...] = ()  # past lengths of the decode-step sweep
    sweep_runs: int = 15  # runs at past <= 512; fewer beyond (each step costs more)
    adapter: Path | None = None  # --adapter FILE: every export with LoRA slots also timed with it active


def load_warning(load_average: Sequence[float], cores: int) -> str | None:
    """The table header's warning when the machine was busier than its cores during the bench."""
    load = max(load_average)
    if load <= cores:
        return None
    return (
        f"WARNING: the 1-minute load average reached {load:.1f}, above the {cores} cores: other processes competed "
        "for them, and these figures are unreliable"
    )


def _torch_worker(
    kiln_dirs: list[DecoderDir], sizes: dict[str, Sizes], sessions: dict[Path, Any], threads: int
) -> TorchWorker:
    """The PyTorch row: the first kiln directory's checkpoint in a worker process (``torch_row``:
    the same threads as ONNX Runtime, no spinning), fed what its graphs are fed."""
    first = kiln_dirs[0] if kiln_dirs else None
    ref = first.manifest.checkpoint.reference if first is not None and first.manifest is not None else None
    if first is None or first.manifest is None or ref is None:
        raise BenchError(
            "a PyTorch row needs a kiln export directory whose manifest names its checkpoint; pass --no-torch"
        )
    vocab = first.manifest.model.vocab_size
    feeds = {
        kind: build_feeds(declared_inputs(sessions[graph]), sizes[kind], vocab=vocab)
        for kind, graph in (("prefill", first.prefill), ("decode", first.decode))
    }
    return TorchWorker(ref, feeds, threads)


def _manifest(decoder: DecoderDir) -> Manifest:
    assert decoder.manifest is not None, "a kiln export directory"
    return decoder.manifest


def _check_same_checkpoint(kiln_dirs: list[DecoderDir]) -> None:
    first = kiln_dirs[0]
    for other in kiln_dirs[1:]:
        if _manifest(other).checkpoint.files != _manifest(first).checkpoint.files:
            raise BenchError(
                f"{other.path}: exported from another checkpoint than {first.path}; bench compares exports of one model"
            )


def run_bench(directories: list[Path], options: BenchOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Every directory's prefill and decode graphs (and PyTorch eager), measured interleaved;
    the first directory is the baseline of the ratios. ``progress`` hears of every stage, since
    a bench takes seconds to minutes: each export's sessions, the PyTorch worker's start, the
    warm-up and runs of each measurement, the bandwidth probe alone, the sweep's pasts."""
    progress = progress or NullProgress()
    decoders = _with_adapter([entry for d in directories for entry in open_decoder_dirs(d)], options.adapter)
    kiln_dirs = [d for d in decoders if d.manifest is not None and d.target is None]
    if kiln_dirs:
        _check_same_checkpoint(kiln_dirs)
    limit = min((_manifest(d).limits.max_context for d in kiln_dirs), default=None)
    seq = options.prefill_seq if limit is None else min(options.prefill_seq, limit)
    past = options.past if limit is None else min(options.past, limit - 1)
    if options.sweep and limit is not None and max(options.sweep) >= limit:
        raise BenchError(
            f"--sweep past {max(options.sweep)} does not fit the export's context limit {limit} (past + 1 token)"
        )
    sizes = {"prefill": Sizes(seq=seq, past=0), "decode": Sizes(seq=1, past=past)}
    labels = _unique([d.label for d in decoders])
    sessions = _open_sessions(decoders, labels, options.threads, progress)
    calls: dict[str, dict[str, Callable[[], object]]] = {"prefill": {}, "decode": {}}
    worker = None
    if options.torch:
        with progress.stage(f"load {TORCH}"):  # the worker loads the checkpoint before it answers
            worker = _torch_worker(kiln_dirs, sizes, sessions, options.threads)
    try:
        for kind, call in (worker.calls() if worker is not None else {}).items():
            calls[kind][TORCH] = call
        result = _measure(decoders, labels, calls, sessions, sizes, options, progress)
    except BaseException:
        if worker is not None:
            worker.stop()  # an error or a signal: ended at once, not waited for
        raise
    if worker is not None:
        worker.close()
    if worker is not None:
        result["pytorch"] = {
            "threads": worker.info["threads"],
            "omp_wait_policy": worker.info["omp_wait_policy"],
            "process": "worker",
        }
    return result


def _open_sessions(decoders: list[DecoderDir], labels: list[str], threads: int, progress: Progress) -> dict[Path, Any]:
    """The ONNX Runtime sessions of every directory's graphs, a stage each directory (a large
    export's graphs take seconds to load)."""
    sessions: dict[Path, Any] = {}
    for label, d in zip(labels, decoders, strict=True):
        graphs = {d.prefill, d.decode}
        with progress.stage(f"load {label}", total=len(graphs)) as stage:
            for graph in graphs:
                sessions[graph] = ort_session(graph, threads=threads, spinning=False)
                stage.advance()
    return sessions


def _with_adapter(decoders: list[DecoderDir], adapter: Path | None) -> list[DecoderDir]:
    """``--adapter FILE``: after each kiln export with LoRA slots, the same graphs with the adapter
    bound (checked against that export's slots first), timed beside the rank-0 row."""
    if adapter is None:
        return decoders
    slotted = [d for d in decoders if d.manifest is not None and d.manifest.lora is not None and d.target is None]
    if not slotted:
        raise BenchError(
            f"--adapter {adapter}: no directory given is a kiln export with LoRA slots (kiln export --lora-slots RANK)"
        )
    for d in slotted:
        assert d.manifest is not None
        read_adapter_file(adapter, d.manifest.lora, f"--adapter {adapter} for {d.path}")
    out = []
    for d in decoders:
        out += [d, dataclasses.replace(d, adapter=adapter)] if any(d is s for s in slotted) else [d]
    return out


def _measure(
    decoders: list[DecoderDir],
    labels: list[str],
    calls: dict[str, dict[str, Callable[[], object]]],
    sessions: dict[Path, Any],
    sizes: dict[str, Sizes],
    options: BenchOptions,
    progress: Progress,
) -> dict[str, Any]:
    """The interleaved runs of every row (and the bandwidth probe, the sweep) into the result."""
    seq, past = sizes["prefill"].seq, sizes["decode"].past
    for label, d in zip(labels, decoders, strict=True):
        for kind, graph in (("prefill", d.prefill), ("decode", d.decode)):
            calls[kind][label] = Timed(d, sessions[graph], sizes[kind], vocab_of(sessions[graph], d))
    load_before = os.getloadavg()[0]
    probe = BandwidthProbe(options.threads) if options.roofline else None
    if probe is not None:  # timed among the decode steps, under the same load as they are
        calls["decode"][_PROBE] = probe
    what = {"prefill": f"prefill (seq {seq})", "decode": f"decode step (past {past})"}  # as the table's columns
    seconds: dict[str, dict[str, list[float]]] = {}
    for kind, row_calls in calls.items():
        seconds[kind] = interleaved_seconds(
            row_calls, options.runs, options.pause_s, progress=progress, what=what[kind]
        )
    probe_seconds = seconds["decode"].pop(_PROBE) if probe is not None else []
    rows = {kind: medians_ms(s) for kind, s in seconds.items()}
    result = _header(decoders, labels, sizes, options, rows, load_before)
    if probe is not None:
        result.update(_roofline(probe, probe_seconds, result["directories"], rows["decode"], options, progress))
    if options.sweep:
        from kiln.runtime.sweep import sweep

        result["sweep"] = sweep(decoders, labels, sessions, options, progress)
    return result


def _header(
    decoders: list[DecoderDir],
    labels: list[str],
    sizes: dict[str, Sizes],
    options: BenchOptions,
    rows: dict[str, dict[str, float]],
    load_before: float,
) -> dict[str, Any]:
    """The result's directories, sizes, settings and median times."""
    return {
        "directories": [
            {
                "label": lab,
                "path": str(d.path),
                "tool": d.tool,
                "prefill_graph": d.prefill.name,
                "decode_graph": d.decode.name,
                "shared_kv_buffer": d.shared_kv_buffer,
                "weights_bytes_per_step": weights_bytes_per_step(d.decode),
            }
            for lab, d in zip(labels, decoders, strict=True)
        ],
        "baseline": labels[0],
        "batch": 1,
        "prefill_seq": sizes["prefill"].seq,
        "decode_past": sizes["decode"].past,
        "threads": options.threads,
        "runs": options.runs,
        "median_ms": rows,
        "load_average": [load_before, os.getloadavg()[0]],  # 1-minute, before and after: how shared the machine was
        "cores": os.cpu_count() or 1,
        "tools": manifest_mod.tool_versions(),
    }


def _roofline(
    probe: BandwidthProbe,
    probe_seconds: list[float],
    directories: list[dict[str, Any]],
    decode_ms: dict[str, float],
    options: BenchOptions,
    progress: Progress,
) -> dict[str, Any]:
    """The memory read bandwidth (interleaved with the decode steps, then alone) and each row's
    decode step as a fraction of its weights' read time at that bandwidth."""
    with progress.stage("memory read bandwidth alone", total=options.runs) as stage:
        alone = probe.alone(options.runs, options.pause_s, stage)
    probe.close()
    bandwidth, best = read_bandwidths(probe.nbytes, probe_seconds, alone)
    return {
        "read_bandwidth_gb_s": bandwidth / 1e9,  # median, interleaved: the roofline's denominator
        "read_bandwidth_best_gb_s": best / 1e9,  # fastest call, interleaved or alone: >= the median
        "roofline": {
            e["label"]: (e["weights_bytes_per_step"] / bandwidth * 1e3) / decode_ms[e["label"]] for e in directories
        },
    }


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def render(result: dict[str, Any]) -> str:
    """A markdown table: medians, ratios to the baseline (< 1: faster), roofline fraction."""
    pre, dec = result["median_ms"]["prefill"], result["median_ms"]["decode"]
    base = result["baseline"]
    roof = result.get("roofline", {})
    weights = {e["label"]: e["weights_bytes_per_step"] for e in result["directories"]}
    warning = (
        load_warning(result["load_average"], result["cores"])
        if "load_average" in result and "cores" in result
        else None
    )
    lines = [warning] if warning else []
    lines.append(
        f"batch 1, {result['threads']} threads, median of {result['runs']} interleaved runs; ratios: time / time "
        f"of {base}"
        + (" (load average {:.1f} -> {:.1f})".format(*result["load_average"]) if "load_average" in result else "")
    )
    if "pytorch" in result:
        lines.append(
            f"{TORCH}: {result['pytorch']['threads']} threads, "
            f"OMP_WAIT_POLICY={result['pytorch']['omp_wait_policy']}, in a worker process (as ONNX Runtime: no "
            "spinning)"
        )
    if "read_bandwidth_gb_s" in result:
        lines.append(_bandwidth_line(result))
    lines += [
        "",
        f"| backend | prefill (seq {result['prefill_seq']}) ms | vs base | decode step (past "
        f"{result['decode_past']}) ms | vs base | weights MB/step | roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in pre:
        w = f"{weights[name] / 1e6:.1f}" if name in weights else "-"
        r = f"{roof[name]:.0%}" if name in roof else "-"
        lines.append(
            f"| {name} | {pre[name]:.2f} | {pre[name] / pre[base]:.2f}x | {dec[name]:.2f} | "
            f"{dec[name] / dec[base]:.2f}x | {w} | {r} |"
        )
    lines += [
        "",
        "weights MB/step: the bytes of initializers one decode step reads: every weight whole (quantized ones "
        "with their scales), a table"
        " read only at the step's tokens or positions (the embedding, RotaryEmbedding's cos/sin caches) by the "
        "rows it reads",
    ]
    if "sweep" in result:
        from kiln.runtime.sweep import render_sweep

        lines += ["", render_sweep(result["sweep"])]
    return "\n".join(lines)


def _bandwidth_line(result: dict[str, Any]) -> str:
    """The probe's figures, each named: the median the roofline divides by, and the fastest call
    of all (``read_bandwidths``: never below the median; "best alone", the best of 15 calls in a
    row after the runs, had printed below it)."""
    runs = result["runs"]
    best = result.get("read_bandwidth_best_gb_s")
    median = result["read_bandwidth_gb_s"]
    text = f"memory read bandwidth: median {median:.1f} GB/s over {runs} calls interleaved with the decode steps"
    if best is not None:
        text += f", best {best:.1f} GB/s (the fastest of those and {runs} calls alone)"
    return text + "; roofline = (weights bytes per step / median bandwidth) / decode step"


def require_new_results(paths: Sequence[Path], directories: Sequence[Path], force: bool) -> None:
    """The files ``kiln bench`` will write (``--out``, the sweep plot): never inside a directory
    it times (an export's ``reports/parity.json`` was overwritten, and its plot beside it), and
    an existing file only with ``--force``, and never a link (``--force`` wrote through one into the
    file it led to; ``kiln adapter --out`` refuses one the same way); refused in one line before
    anything is timed."""
    from kiln.exporter.artifacts.staging import require_new_file

    for path in paths:
        require_new_file(path, force, directories, "write the result outside it")
        if path.is_symlink():
            link = f"a link (to {os.readlink(path)})"
            raise ConfigError(f"{path}: --force replaces only a file, and this is {link}; nothing was replaced")


def write_result(result: dict[str, Any], path: Path) -> Path:
    """``--out``: the result as JSON, whole or as it was (``newfile.new_output``: a link put at
    ``path`` after ``require_new_results`` is replaced, never written through)."""
    from kiln.newfile import new_output

    path.parent.mkdir(parents=True, exist_ok=True)
    with new_output(path) as staged:
        staged.write_text(json.dumps(result, indent=2) + "\n")
    return path


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Around the writing of ``path`` (``--out``, the sweep plot: through ``newfile.new_output``,
    whole or absent): an ``OSError`` there (a full disk) is one ``BenchError`` naming the file."""
    from kiln.exporter.artifacts.staging import cannot_write

    try:
        yield
    except OSError as exc:  # its file name is new_output's temporary: the message names the file asked for
        unwritten = cannot_write(path, OSError(exc.errno, exc.strerror))
        raise BenchError(f"{unwritten}; {path.name} was not written") from None
