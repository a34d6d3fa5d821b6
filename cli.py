"""The ``kiln`` command line: parses options into frozen configs and calls one API function each.

A ``KilnError`` becomes one line on stderr and exit code 1; anything else is a bug and keeps
its traceback. SIGINT and SIGTERM are handled alike (``kiln.interrupts``): whatever was being
written is removed and one line says so (or, after a commit, what was written), with exit code
128 + the signal's number, whatever exception the signal surfaced as.
"""

from __future__ import annotations

from kiln.interrupts import hold_if_program

hold_if_program(__name__)  # before the imports below: a signal there is raised when the command starts, not inside one

import functools
import gc
import json
import os
import signal
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kiln import __version__, cli_options, interrupts
from kiln.cli_options import options
from kiln.errors import KilnError
from kiln.inputs import size_text

F = TypeVar("F", bound=Callable[..., Any])

# PyTorch's CPU threads (libgomp, read once when torch loads) spin after every parallel region
# unless told otherwise; on a machine busy with other work that made an export's PyTorch
# reference 5x slower (0.5B fp32 at load 6 on 2 cores: 173 s spinning, 32 s passive). The CLI
# imports torch only later, so this still takes effect; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _reports_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            interrupts.install()  # raises a signal held since the imports
            return func(*args, **kwargs)
        except (KeyboardInterrupt, Exception) as exc:
            interrupts.finish()  # a second signal must not interrupt the line below
            _exit_for(exc)
        finally:
            interrupts.finish()
            _freeze_objects()  # the process exits next

    return typing.cast(F, wrapper)


def _freeze_objects() -> None:
    """The CLI's process: every object alive now is moved out of the cyclic garbage collector's sight
    (``gc.freeze``). Called after a command's heavy imports (torch, transformers, onnxruntime: millions of objects
    that live to the exit, which every full collection walked again) and when the command is over (the
    interpreter's finalization collects several times: 0.8 s of a tiny export's 6.8 s here). Never an object a
    stage frees: only what exists before the checkpoint is read (a frozen cycle is never collected). A test or
    a library caller imports the CLI and runs command after command: nothing is frozen there."""
    if interrupts.is_program():
        gc.freeze()


def _exit_for(exc: BaseException) -> typing.NoReturn:
    """One line on stderr and the exit status for what ended a command: a signal's (128 + its number) whatever it
    surfaced as (an ImportError from a module it cut short, the error of a worker process it ended), a KilnError's
    (1), ONNX Runtime's report of memory it could not allocate (1, ``ort_memory``); anything else is a bug and keeps
    its traceback."""
    signum = exc.signum if isinstance(exc, interrupts.Interrupted) else interrupts.received()
    if signum is None and isinstance(exc, KeyboardInterrupt):
        signum = signal.SIGINT
    if signum is not None:
        click.echo(interrupts.message(signum), err=True)
        sys.exit(128 + signum)
    if isinstance(exc, KilnError):
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    from kiln.exporter.runners.ort_memory import allocation_failure, memory_error

    if allocation_failure(exc):  # an ONNX Runtime run outside OrtRunner (kiln generate, kiln bench)
        click.echo(f"error: {memory_error(exc, 'a graph')}", err=True)
        sys.exit(1)
    raise exc


def _progress(as_json: bool) -> Any:
    from kiln.exporter.progress import LineProgress, RichProgress, Timed

    if as_json:
        return Timed(
            LineProgress(stages=False)
        )  # stdout is the JSON; a note (cleaned-up leftovers...) still goes to stderr
    return Timed(
        RichProgress() if sys.stderr.isatty() else LineProgress()
    )  # a log file gets lines that neither wrap nor redraw


@click.group()
@click.version_option(__version__, prog_name="kiln")
def main() -> None:
    """kiln: PyTorch decoder checkpoints to ONNX graphs with KV cache, checked for parity."""


@main.command()
@options(*cli_options.EXPORT)
@_reports_errors
def export(model: str, out: Path, as_json: bool, **flags: Any) -> None:
    """Export a checkpoint to prefill/decode/unified ONNX graphs and check their parity."""
    planned = _export_plan(flags)
    _preflight(model, out, planned.options)
    from kiln.exporter.pipeline import export as run_export  # torch and onnxruntime from here on

    _freeze_objects()  # before the checkpoint is read

    progress = _progress(as_json)
    result = run_export(model, out, planned, progress)  # planned: the options' round is not asked again
    manifest = result.manifest
    if as_json:
        parity = {**result.parity.to_dict(), **result.report.parity_extras()}
        stages = {
            name: round(seconds, 3) for name, seconds in progress.seconds.items()
        }  # wall seconds per stage, in order
        click.echo(
            json.dumps(
                {"out": str(result.out), "stages": stages, "parity": parity, "manifest": manifest.to_json()}, indent=2
            )
        )
        return
    from kiln.exporter.parity.report import verdict

    extra = "".join(_target_summary(name, entry) for name, entry in (manifest.targets or {}).items())
    report = result.out / Path(manifest.parity.report).with_suffix(".md")
    click.echo(
        f"wrote {result.out}: {len(manifest.graphs)} {manifest.precision} graphs{extra}, "
        f"{_weights_summary(manifest)}; {verdict(result.parity)}; report {report}"
    )


def _weights_summary(manifest: Any) -> str:
    """``one weights file (12.3 MB)``, or each file with its size: a target's own weights file adds to the
    export's size, which the line says rather than leaves to be found (``--target ort``: +57% at 0.5B)."""
    files = {manifest.weights.file: manifest.weights.bytes} | {
        t.weights.file: t.weights.bytes for t in (manifest.targets or {}).values()
    }
    if len(files) == 1:
        return f"one weights file ({size_text(manifest.weights.bytes)})"
    return (
        f"{len(files)} weights files (" + " + ".join(f"{file} {size_text(size)}" for file, size in files.items()) + ")"
    )


def _target_summary(name: str, entry: Any) -> str:
    """`` + 3 ONNX Runtime-target fp32 graphs (onnx/*.ort.onnx)``: a target's part of the export's last line."""
    from kiln.exporter.targets import target

    files = [Path(g.file) for g in entry.graphs.values()]
    suffixes = {f.name.partition(".")[2] for f in files}
    where = f" ({files[0].parent.as_posix()}/*.{suffixes.pop()})" if len(suffixes) == 1 else ""
    return f" + {len(files)} {target(name).label} {entry.precision} graphs{where}"


def _preflight(model: str, out: Path, options: Any) -> None:
    """The checks of bad input that need no torch: the answer comes before the heavy imports
    (the pipeline checks the same again)."""
    from kiln.exporter.artifacts.staging import require_replaceable
    from kiln.plugins import read_config, resolve_checkpoint

    checkpoint = resolve_checkpoint(model)
    require_replaceable(out.absolute(), options.force, inputs=(checkpoint, *options.data_inputs))
    read_config(checkpoint)


def _export_plan(flags: dict[str, Any]) -> Any:
    """The ``ExportPlan`` of ``kiln export``'s flags (``ExportOptions.from_flags``; the enums
    by value; the precision kinds' flags by ``Precision.chosen``): every refusal of the options
    alone asked (``exporter.plan``) before any heavy import; the pipeline asks the model's rounds."""
    from kiln.errors import ConfigError
    from kiln.exporter.options import Adapter, ExportOptions, LogitsMode, PLEExtendMode, PLETables, Precision
    from kiln.exporter.plan import SEPARATOR, plan
    from kiln.exporter.precision.kinds.base import Needs

    enums: dict[str, Any] = {"logits": LogitsMode, "ple_extend_mode": PLEExtendMode, "ple_tables": PLETables}
    precision, stray = Precision.chosen(flags)  # a kind's flags without it: reported by the plan with the rest
    target_flags = _target_flags(flags)
    fields = {name: enums[name](value) if name in enums else value for name, value in flags.items()}
    fields["calib_cache"] = (
        (fields["calib_cache"] or Path.home() / ".cache" / "kiln" / "calibration")
        if precision.needs(Needs.RANGES)
        else None
    )
    fields["adapters"] = tuple(Adapter(path, weight) for path, weight in fields["adapters"])
    try:
        options = ExportOptions.from_flags(precision=precision, target_flags=target_flags, **fields)
    except ConfigError as exc:  # values wrong on their own: reported with the kinds' stray flags
        raise ConfigError(SEPARATOR.join([*stray, *exc.args])) from None
    return plan(options, given=stray)


def _target_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Each target's own flags (``Target.flags``), taken out of ``flags``: those given, by field."""
    from kiln.exporter.targets import targets

    declared = [flag for each in targets() for flag in each.flags]
    values = {flag: flags.pop(flag.dest) for flag in declared}
    given = {flag: value for flag, value in values.items() if flag.given(value)}
    return {flag.field: flag.convert(value) if flag.convert is not None else value for flag, value in given.items()}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the families as JSON.")
@_reports_errors
def plugins(as_json: bool) -> None:
    """List the model families kiln finds (built in and from the kiln.plugins entry points), and
    what each exports per precision and target, fitted to the terminal (--json: all of it)."""
    import shutil

    from kiln.listing import entry, render
    from kiln.plugins import families

    found = [entry(f) for f in families()]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    for line in render(found, shutil.get_terminal_size().columns):  # COLUMNS, the terminal, else 80
        click.echo(line)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@options(cli_options.CHECK)
@_reports_errors
def check(
    directory: Path,
    model: str | None,
    backend: str,
    parity_device: str,
    verbose: bool,
    adapter: Path | None,
    calib_data: Path | None,
    as_json: bool,
) -> None:
    """Re-run tensor and generation parity of an export directory against PyTorch: a table per
    graph set and a closing verdict (--verbose: every check)."""
    from kiln.errors import ParityError
    from kiln.exporter.check import check_dir
    from kiln.exporter.parity.report import markdown, summary_table, verdict
    from kiln.exporter.parity.summary import shown_failures

    result = check_dir(
        directory,
        model,
        _progress(as_json),
        backend="tensorrt" if backend == "trt" else "onnxruntime",
        adapter=adapter,
        parity_device=parity_device,
        calib_data=calib_data,
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        parts = [
            result,
            *([result.quantized] if result.quantized is not None else []),
        ]  # an int4 export: against both references
        checks = (
            f"{sum(len(r.tensors) for r in parts)} tensors and {sum(len(r.generation) for r in parts)} generation runs"
        )
        click.echo(
            markdown(result)
            if verbose
            else f"{directory}: {result.backend} vs PyTorch, {checks}\n\n" + "\n".join(summary_table(result)) + "\n"
        )
        click.echo(verdict(result) + ("" if verbose else f" (every check: kiln check {directory} --verbose)"))
    if not result.passed:
        raise ParityError(f"{directory}: " + "; ".join(shown_failures(result.failure_records())))
    if result.quality is not None and not result.quality.passed:
        raise ParityError(
            f"{directory}: the quantization fell short of the export's quality gate: {result.quality.figures()} "
            f"(at least {result.quality.threshold:g})"
        )


@main.command()
@click.argument("adapter_dir", metavar="DIR", type=click.Path(path_type=Path))
@options(cli_options.ADAPTER)
@_reports_errors
def adapter(adapter_dir: Path, directory: Path, out: Path | None, no_check: bool, force: bool, as_json: bool) -> None:
    """Convert a PEFT LoRA adapter directory into an adapter file for an export's LoRA slots
    (kiln export --lora-slots), after checking the export's graphs fed it against PEFT's model."""
    from kiln.exporter.adapter import convert_adapter
    from kiln.exporter.parity.report import verdict

    result = convert_adapter(directory, adapter_dir, out, force=force, check=not no_check, progress=_progress(as_json))
    summary = {
        "file": str(result.path),
        "modules": list(result.modules),
        "rank": result.rank,
        "parity": result.parity.to_dict() if result.parity is not None else None,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    if result.parity is not None:
        click.echo(verdict(result.parity))
    click.echo(
        f"wrote {result.path}: rank {result.rank} on {len(result.modules)} modules (kiln generate {directory} "
        f"--adapter {result.path})"
    )


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_reports_errors
def verify(directory: Path, as_json: bool) -> None:
    """Recompute every sha256 in the manifest; exit 0 only when every file matches."""
    from kiln.exporter.artifacts.verify import verify_dir

    result = verify_dir(directory)
    if result.leftovers:  # kiln's own, not the export's: said once, on stderr
        left = ", ".join(result.leftovers)
        click.echo(
            f"{directory}: not checked: {left}, left by an interrupted kiln triton (the next one removes them)",
            err=True,
        )
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
@click.option(
    "--name",
    "name",
    required=True,
    help="Triton model name (letters, digits, '_', '.', '-'); engines become NAME_prefill and NAME_decode.",
)
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
        click.echo(
            json.dumps(
                {
                    "repository": str(directory / "triton"),
                    "files": [str(p) for p in written],
                    "replaced_models": replaced,
                },
                indent=2,
            )
        )
        return
    click.echo(
        f"wrote {directory / 'triton'}: {len(written)} files"
        + (f", replacing the earlier repository's {', '.join(replaced)}" if replaced else "")
    )
    for path in written:
        click.echo(f"  {path.relative_to(directory)}")
    click.echo(
        f"({name}/1/model.onnx/ is a folder: Triton's ONNX Runtime backend loads a graph with external weights "
        "from a directory holding both)"
    )
    copied = sum(path.stat().st_size for path in written if path.suffix == ".bin")
    if copied:
        click.echo(
            f"(its weights are a copy of the export's: {size_text(copied)} more on disk, unless the filesystem "
            "shares their blocks: btrfs, XFS)"
        )


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@options(cli_options.BUILD)
@_reports_errors
def build(directory: Path, workspace: str, hardware_compat: str, graphs: str, as_json: bool, **flags: Any) -> None:
    """Build the TensorRT engines of an export directory (engines/prefill.plan, engines/decode.plan;
    from the --target onnx graphs, engines/prefill.std.plan and engines/decode.std.plan).

    engines/trtexec.sh, the equivalent trtexec commands, is written first, also where TensorRT is not installed."""
    from kiln.exporter.engine import BuildOptions, GraphSet, HardwareCompat, build_command, parse_size

    options = BuildOptions(
        workspace=parse_size(workspace),
        hardware_compat=HardwareCompat(hardware_compat),
        graphs=GraphSet(graphs),
        **flags,
    )  # the rest named as BuildOptions' fields
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
        f"wrote {', '.join(e['file'] for e in engines)} in {directory} from the {result['graphs']['set']} graphs "
        f"({result['graphs']['reason']}; "
        f"TensorRT {engines[0]['tensorrt']}, {engines[0]['gpu']}, compute capability "
        f"{engines[0]['compute_capability']}); "
        f"record in {result['record']}, trtexec commands in {result['trtexec']}"
    )


@main.command()
@click.argument("directories", nargs=-1, required=True, type=click.Path(path_type=Path))
@options(cli_options.BENCH)
@_reports_errors
def bench(
    directories: tuple[Path, ...],
    compare: tuple[Path, ...],
    no_torch: bool,
    no_roofline: bool,
    out: Path | None,
    plot: Path | None,
    force: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Prefill and decode-step latency at batch 1 on ONNX Runtime CPU, interleaved: kiln export
    directories and --compare peers side by side (ratios vs the first), PyTorch eager, the
    roofline fraction of each decode step, and optionally a past-length sweep with a plot."""
    from kiln.runtime.bench import BenchOptions, render, require_new_results, run_bench, write_result, writing

    options = BenchOptions(
        torch=not no_torch, roofline=not no_roofline, **flags
    )  # the rest named as BenchOptions' fields
    plot = plot if plot is not None else out.with_suffix(".png") if out is not None else None
    require_new_results(
        [p for p in (out, plot if options.sweep else None) if p is not None], [*directories, *compare], force
    )  # before the timing
    result = run_bench([*directories, *compare], options, _progress(as_json))  # stages on stderr, as export's
    if "sweep" in result and plot is not None:
        from kiln.runtime.sweep import plot_sweep

        with writing(plot):
            result["sweep"]["plot"] = str(plot_sweep(result["sweep"], plot))
    if out is not None:
        with writing(out):
            write_result(result, out)
    click.echo(json.dumps(result, indent=2) if as_json else render(result))


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@options(cli_options.GENERATE)
@_reports_errors
def generate(directory: Path, prompt: str | None, ids: str | None, as_json: bool, **flags: Any) -> None:
    """Generate text through an export's prefill + decode graphs on ONNX Runtime (IOBinding: the KV
    cache stays in OrtValues between steps), greedy or sampled; streams the text, then tokens/s."""
    from kiln.runtime.generate import GenerateOptions, generate_command
    from kiln.runtime.sampling import SamplingOptions

    sampling = SamplingOptions(*(flags.pop(k) for k in ("temperature", "top_k", "top_p", "repetition_penalty", "seed")))
    options = GenerateOptions(
        max_new_tokens=flags["max_new_tokens"],
        stop_at_eos=not flags["ignore_eos"],
        stops=flags["stops"],
        sampling=sampling,
        target=flags["target"],
        threads=flags["threads"],
        adapter=flags["adapter"],
    )
    features = flags["features"]  # a speech encoder-decoder's input (runtime.features)
    if as_json:
        click.echo(json.dumps(generate_command(directory, prompt, ids, options, features=features), indent=2))
        return
    shown = [prompt or ""]  # the prompt, echoed once the generation is under way (not before an error)

    def stream(piece: str) -> None:
        click.echo(
            shown.pop() + piece if shown else piece, nl=False
        )  # click.echo flushes: each piece shows as it comes

    summary = generate_command(directory, prompt, ids, options, on_text=stream, features=features)
    click.echo(shown.pop() if shown else "")
    click.echo(
        f"prefill: {len(summary['prompt_ids'])} tokens at {summary['prefill_tokens_per_s']:.1f} tokens/s; "
        f"decode: {len(summary['tokens']) - 1} tokens at {summary['decode_tokens_per_s']:.1f} tokens/s "
        f"({summary['kv_cache']} KV cache; {summary['finish_reason']})",
        err=True,
    )


if __name__ == "__main__":
    main()
