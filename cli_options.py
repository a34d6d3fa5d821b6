"""The options of kiln's commands, grouped by concern (``cli.py`` applies them): ``kiln export``'s
source, graph shape, each precision's, calibration, target and output options; those of check,
build, bench and generate. Every option here is documented in docs/commands.md."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kiln.exporter.contract.limits import MAX_BATCH, MAX_CONTEXT, MAX_LORA_RANK, MIN_CONTEXT
from kiln.exporter.option_groups import ParityOptions
from kiln.exporter.targets import PORTABLE
from kiln.exporter.targets import names as target_names
from kiln.registry import Flag

__all__ = ["EXPORT", "CHECK", "BUILD", "BENCH", "GENERATE", "options"]

F = TypeVar("F", bound=Callable[..., Any])
Option = Callable[[Any], Any]  # a click.option decorator


def options(*groups: list[Option]) -> Callable[[F], F]:
    """Apply every option of ``groups`` in order (the first listed is the first in --help)."""

    def apply(func: F) -> F:
        for option in reversed([o for group in groups for o in group]):
            func = option(func)
        return func

    return apply


def _targets_help() -> str:
    from kiln.exporter.targets import target

    return (
        "portable: the portable graphs only; "
        + "; ".join(f"{name}: {target(name).description}" for name in target_names())
        + "."
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


def _escapes(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``\\n``, ``\\t`` and ``\\\\`` as typed in a shell, turned into a newline, a tab and a backslash."""
    table = {"n": "\n", "t": "\t", "\\": "\\"}
    return tuple(re.sub(r"\\([nt\\])", lambda m: table[m.group(1)], v) for v in value)


def _escape(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """One value's ``_escapes`` (``--prompt`` reads escapes as ``--stop`` does)."""
    return None if value is None else _escapes(ctx, param, (value,))[0]


def _adapters(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[tuple[Path, float], ...]:
    """``DIR`` or ``DIR:WEIGHT`` -> (directory, weight): the text after the last ':' is the weight
    when it is a number (a directory whose name ends in ':<number>' takes an explicit ':1')."""
    out = []
    for text in value:
        head, sep, tail = text.rpartition(":")
        try:
            out.append((Path(head), float(tail)) if sep and head else (Path(text), 1.0))
        except ValueError:
            out.append((Path(text), 1.0))
    return tuple(out)


# kiln export: what is read and where it goes
SOURCE: list[Option] = [
    click.option(
        "--model",
        "model",
        required=True,
        help="Checkpoint directory (config.json + model.safetensors), a Hugging Face repo id ORG/NAME already in the "
        "local Hugging Face cache (kiln never downloads), or 'demo' (the bundled demo model: named, never a "
        "default).",
    ),
    click.option(
        "--adapter",
        "adapters",
        multiple=True,
        metavar="DIR[:WEIGHT]",
        callback=_adapters,
        help="A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) merged into the Hugging "
        "Face checkpoint's weights before export, with WEIGHT (default 1): W + WEIGHT * scaling * B @ A per "
        "module; parity runs against PEFT's own model of base + adapters. Repeatable (a weighted sum, as PEFT's "
        "add_weighted_adapter with combination_type='cat').",
    ),
    click.option(
        "--out",
        "out",
        type=click.Path(path_type=Path),
        required=True,
        help="Output directory (written whole, or not at all).",
    ),
    click.option(
        "--lora-targets",
        "lora_targets",
        callback=lambda ctx, param, value: tuple(v for v in (value or "").split(",") if v),
        default=None,
        metavar="NAME,NAME,...",
        help="With --lora-slots: slots on these modules only (their names, as PEFT's target_modules: q_proj,v_proj); "
        "fewer slots, fewer nodes per step. Default: every Linear but the output head.",
    ),
    click.option(
        "--lora-slots",
        "lora_slots",
        type=click.IntRange(1, MAX_LORA_RANK),
        default=None,
        metavar="RANK",
        help="Swappable LoRA adapters: every Linear but the output head takes optional adapter inputs of rank up to "
        "RANK (nothing fed: the base model); kiln adapter converts a PEFT adapter for them. fp32/fp16 portable "
        "graphs of Hugging Face decoders.",
    ),
]

# kiln export: the graphs' shape and contract
GRAPHS: list[Option] = [
    click.option(
        "--max-batch",
        type=click.IntRange(1, MAX_BATCH),
        default=8,
        show_default=True,
        help="Largest batch the graphs and engines must serve.",
    ),
    click.option(
        "--max-context",
        type=click.IntRange(MIN_CONTEXT, MAX_CONTEXT),
        default=None,
        help="Longest context (past + new tokens). Default: the model's limit.",
    ),
    click.option(
        "--logits",
        type=click.Choice(["all", "last"]),
        default="all",
        show_default=True,
        help="Prefill logits for every position, or the last one only.",
    ),
    click.option("--opset", type=int, default=19, show_default=True, help="ONNX opset (18-23)."),
    click.option(
        "--ple-extend",
        type=click.IntRange(min=2),
        default=None,
        help="Build PLE tables with N rows (for contexts longer than the trained table).",
    ),
    click.option(
        "--ple-extend-mode",
        type=click.Choice(["clamp", "interpolate"]),
        default="clamp",
        show_default=True,
        help="With --ple-extend: clamp = positions past the trained table reuse its last row; interpolate = the "
        "trained table stretched linearly over N rows (position interpolation).",
    ),
    click.option(
        "--ple-tables",
        type=click.Choice(["constant", "input"]),
        default="constant",
        show_default=True,
        help="Folded PLE tables as constants or as graph inputs.",
    ),
]


# kiln export: each precision kind's --NAME and its own options (``exporter.precision.kinds``)
def _kind_options() -> list[Option]:
    from kiln.exporter.precision.kinds.registry import kinds

    out: list[Option] = []
    for kind in kinds():
        out.append(click.option(kind.flag(), kind.name, is_flag=True, help=kind.help))
        out += [_flag_option(flag) for group in kind.flags for flag in group]
    return out


def _flag_option(flag: Flag) -> Option:
    """The click option of a flag a kind or a target declares (``kiln.registry.Flag``)."""
    if flag.is_flag:
        return click.option(flag.option, flag.dest, is_flag=True, help=flag.help)
    if flag.choices:
        choices = click.Choice(flag.choices)
        return click.option(
            flag.option, flag.dest, type=choices, default=flag.default, show_default=True, help=flag.help
        )
    return click.option(flag.option, flag.dest, multiple=flag.multiple, metavar=flag.metavar, help=flag.help)


PRECISION: list[Option] = _kind_options()

# kiln export: calibration data (int8 and fp8 ranges, GPTQ's Hessians)
CALIBRATION: list[Option] = [
    click.option(
        "--calib-data",
        default=None,
        metavar="PATH|synthetic",
        help="Calibration data: a text file, .jsonl (field 'text'), .npy/.npz token ids, or 'synthetic' (random "
        "tokens: poor ranges).",
    ),
    click.option(
        "--calib-samples",
        type=click.IntRange(min=1),
        default=None,
        help="Calibration windows of 128 tokens (each: a prefill and teacher-forced decode steps). Default: 32, 256 "
        "for --int4-method gptq.",
    ),
    click.option(
        "--calib-method",
        type=click.Choice(["max", "percentile", "entropy", "mse"]),
        default="max",
        show_default=True,
        help="How an activation range is chosen from the calibration samples: max = the largest value seen; "
        "percentile = --calib-percentile of the values; entropy = least KL divergence; mse = least int8 "
        "quantization error.",
    ),
    click.option(
        "--calib-percentile",
        type=float,
        default=99.99,
        show_default=True,
        help="With --calib-method percentile: the percentile of the absolute activation values taken as the range.",
    ),
    click.option(
        "--calib-cache",
        type=click.Path(path_type=Path, file_okay=False),
        default=None,
        help="Directory of cached calibration ranges. Default: ~/.cache/kiln/calibration.",
    ),
]


# kiln export: targets (exporter.targets): --target, then each target's own flags
def _target_options() -> list[Option]:
    from kiln.exporter.targets import targets

    names = click.Choice([PORTABLE, *target_names()])
    choice = click.option("--target", "target", type=names, default=PORTABLE, show_default=True, help=_targets_help())
    return [choice, *(_flag_option(flag) for each in targets() for flag in each.flags)]


TARGET: list[Option] = _target_options()

_PARITY_DEVICE = click.option(
    "--parity-device",
    "parity_device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where parity's PyTorch reference, its ONNX Runtime sessions and GPTQ run: cuda (torch's GPU and "
    "onnxruntime-gpu's CUDAExecutionProvider), cpu, or auto (cuda when both are there, else cpu). The default "
    "stays cpu until the CUDA path has run on a GPU (docs/parity.md). TensorRT engines are unchanged.",
)

# kiln export: parity, serving and the output directory
OUTPUT: list[Option] = [
    click.option(
        "--parity-tokens",
        type=click.IntRange(min=1),
        default=ParityOptions.tokens,
        show_default=True,
        help="Greedy tokens generated by the parity check, each verified against PyTorch at its prefix (more: a "
        "longer proof at a cost per token; docs/parity.md, How many tokens).",
    ),
    _PARITY_DEVICE,
    click.option(
        "--parity-agreement",
        type=click.Choice(["gate", "record"]),
        default=None,
        help="--int4: the graphs always meet their float precision's tolerances against PyTorch on the quantizer's "
        "own int4 numbers; their agreement with the checkpoint's model on random prompts (cosine, tokens) is "
        "recorded in the report and the manifest (record, the default: quality is judged on real text, "
        "--quality-gate) or gates the export too (gate).",
    ),
    click.option(
        "--eval-data",
        type=click.Path(path_type=Path),
        default=None,
        metavar="FILE",
        help="UTF-8 text the graphs' quantization quality is measured on against the checkpoint's model (top-1 "
        "agreement, KL, perplexities; 2048 tokens). Default: the demo's held-out text for the demo, else the "
        "--calib-data, else random tokens (recorded, not judged).",
    ),
    click.option(
        "--quality-gate",
        default="auto",
        show_default=True,
        metavar="auto|off|AGREEMENT",
        help="On real text, the top-1 agreement a quantized export must reach: auto (per precision: docs/parity.md), "
        "off (recorded only), or a figure in (0, 1].",
    ),
    click.option(
        "--triton",
        "triton",
        default=None,
        metavar="NAME",
        help="Also write a Triton model repository (DIR/triton/NAME).",
    ),
    click.option(
        "--force",
        is_flag=True,
        help="Replace the output directory if it holds an earlier kiln export (anything else is refused, nothing "
        "deleted).",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary instead of progress bars."),
]


EXPORT = [SOURCE, GRAPHS, PRECISION, CALIBRATION, TARGET, OUTPUT]

# kiln check
CHECK: list[Option] = [
    click.option(
        "--model", "model", default=None, help="Checkpoint to compare against (default: the one in the manifest)."
    ),
    click.option(
        "--backend",
        type=click.Choice(["onnxruntime", "trt"]),
        default="onnxruntime",
        show_default=True,
        help="Check the ONNX graphs on ONNX Runtime, or the engines of kiln build on TensorRT.",
    ),
    _PARITY_DEVICE,
    click.option(
        "--verbose",
        is_flag=True,
        help="Print the whole parity report (Markdown: every tensor and generation run) instead of the table per "
        "graph set.",
    ),
    click.option(
        "--adapter",
        "adapter",
        type=click.Path(path_type=Path),
        default=None,
        metavar="DIR",
        help="An export with --lora-slots: check its graphs fed this PEFT adapter (as kiln adapter converts it) "
        "against PEFT's model of the checkpoint and the adapter.",
    ),
    click.option(
        "--calib-data",
        "calib_data",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        metavar="FILE",
        help="The export's calibration data (int8, fp8, int4 GPTQ; never read from the manifest's path): the "
        "calibration runs again over it, its token windows hashing as recorded, to check the Q/DQ scales or int4 "
        "weights. Without it that is skipped, but for 'synthetic' data and the demo's bundled text.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print the parity report as JSON."),
]

# kiln adapter
ADAPTER: list[Option] = [
    click.option(
        "--export",
        "directory",
        type=click.Path(path_type=Path),
        required=True,
        help="The kiln export (with --lora-slots) the adapter is for.",
    ),
    click.option(
        "--out",
        "out",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="The adapter file to write. Default: beside the adapter directory, DIR.onnx_adapter.",
    ),
    click.option(
        "--no-check", is_flag=True, help="Skip parity against PEFT's model (kiln check --adapter runs it later)."
    ),
    click.option("--force", is_flag=True, help="Replace an existing adapter file."),
    click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
]

# kiln build
BUILD: list[Option] = [
    click.option(
        "--workspace", default="4G", show_default=True, help="Size of TensorRT's workspace memory pool (e.g. 4G, 512M)."
    ),
    click.option(
        "--opt-level",
        type=click.IntRange(0, 5),
        default=3,
        show_default=True,
        help="Builder optimization level: 0 builds fastest, 5 searches longest.",
    ),
    click.option(
        "--timing-cache",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="Timing cache file, loaded if it exists and saved back. Default: DIR/engines/timing.cache.",
    ),
    click.option(
        "--hardware-compat",
        type=click.Choice(["none", "ampere+", "same-cc"]),
        default="none",
        show_default=True,
        help="Which GPUs the engines may run on: none = only the GPU model they were built on (fastest); same-cc = "
        "any GPU of the same compute capability; ampere+ = any GPU of compute capability 8.0 or newer (slower).",
    ),
    click.option(
        "--version-compatible", is_flag=True, help="Engines that also run on later TensorRT versions (may be slower)."
    ),
    click.option("--refittable", is_flag=True, help="Engines whose weights can be replaced without a rebuild."),
    click.option(
        "--opt-batch", type=click.IntRange(min=1), default=None, help="Batch size TensorRT tunes for. Default: 1."
    ),
    click.option(
        "--opt-context",
        type=click.IntRange(min=1),
        default=None,
        help="Context (past + new tokens) TensorRT tunes for. Default: max_context / 2.",
    ),
    click.option(
        "--graphs",
        type=click.Choice(["auto", "portable", "onnx"]),
        default="auto",
        show_default=True,
        help="Which graphs to build: onnx = the --target onnx graphs (onnx/*.std.onnx: Attention, a static KV cache "
        "written in place; TensorRT 10.15+); "
        "portable = onnx/*.onnx (any TensorRT); auto = onnx where the export has them and TensorRT is 10.15+, "
        "else portable.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print the engines record as JSON."),
]

# kiln bench
BENCH: list[Option] = [
    click.option(
        "--compare",
        "compare",
        multiple=True,
        type=click.Path(path_type=Path),
        help="Also time this ONNX decoder directory (Optimum's model.onnx, GenAI builder output, another kiln "
        "export). Repeatable.",
    ),
    click.option(
        "--prefill-seq",
        type=click.IntRange(min=1),
        default=128,
        show_default=True,
        help="Prompt length of the timed prefill (capped at the export's context limit).",
    ),
    click.option(
        "--past", type=click.IntRange(min=1), default=256, show_default=True, help="Past length of the decode step."
    ),
    click.option(
        "--runs",
        type=click.IntRange(min=3),
        default=30,
        show_default=True,
        help="Timed runs per measurement (median reported).",
    ),
    click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=2,
        show_default=True,
        help="Threads of every timed backend (ONNX Runtime's intra-op pool and PyTorch's).",
    ),
    click.option(
        "--sweep",
        callback=_int_list,
        default=None,
        metavar="P1,P2,...",
        help="Also time the decode step at these past lengths; fits ms per 1k past tokens.",
    ),
    click.option(
        "--sweep-runs",
        type=click.IntRange(min=3),
        default=15,
        show_default=True,
        help="Runs per sweep point up to past 512 (fewer beyond).",
    ),
    click.option(
        "--adapter",
        "adapter",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        metavar="FILE",
        help="An adapter file of kiln adapter: every export with LoRA slots is also timed with it active, beside its "
        "rank-0 row.",
    ),
    click.option(
        "--no-torch", is_flag=True, help="No PyTorch eager row (for directories without a loadable checkpoint)."
    ),
    click.option("--no-roofline", is_flag=True, help="Skip the memory-bandwidth measurement."),
    click.option(
        "--out",
        "out",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="Write the JSON result here (and the sweep plot beside it, .png).",
    ),
    click.option(
        "--plot",
        "plot",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="Where to write the sweep plot (default: --out with .png).",
    ),
    click.option("--force", is_flag=True, help="Replace an existing --out (and plot) file."),
    click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of tables."),
]

# kiln generate
GENERATE: list[Option] = [
    click.option(
        "--prompt",
        default=None,
        callback=_escape,
        help="Text to continue (tokenized with the export's tokenizer.json; as --stop, \\n is a newline, \\t a tab, "
        "\\\\ a backslash).",
    ),
    click.option("--ids", default=None, metavar="ID,ID,...", help="Token ids to continue, instead of --prompt."),
    click.option(
        "--features",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        metavar="FILE.npy",
        help="A speech encoder-decoder's (Whisper's) log-mel input_features [n_mels, frames] (.npy, float): "
        "transcribed from the decoder's start token, or from the prefix --ids gives (language/task tokens).",
    ),
    click.option(
        "--max-new-tokens",
        type=int,
        default=32,
        show_default=True,
        help="Tokens to generate at most (fewer when the end-of-sequence token or --stop comes first).",
    ),
    click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token."),
    click.option(
        "--stop",
        "stops",
        multiple=True,
        metavar="STRING",
        callback=_escapes,
        help="End the text before the first occurrence of STRING (not included; \\n is a newline, \\t a tab, \\\\ a "
        "backslash). Repeatable.",
    ),
    click.option(
        "--temperature",
        type=float,
        default=0.0,
        show_default=True,
        help="Sample from softmax(logits / T), T finite; 0 is greedy (argmax), what parity checks; a T below 1e-5 is "
        "taken as 1e-5 (greedy in effect).",
    ),
    click.option(
        "--top-k",
        type=int,
        default=0,
        show_default=True,
        help="With --temperature: sample among the K most likely tokens only (0, the default: among all of them).",
    ),
    click.option(
        "--top-p",
        type=float,
        default=1.0,
        show_default=True,
        help="With --temperature: sample among the most likely tokens whose probabilities add up to P, in (0, 1] (1: "
        "all).",
    ),
    click.option(
        "--repetition-penalty",
        type=float,
        default=1.0,
        show_default=True,
        help="Make tokens of the prompt and of the text so far less likely: positive logits / R, negative ones * R "
        "(1: off).",
    ),
    click.option(
        "--seed",
        type=int,
        default=None,
        help="Seed of the sampling: the same seed gives the same text (default: a fresh one each run).",
    ),
    click.option(
        "--target",
        type=click.Choice(target_names()),
        default=None,
        help="Run the export's graphs of this target instead of the portable ones (--target ort: its decode step "
        "writes the KV cache in place; --target onnx: every step writes into static buffers).",
    ),
    click.option(
        "--adapter",
        "adapter",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        metavar="FILE",
        help="An adapter file of kiln adapter, active for the whole generation (an export with --lora-slots).",
    ),
    click.option(
        "--threads", type=click.IntRange(min=1), default=2, show_default=True, help="ONNX Runtime intra-op threads."
    ),
    click.option("--json", "as_json", is_flag=True, help="Print tokens, text and speeds as JSON (nothing streamed)."),
]
