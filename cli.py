"""The ``kiln`` command line: parses options into frozen configs and calls one API function each.

A ``KilnError`` becomes one line on stderr and exit code 1; anything else is a bug and keeps
its traceback. SIGINT and SIGTERM are handled alike (``kiln.interrupts``): whatever was being
written is removed and one line says so.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kiln import __version__
from kiln.errors import KilnError
from kiln.interrupts import Interrupted
from kiln.interrupts import install as install_interrupts

F = TypeVar("F", bound=Callable[..., Any])

# PyTorch's CPU threads (libgomp, read once when torch loads) spin after every parallel region
# unless told otherwise; on a machine busy with other work that made an export's PyTorch
# reference 5x slower (0.5B fp32 at load 6 on 2 cores: 173 s spinning, 32 s passive). The CLI
# imports torch only later, so this still takes effect; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _reports_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        install_interrupts()
        try:
            return func(*args, **kwargs)
        except KilnError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
            click.echo(f"interrupted ({signal.Signals(signum).name}): nothing was written", err=True)
            sys.exit(128 + signum)

    return typing.cast(F, wrapper)


def _progress(as_json: bool) -> Any:
    from kiln.exporter.progress import LineProgress, RichProgress, Timed

    if as_json:
        return Timed(LineProgress(stages=False))  # stdout is the JSON; a note (cleaned-up leftovers...) still goes to stderr
    return Timed(RichProgress() if sys.stderr.isatty() else LineProgress())  # a log file gets lines that neither wrap nor redraw


@click.group()
@click.version_option(__version__, prog_name="kiln")
def main() -> None:
    """kiln: PyTorch decoder checkpoints to ONNX graphs with KV cache, checked for parity."""


@main.command()
@click.option("--model", "model", default="demo", show_default=True, help="Checkpoint directory (config.json + model.safetensors), a Hugging Face repo id ORG/NAME already in the local Hugging Face cache (kiln never downloads), or 'demo'.")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Output directory (written whole, or not at all).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True, help="Largest batch the graphs and engines must serve.")
@click.option("--max-context", type=click.IntRange(min=2), default=None, help="Longest context (past + new tokens). Default: the model's limit.")
@click.option("--logits", type=click.Choice(["all", "last"]), default="all", show_default=True, help="Prefill logits for every position, or the last one only.")
@click.option("--opset", type=int, default=19, show_default=True, help="ONNX opset (18-23).")
@click.option("--ple-extend", type=click.IntRange(min=2), default=None, help="Build PLE tables with N rows (for contexts longer than the trained table).")
@click.option("--ple-extend-mode", type=click.Choice(["clamp", "interpolate"]), default="clamp", show_default=True, help="With --ple-extend: clamp = positions past the trained table reuse its last row; interpolate = the trained table stretched linearly over N rows (position interpolation).")
@click.option("--ple-tables", type=click.Choice(["constant", "input"]), default="constant", show_default=True, help="Folded PLE tables as constants or as graph inputs.")
@click.option("--fp16", is_flag=True, help="fp16 weights, activations and KV cache, with fp32 islands (norm statistics, softmax, rotary angles, logits).")
@click.option("--keep-fp32", "keep_fp32", multiple=True, metavar="OP_TYPE|NODE_NAME", help="Also keep these op types, node names (/layers.0.attn/MatMul) or modules (/layers.0.mlp.fc2/, *.fc2: the nodes of exactly that module) in fp32. Repeatable.")
@click.option("--auto-keep-fp32", is_flag=True, help="With --fp16: search (bisection on ONNX Runtime) for modules that must stay fp32 for parity, and keep them.")
@click.option("--int8", is_flag=True, help="int8 Q/DQ before MatMul/Gemm inputs (weights per channel, activations per tensor), calibrated on --calib-data; with --fp16 the rest is fp16.")
@click.option("--calib-data", default=None, metavar="PATH|synthetic", help="Calibration data: a text file, .jsonl (field 'text'), .npy/.npz token ids, or 'synthetic' (random tokens: poor ranges).")
@click.option("--calib-samples", type=click.IntRange(min=1), default=None, help="Calibration windows of 128 tokens (each: a prefill and teacher-forced decode steps). Default: 32, 256 for --int4-method gptq.")
@click.option("--calib-method", type=click.Choice(["max", "percentile", "entropy", "mse"]), default="max", show_default=True, help="How an activation range is chosen from the calibration samples: max = the largest value seen; percentile = --calib-percentile of the values; entropy = least KL divergence; mse = least int8 quantization error.")
@click.option("--calib-percentile", type=float, default=99.99, show_default=True, help="With --calib-method percentile: the percentile of the absolute activation values taken as the range.")
@click.option("--calib-cache", type=click.Path(path_type=Path, file_okay=False), default=None, help="Directory of cached calibration ranges. Default: ~/.cache/kiln/calibration.")
@click.option("--int8-float", "int8_float", multiple=True, metavar="RULE", help="Also keep these nodes/modules/op types in float (rules as for --keep-fp32). Repeatable.")
@click.option("--int8-all-matmuls", is_flag=True, help="Quantize the LM head and attention-score MatMuls too (kept in float by default).")
@click.option("--int4", is_flag=True, help="Weight-only int4 MatMul weights (symmetric blocks along K: DequantizeLinear at opset 21; with --target ort also MatMulNBits, the same numbers); with --fp16 the rest is fp16.")
@click.option("--int4-block", type=click.Choice(["16", "32", "64", "128", "256"]), default="128", show_default=True, help="int4 block size along K (a weight whose K it does not divide gets the largest smaller power of two that does).")
@click.option("--int4-method", type=click.Choice(["rtn", "gptq"]), default="gptq", show_default=True, help="rtn = round to nearest (no data); gptq = GPTQ with a clip search on --calib-data (measured better).")
@click.option("--int4-float", "int4_float", multiple=True, metavar="RULE", help="Also keep these nodes/modules/op types in float under --int4 (rules as for --keep-fp32). Repeatable.")
@click.option("--int4-all-matmuls", is_flag=True, help="Quantize the LM head to int4 too (kept in float by default).")
@click.option("--fp8", is_flag=True, help="fp8 E4M3 Q/DQ before MatMul inputs (weights per channel, activations per tensor from --calib-data), the rest fp16: for TensorRT on Ada/Hopper and later.")
@click.option("--fp8-float", "fp8_float", multiple=True, metavar="RULE", help="Also keep these nodes/modules/op types fp16 under --fp8 (rules as for --keep-fp32: /layers.0.mlp.fc2/, *.q_proj). Repeatable.")
@click.option("--target", "target", type=click.Choice(["portable", "ort"]), default="portable", show_default=True, help="ort: also write ONNX Runtime-target graphs (onnx/*.ort.onnx: GroupQueryAttention, RotaryEmbedding, SimplifiedLayerNormalization), parity-checked like the portable ones.")
@click.option("--ort-int8", is_flag=True, help="With --target ort: the ORT-target graphs use weight-only int8 MatMulNBits (no calibration data); the portable graphs keep their precision.")
@click.option("--parity-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Greedy tokens generated by the parity check.")
@click.option("--triton", "triton", default=None, metavar="NAME", help="Also write a Triton model repository (DIR/triton/NAME).")
@click.option("--force", is_flag=True, help="Replace the output directory if it holds an earlier kiln export (anything else is refused, nothing deleted).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary instead of progress bars.")
@_reports_errors
def export(model: str, out: Path, as_json: bool, **flags: Any) -> None:
    """Export a checkpoint to prefill/decode/unified ONNX graphs and check their parity."""
    options = _export_options(flags)
    _preflight(model, out, options)
    from kiln.exporter.pipeline import export as run_export  # torch and onnxruntime from here on

    progress = _progress(as_json)
    result = run_export(model, out, options, progress)
    manifest = result.manifest
    if as_json:
        parity = {**result.parity.to_dict(), **result.report.parity_extras()}
        stages = {name: round(seconds, 3) for name, seconds in progress.seconds.items()}  # wall seconds per stage, in order
        click.echo(json.dumps({"out": str(result.out), "stages": stages, "parity": parity, "manifest": manifest.to_json()}, indent=2))
        return
    from kiln.exporter.parity.report import verdict

    ort = (manifest.targets or {}).get("ort")
    extra = f" + {len(ort.graphs)} ONNX Runtime-target {ort.precision} graphs (onnx/*.ort.onnx)" if ort else ""
    weights = {manifest.weights.file} | {t.weights.file for t in (manifest.targets or {}).values()}
    files = "one weights file" if len(weights) == 1 else f"{len(weights)} weights files"
    report = result.out / Path(manifest.parity.report).with_suffix(".md")
    click.echo(f"wrote {result.out}: {len(manifest.graphs)} {manifest.precision} graphs{extra}, {files}; {verdict(result.parity)}; report {report}")


def _preflight(model: str, out: Path, options: Any) -> None:
    """The checks of bad input that need no torch: the answer comes before the heavy imports
    (the pipeline checks the same again)."""
    from kiln.exporter.artifacts.staging import require_replaceable
    from kiln.plugins import read_config, resolve_checkpoint

    checkpoint = resolve_checkpoint(model)
    require_replaceable(out.absolute(), options.force, inputs=(checkpoint, *options.data_inputs))
    read_config(checkpoint)


def _export_options(flags: dict[str, Any]) -> Any:
    """``ExportOptions`` from ``kiln export``'s flags (named after its fields; the enums by value)."""
    from kiln.errors import ConfigError
    from kiln.exporter.options import ExportOptions, Int4Method, LogitsMode, PLEExtendMode, PLETables, Precision, Target

    enums: dict[str, Any] = {"logits": LogitsMode, "ple_extend_mode": PLEExtendMode, "ple_tables": PLETables, "target": Target}
    fp16, int8, int4, fp8 = flags.pop("fp16"), flags.pop("int8"), flags.pop("int4"), flags.pop("fp8")
    fields = {name: enums[name](value) if name in enums else value for name, value in flags.items()}
    fields["calib_cache"] = (fields["calib_cache"] or Path.home() / ".cache" / "kiln" / "calibration") if int8 or fp8 else None
    fields["int4_block"] = int(fields["int4_block"])
    fields["int4_method"] = Int4Method(fields["int4_method"])
    precision = Precision.of(fp16=fp16, int8=int8, int4=int4, fp8=fp8)
    if not int4 and (flags["int4_method"] != "gptq" or flags["int4_block"] != "128"):
        raise ConfigError("--int4-method and --int4-block only apply to --int4 exports")
    return ExportOptions(precision=precision, **fields)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the families as JSON.")
@_reports_errors
def plugins(as_json: bool) -> None:
    """List the model families kiln finds (built in and from the kiln.plugins entry points)."""
    from kiln.plugins import families

    # a family may list what it exports in a table (rows of strings, the header first) and say
    # why it cannot load here (a missing optional dependency): the optional methods of ModelFamily
    found: list[dict[str, Any]] = [
        {
            "name": f.name, "description": f.description, "module": type(f).__module__, "table": getattr(f, "table", list)(),
            "unavailable": getattr(f, "unavailable", lambda: None)(),
        }
        for f in families()
    ]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    for family in found:
        click.echo(f"{family['name']:<10} {family['description']}  [{family['module']}]")
        if family["unavailable"]:
            click.echo(f"           {family['unavailable']}")
        widths = [max(len(row[i]) for row in family["table"]) for i in range(len(family["table"][0]))] if family["table"] else []
        for row in family["table"]:
            click.echo("    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--model", "model", default=None, help="Checkpoint to compare against (default: the one in the manifest).")
@click.option("--backend", type=click.Choice(["onnxruntime", "trt"]), default="onnxruntime", show_default=True, help="Check the ONNX graphs on ONNX Runtime, or the engines of kiln build on TensorRT.")
@click.option("--verbose", is_flag=True, help="Print the whole parity report (Markdown: every tensor and generation run) instead of the table per graph set.")
@click.option("--json", "as_json", is_flag=True, help="Print the parity report as JSON.")
@_reports_errors
def check(directory: Path, model: str | None, backend: str, verbose: bool, as_json: bool) -> None:
    """Re-run tensor and generation parity of an export directory against PyTorch: a table per
    graph set and a closing verdict (--verbose: every check)."""
    from kiln.errors import ParityError
    from kiln.exporter.check import check_dir
    from kiln.exporter.parity.report import markdown, summary_table, verdict

    result = check_dir(directory, model, _progress(as_json), backend="tensorrt" if backend == "trt" else "onnxruntime")
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        checks = f"{len(result.tensors)} tensors and {len(result.generation)} generation runs"
        click.echo(markdown(result) if verbose else f"{directory}: {result.backend} vs PyTorch, {checks}\n\n" + "\n".join(summary_table(result)) + "\n")
        click.echo(verdict(result) + ("" if verbose else f" (every check: kiln check {directory} --verbose)"))
    if not result.passed:
        raise ParityError(f"{directory}: " + "; ".join(result.failures()[:5]))


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_reports_errors
def verify(directory: Path, as_json: bool) -> None:
    """Recompute every sha256 in the manifest; exit 0 only when every file matches."""
    from kiln.exporter.artifacts.verify import verify_dir

    result = verify_dir(directory)
    if as_json:
        click.echo(json.dumps({"ok": result.ok, "checked": result.checked, "problems": result.problems()}, indent=2))
    elif result.ok:
        click.echo(f"{directory}: all {result.checked} files match manifest.json")
    else:
        click.echo(f"{directory}: {len(result.problems())} differences from manifest.json:")
        for problem in result.problems():
            click.echo(f"  {problem}")
    if not result.ok:
        sys.exit(1)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--name", "name", required=True, help="Triton model name (letters, digits, '_', '.', '-'); engines become NAME_prefill and NAME_decode.")
@click.option("--json", "as_json", is_flag=True, help="Print the files written as JSON.")
@_reports_errors
def triton(directory: Path, name: str, as_json: bool) -> None:
    """Write DIR/triton/, a Triton model repository for a verified export (replacing an earlier one
    kiln wrote, whatever its model name: the output says which models it replaced)."""
    from kiln.exporter.serving import write_triton_repo
    from kiln.exporter.serving.triton import repository_models

    earlier = repository_models(directory)
    written = write_triton_repo(directory, name)
    models = repository_models(directory)
    replaced = [m for m in earlier if m not in models]
    if as_json:
        click.echo(json.dumps({"repository": str(directory / "triton"), "files": [str(p) for p in written], "replaced_models": replaced}, indent=2))
        return
    click.echo(f"wrote {directory / 'triton'}: {len(written)} files" + (f", replacing the earlier repository's {', '.join(replaced)}" if replaced else ""))
    for path in written:
        click.echo(f"  {path.relative_to(directory)}")
    click.echo(f"({name}/1/model.onnx/ is a folder: Triton's ONNX Runtime backend loads a graph with external weights from a directory holding both)")


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--workspace", default="4G", show_default=True, help="Size of TensorRT's workspace memory pool (e.g. 4G, 512M).")
@click.option("--opt-level", type=click.IntRange(0, 5), default=3, show_default=True, help="Builder optimization level: 0 builds fastest, 5 searches longest.")
@click.option("--timing-cache", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Timing cache file, loaded if it exists and saved back. Default: DIR/engines/timing.cache.")
@click.option("--hardware-compat", type=click.Choice(["none", "ampere+", "same-cc"]), default="none", show_default=True, help="Which GPUs the engines may run on: none = only the GPU model they were built on (fastest); same-cc = any GPU of the same compute capability; ampere+ = any GPU of compute capability 8.0 or newer (slower).")
@click.option("--version-compatible", is_flag=True, help="Engines that also run on later TensorRT versions (may be slower).")
@click.option("--refittable", is_flag=True, help="Engines whose weights can be replaced without a rebuild.")
@click.option("--opt-batch", type=click.IntRange(min=1), default=None, help="Batch size TensorRT tunes for. Default: 1.")
@click.option("--opt-context", type=click.IntRange(min=1), default=None, help="Context (past + new tokens) TensorRT tunes for. Default: max_context / 2.")
@click.option("--json", "as_json", is_flag=True, help="Print the engines record as JSON.")
@_reports_errors
def build(
    directory: Path,
    workspace: str,
    opt_level: int,
    timing_cache: Path | None,
    hardware_compat: str,
    version_compatible: bool,
    refittable: bool,
    opt_batch: int | None,
    opt_context: int | None,
    as_json: bool,
) -> None:
    """Build the TensorRT engines of an export directory (engines/prefill.plan, engines/decode.plan).

    engines/trtexec.sh, the equivalent trtexec commands, is written first, also where TensorRT is not installed."""
    from kiln.exporter.engine import BuildOptions, HardwareCompat, build_command, parse_size

    options = BuildOptions(
        workspace=parse_size(workspace),
        opt_level=opt_level,
        timing_cache=timing_cache,
        hardware_compat=HardwareCompat(hardware_compat),
        version_compatible=version_compatible,
        refittable=refittable,
        opt_batch=opt_batch,
        opt_context=opt_context,
    )
    try:
        result = build_command(directory, options)
    except KilnError as exc:
        if as_json:  # a script reading stdout gets JSON either way; stderr keeps the one line
            click.echo(json.dumps({"directory": str(directory), "built": False, "error": str(exc)}, indent=2))
        raise
    if as_json:
        click.echo(json.dumps({"built": True, **result}, indent=2))
        return
    engines = list(result["engines"].values())
    click.echo(
        f"wrote {', '.join(e['file'] for e in engines)} in {directory} (TensorRT {engines[0]['tensorrt']}, {engines[0]['gpu']}, "
        f"compute capability {engines[0]['compute_capability']}); record in {result['record']}, trtexec commands in {result['trtexec']}"
    )


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, found {value!r}") from None
    if not out or min(out) < 0:
        raise click.BadParameter(f"expected non-negative integers, found {value!r}")
    return out


@main.command()
@click.argument("directories", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--compare", "compare", multiple=True, type=click.Path(path_type=Path), help="Also time this ONNX decoder directory (Optimum's model.onnx, GenAI builder output, another kiln export). Repeatable.")
@click.option("--prefill-seq", type=click.IntRange(min=1), default=128, show_default=True, help="Prompt length of the timed prefill (capped at the export's context limit).")
@click.option("--past", type=click.IntRange(min=1), default=256, show_default=True, help="Past length of the decode step.")
@click.option("--runs", type=click.IntRange(min=3), default=30, show_default=True, help="Timed runs per measurement (median reported).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Threads of every timed backend (ONNX Runtime's intra-op pool and PyTorch's).")
@click.option("--sweep", callback=_int_list, default=None, metavar="P1,P2,...", help="Also time the decode step at these past lengths; fits ms per 1k past tokens.")
@click.option("--sweep-runs", type=click.IntRange(min=3), default=15, show_default=True, help="Runs per sweep point up to past 512 (fewer beyond).")
@click.option("--no-torch", is_flag=True, help="No PyTorch eager row (for directories without a loadable checkpoint).")
@click.option("--no-roofline", is_flag=True, help="Skip the memory-bandwidth measurement.")
@click.option("--out", "out", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Write the JSON result here (and the sweep plot beside it, .png).")
@click.option("--plot", "plot", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Where to write the sweep plot (default: --out with .png).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of tables.")
@_reports_errors
def bench(
    directories: tuple[Path, ...],
    compare: tuple[Path, ...],
    prefill_seq: int,
    past: int,
    runs: int,
    threads: int,
    sweep: tuple[int, ...],
    sweep_runs: int,
    no_torch: bool,
    no_roofline: bool,
    out: Path | None,
    plot: Path | None,
    as_json: bool,
) -> None:
    """Prefill and decode-step latency at batch 1 on ONNX Runtime CPU, interleaved: kiln export
    directories and --compare peers side by side (ratios vs the first), PyTorch eager, the
    roofline fraction of each decode step, and optionally a past-length sweep with a plot."""
    from kiln.runtime.bench import BenchOptions, render, run_bench

    options = BenchOptions(
        prefill_seq=prefill_seq, past=past, runs=runs, threads=threads, torch=not no_torch,
        roofline=not no_roofline, sweep=sweep, sweep_runs=sweep_runs,
    )
    result = run_bench([*directories, *compare], options)
    plot = plot if plot is not None else out.with_suffix(".png") if out is not None else None
    if "sweep" in result and plot is not None:
        from kiln.runtime.sweep import plot_sweep

        result["sweep"]["plot"] = str(plot_sweep(result["sweep"], plot))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result, indent=2) if as_json else render(result))


def _escapes(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``\\n``, ``\\t`` and ``\\\\`` as typed in a shell, turned into a newline, a tab and a backslash."""
    import re

    table = {"n": "\n", "t": "\t", "\\": "\\"}
    return tuple(re.sub(r"\\([nt\\])", lambda m: table[m.group(1)], v) for v in value)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Text to continue (tokenized with the export's tokenizer.json).")
@click.option("--ids", default=None, metavar="ID,ID,...", help="Token ids to continue, instead of --prompt.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Tokens to generate at most (fewer when the end-of-sequence token or --stop comes first).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@click.option("--stop", "stops", multiple=True, metavar="STRING", callback=_escapes, help="End the text before the first occurrence of STRING (not included; \\n is a newline, \\t a tab, \\\\ a backslash). Repeatable.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="Sample from softmax(logits / T), T finite; 0 is greedy (argmax), what parity checks; a T below 1e-5 is taken as 1e-5 (greedy in effect).")
@click.option("--top-k", type=int, default=0, show_default=True, help="With --temperature: sample among the K most likely tokens only (0, the default: among all of them).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="With --temperature: sample among the most likely tokens whose probabilities add up to P, in (0, 1] (1: all).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="Make tokens of the prompt and of the text so far less likely: positive logits / R, negative ones * R (1: off).")
@click.option("--seed", type=int, default=None, help="Seed of the sampling: the same seed gives the same text (default: a fresh one each run).")
@click.option("--target", type=click.Choice(["ort"]), default=None, help="Run the export's --target ort graphs (their decode step writes the KV cache in place).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="ONNX Runtime intra-op threads.")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and speeds as JSON (nothing streamed).")
@_reports_errors
def generate(directory: Path, prompt: str | None, ids: str | None, as_json: bool, **flags: Any) -> None:
    """Generate text through an export's prefill + decode graphs on ONNX Runtime (IOBinding: the KV
    cache stays in OrtValues between steps), greedy or sampled; streams the text, then tokens/s."""
    from kiln.runtime.generate import GenerateOptions, generate_command
    from kiln.runtime.sampling import SamplingOptions

    sampling = SamplingOptions(*(flags.pop(k) for k in ("temperature", "top_k", "top_p", "repetition_penalty", "seed")))
    options = GenerateOptions(
        max_new_tokens=flags["max_new_tokens"], stop_at_eos=not flags["ignore_eos"], stops=flags["stops"], sampling=sampling,
        target=flags["target"], threads=flags["threads"],
    )
    if as_json:
        click.echo(json.dumps(generate_command(directory, prompt, ids, options), indent=2))
        return
    shown = [prompt or ""]  # the prompt, echoed once the generation is under way (not before an error)

    def stream(piece: str) -> None:
        click.echo(shown.pop() + piece if shown else piece, nl=False)  # click.echo flushes: each piece shows as it comes

    summary = generate_command(directory, prompt, ids, options, on_text=stream)
    click.echo(shown.pop() if shown else "")
    click.echo(
        f"prefill: {len(summary['prompt_ids'])} tokens at {summary['prefill_tokens_per_s']:.1f} tokens/s; "
        f"decode: {len(summary['tokens']) - 1} tokens at {summary['decode_tokens_per_s']:.1f} tokens/s "
        f"({summary['kv_cache']} KV cache; {summary['finish_reason']})",
        err=True,
    )


if __name__ == "__main__":
    main()
