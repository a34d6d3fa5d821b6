"""engines/trtexec.sh: the exact trtexec command of each engine, and the no-TensorRT path of
``kiln build`` (writes the script, says in one line that TensorRT is missing)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import ArtifactError, ConfigError, EngineError
from kiln.exporter.artifacts import manifest as manifest_mod
from kiln.exporter.artifacts.verify import verify_dir
from kiln.exporter.contract.io import DECODER_KINDS, graph_io
from kiln.exporter.engine import BuildOptions, HardwareCompat, build_command
from kiln.exporter.engine.build import load_tensorrt
from kiln.exporter.engine.options import MIB, GraphSet
from kiln.exporter.engine.profiles import engine_profiles
from kiln.exporter.engine.trtexec import render_script, trtexec_args, trtexec_command, write_script
from kiln.plugins.native import spec_of
from kiln_testing import placeholder_export, tiny_config, typed_manifest, with_std_target


def manifest(max_batch: int = 8, max_context: int = 48, tables: tuple[tuple[int, int], ...] = ()) -> dict[str, Any]:
    spec = spec_of(tiny_config())
    graphs = {}
    for kind in DECODER_KINDS:
        io = graph_io(spec, kind, ple_tables=tables)
        graphs[kind.value] = {
            "file": f"onnx/{kind.value}.onnx",
            "inputs": [t.to_dict() for t in io.inputs],
            "outputs": [t.to_dict() for t in io.outputs],
        }
    return {
        "manifest_version": 2,
        "precision": "fp32",
        "limits": {"max_batch": max_batch, "max_context": max_context},
        "graphs": graphs,
    }


def export_dir(root: Path, m: dict[str, Any] | None = None) -> Path:
    """A directory that passes kiln verify: placeholder graphs and a manifest hashing them."""
    return placeholder_export(root / "export", m or manifest())


PREFILL = (
    "trtexec --onnx=onnx/prefill.onnx --saveEngine=engines/prefill.plan"
    " --minShapes=input_ids:1x1,attention_mask:1x1,position_ids:1x1"
    " --optShapes=input_ids:1x24,attention_mask:1x24,position_ids:1x24"
    " --maxShapes=input_ids:8x48,attention_mask:8x48,position_ids:8x48"
    " --timingCacheFile=engines/timing.cache --memPoolSize=workspace:4096M --builderOptimizationLevel=3"
    " --stronglyTyped --noTF32 --hardwareCompatibilityLevel=none --skipInference"
)
DECODE = (
    "trtexec --onnx=onnx/decode.onnx --saveEngine=engines/decode.plan"
    " --minShapes=input_ids:1x1,attention_mask:1x2,position_ids:1x1,past_key_values.0.key:1x2x1x8,"
    "past_key_values.0.value:1x2x1x8,past_key_values.1.key:1x2x1x8,past_key_values.1.value:1x2x1x8"
    " --optShapes=input_ids:1x1,attention_mask:1x24,position_ids:1x1,past_key_values.0.key:1x2x23x8,"
    "past_key_values.0.value:1x2x23x8,past_key_values.1.key:1x2x23x8,past_key_values.1.value:1x2x23x8"
    " --maxShapes=input_ids:8x1,attention_mask:8x48,position_ids:8x1,past_key_values.0.key:8x2x47x8,"
    "past_key_values.0.value:8x2x47x8,past_key_values.1.key:8x2x47x8,past_key_values.1.value:8x2x47x8"
    " --timingCacheFile=engines/timing.cache --memPoolSize=workspace:4096M --builderOptimizationLevel=3"
    " --stronglyTyped --noTF32 --hardwareCompatibilityLevel=none --skipInference"
)


def test_default_commands_exactly() -> None:
    prefill, decode = engine_profiles(typed_manifest(manifest()), BuildOptions())
    assert trtexec_command(prefill, BuildOptions()) == PREFILL
    assert trtexec_command(decode, BuildOptions()) == DECODE


def test_options_become_flags() -> None:
    prefill, _ = engine_profiles(typed_manifest(manifest()), BuildOptions())
    options = BuildOptions(
        workspace=512 * MIB,
        opt_level=5,
        hardware_compat=HardwareCompat.AMPERE_PLUS,
        version_compatible=True,
        refittable=True,
    )
    assert trtexec_args(prefill, options)[5:] == [
        "--timingCacheFile=engines/timing.cache",
        "--memPoolSize=workspace:512M",
        "--builderOptimizationLevel=5",
        "--stronglyTyped",
        "--noTF32",
        "--hardwareCompatibilityLevel=ampere+",
        "--versionCompatible",
        "--refit",
        "--skipInference",
    ]
    same_cc = trtexec_args(
        prefill, BuildOptions(hardware_compat=HardwareCompat.SAME_CC, workspace=3 * 1024 * 1024 + 1024)
    )
    assert "--hardwareCompatibilityLevel=sameComputeCapability" in same_cc
    assert "--memPoolSize=workspace:3073K" in same_cc


def test_ple_table_inputs_are_named_with_their_fixed_shape() -> None:
    _, decode = engine_profiles(typed_manifest(manifest(tables=((48, 32), (48, 32)))), BuildOptions())
    args = trtexec_args(decode, BuildOptions())
    for which in ("--minShapes=", "--optShapes=", "--maxShapes="):
        shapes = next(a for a in args if a.startswith(which))
        assert shapes.endswith(",ple.0.scale:48x32,ple.0.shift:48x32,ple.1.scale:48x32,ple.1.shift:48x32")


def test_unsafe_input_name_is_refused() -> None:
    m = manifest()
    m["graphs"]["prefill"]["inputs"][0]["name"] = "input:ids"
    prefill, _ = engine_profiles(typed_manifest(m), BuildOptions())
    with pytest.raises(ConfigError, match="cannot be written as a trtexec shape"):
        trtexec_args(prefill, BuildOptions())


def test_script_text() -> None:
    profiles = engine_profiles(typed_manifest(manifest()), BuildOptions())
    text = render_script(profiles, BuildOptions())
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines
    assert 'cd "$(dirname "$0")/.."' in lines
    assert any("--stronglyTyped is for TensorRT 10.x" in line for line in lines)
    assert any("no-op" in line for line in lines)
    commands = [line for line in text.replace(" \\\n  ", " ").splitlines() if line.startswith("trtexec")]
    assert commands == [PREFILL, DECODE]
    assert not [
        word for line in lines[1:] for word in line.split() if word.lstrip("-=").startswith("/") or "=/" in word
    ]  # no absolute paths
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_low_bit_scripts_are_the_same_commands_with_a_gpu_note() -> None:
    """int4/fp8 graphs carry their precision (Q/DQ): the same strongly typed commands, no
    precision flag; the script says which GPUs build them, and kiln build refuses others first."""
    from kiln.exporter.engine.gpus import require_gpu_for

    profiles = engine_profiles(typed_manifest(manifest()), BuildOptions())
    plain = render_script(profiles, BuildOptions())
    for precision, note in (
        (
            "fp8",
            "# fp8 graphs build on GPUs of compute capability 8.9 or later: Ada (L4, L40S, RTX 40) or Hopper "
            "(H100, H200) or later.",
        ),
        (
            "int4+fp16",
            "# int4+fp16 graphs build on GPUs of compute capability 8.0 or later: Ampere (A100, A10, RTX 30) or later.",
        ),
    ):
        text = render_script(profiles, BuildOptions(), precision=precision)
        assert note in text.splitlines() and text.replace(note + "\n", "") == plain
        assert not any(flag in text for flag in ("--fp8", "--int8", "--int4", "--fp16", "--best"))
    with pytest.raises(
        EngineError,
        match=r"fp8 engines need a GPU of compute capability 8.9 or later .*; this NVIDIA A100 is 8.0: export --fp16 "
        r"or --int8 for it",
    ):
        require_gpu_for("fp8", "8.0", "NVIDIA A100")
    require_gpu_for("fp8", "9.0", "NVIDIA H100")
    require_gpu_for("int4", "8.6", "NVIDIA A10")
    with pytest.raises(EngineError, match="int4 engines need a GPU of compute capability 8.0"):
        require_gpu_for("int4", "7.5", "Tesla T4")
    require_gpu_for("fp16", "7.5", "Tesla T4")


def test_written_script_is_executable_and_relative(tmp_path: Path) -> None:
    directory = export_dir(tmp_path)
    profiles = engine_profiles(typed_manifest(manifest()), BuildOptions())
    path = write_script(directory, profiles, BuildOptions(timing_cache=directory / "engines" / "tc.bin"))
    assert path == directory / "engines" / "trtexec.sh"
    assert os.stat(path).st_mode & stat.S_IXUSR
    text = path.read_text()
    assert "--timingCacheFile=engines/tc.bin" in text and str(directory) not in text
    outside = write_script(directory, profiles, BuildOptions(timing_cache=tmp_path / "shared.cache")).read_text()
    assert "--timingCacheFile=engines/timing.cache" in outside  # a cache outside DIR does not travel with it


def test_script_runs_from_the_export_directory(tmp_path: Path) -> None:
    """With a stand-in trtexec on PATH, the script calls it once per engine from DIR."""
    directory = export_dir(tmp_path)
    script = write_script(directory, engine_profiles(typed_manifest(manifest()), BuildOptions()), BuildOptions())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "trtexec"
    fake.write_text('#!/usr/bin/env bash\necho "$PWD $*" >> "$TRTEXEC_LOG"\n')
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TRTEXEC_LOG": str(log)}
    subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, check=True)
    calls = log.read_text().splitlines()
    assert calls == [f"{directory} {PREFILL[len('trtexec ') :]}", f"{directory} {DECODE[len('trtexec ') :]}"]


def _one_line_engine_error(exc: EngineError, *fragments: str) -> None:
    text = str(exc)
    assert "\n" not in text
    assert text.startswith("engine: TensorRT is not installed")
    for fragment in fragments:
        assert fragment in text


def test_a_timing_cache_among_the_exports_files_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--timing-cache naming a file of the export outside engines/ (its weights: TensorRT would
    replace an unreadable cache) is refused before anything is written; engines/ is fine."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    directory = export_dir(tmp_path)
    weights = directory / "onnx" / "weights.bin"
    before = weights.read_bytes()
    with pytest.raises(ConfigError) as refused:
        build_command(directory, BuildOptions(timing_cache=weights))
    assert (
        str(refused.value)
        == f"config: --timing-cache {weights}: inside the export but outside engines/, which is all kiln build "
        "writes; name a file in engines/ or outside the export"
    )
    assert weights.read_bytes() == before and not (directory / "engines").exists()
    with pytest.raises(EngineError, match="TensorRT is not installed") as inside:
        build_command(directory, BuildOptions(timing_cache=directory / "engines" / "tc.bin"))
    assert "--timingCacheFile=engines/tc.bin" in (directory / "engines" / "trtexec.sh").read_text()
    assert "timing cache" not in str(inside.value)  # the script uses the file named: nothing to say


def test_a_timing_cache_outside_the_export_is_said_to_be_replaced_in_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kiln build --timing-cache tc.bin wrote a script that uses engines/timing.cache instead, saying
    nothing (issue 39, item 7): the one line now says so and why."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    directory = export_dir(tmp_path)
    with pytest.raises(EngineError) as info:
        build_command(directory, BuildOptions(timing_cache=Path("tc.bin")))
    assert str(info.value).endswith(
        f"(wrote {directory / 'engines' / 'trtexec.sh'}; the script keeps its timing cache in "
        "engines/timing.cache, as --timing-cache tc.bin is outside the export it runs from)"
    )
    assert "--timingCacheFile=engines/timing.cache" in (directory / "engines" / "trtexec.sh").read_text()


def test_without_tensorrt_the_script_is_written_and_one_line_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    directory = export_dir(tmp_path)
    with pytest.raises(EngineError) as info:
        build_command(directory, BuildOptions())
    _one_line_engine_error(
        info.value,
        "pip install tensorrt",
        "NVIDIA GPU",
        "bash engines/trtexec.sh",
        str(directory / "engines" / "trtexec.sh"),
    )
    script = directory / "engines" / "trtexec.sh"
    assert script.is_file() and os.stat(script).st_mode & stat.S_IXUSR
    assert not (directory / "engines" / "prefill.plan").exists()
    result = verify_dir(directory)  # the manifest now records the script: kiln verify still passes
    assert result.ok, result.problems()
    assert "engines/trtexec.sh" in manifest_mod.read(directory).files
    with pytest.raises(EngineError) as again:  # and a second run over the same directory does the same
        build_command(directory, BuildOptions(opt_batch=2))
    _one_line_engine_error(again.value, "pip install tensorrt", "NVIDIA GPU", "bash engines/trtexec.sh")
    assert "--optShapes=input_ids:2x24" in script.read_text() and verify_dir(directory).ok


def test_type_stubs_alone_are_not_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """tensorrt-stubs installs tensorrt/__init__.pyi, which imports as an empty namespace package."""
    stub = types.ModuleType("tensorrt")
    stub.__path__ = ["/site-packages/tensorrt"]
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    with pytest.raises(EngineError) as info:
        load_tensorrt()
    _one_line_engine_error(info.value, "has no Builder", "pip install tensorrt")


def test_importing_the_package_does_not_import_tensorrt() -> None:
    code = (
        "import sys, kiln.exporter.engine, kiln.exporter.engine.runner, kiln.exporter.engine.build; assert "
        "'tensorrt' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_json_without_tensorrt_is_json_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kiln build --json prints JSON on stdout when it fails, beside the one-line error on stderr."""
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    directory = export_dir(tmp_path)
    result = CliRunner().invoke(main, ["build", str(directory), "--json"])
    assert result.exit_code == 1
    error = result.stderr.strip()
    assert "\n" not in error and error.startswith("error: engine: TensorRT is not installed")
    assert json.loads(result.stdout) == {"directory": str(directory), "built": False, "error": error[len("error: ") :]}
    result = CliRunner().invoke(
        main, ["build", str(tmp_path / "missing"), "--json"]
    )  # failing before any TensorRT step
    assert (
        result.exit_code == 1
        and json.loads(result.stdout)["error"] == f"artifacts: {tmp_path / 'missing'}: not a directory"
    )


def test_build_writes_only_into_an_engines_folder_kiln_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engines/ holding a file kiln did not write (not in the manifest, not one of kiln build's
    own names) is refused in one line naming it, and nothing is written or recorded."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    directory = export_dir(tmp_path)
    (directory / "engines" / "sub").mkdir(parents=True)
    (directory / "engines" / "notes.txt").write_text("mine")
    (directory / "engines" / "sub" / "my.plan").write_text("mine too")
    before = (directory / "manifest.json").read_text()
    with pytest.raises(ArtifactError) as info:
        build_command(directory, BuildOptions())
    assert str(info.value) == (
        f"artifacts: {directory / 'engines'}: kiln build writes only its own files in engines/, and "
        "manifest.json does not list"
        " engines/notes.txt, engines/sub/my.plan; nothing was deleted: move or remove it yourself"
    )
    assert sorted(p.name for p in (directory / "engines").iterdir()) == ["notes.txt", "sub"]
    assert (directory / "manifest.json").read_text() == before
    # what a killed build leaves (its own names, unrecorded) is kiln's: the build goes on (to the missing TensorRT)
    (directory / "engines" / "notes.txt").unlink()
    (directory / "engines" / "sub" / "my.plan").unlink()
    (directory / "engines" / "sub").rmdir()
    for name in ("prefill.plan", ".decode.plan.0123456789ab.kiln-tmp", "timing.cache"):
        (directory / "engines" / name).write_bytes(b"partial")
    with pytest.raises(EngineError, match="TensorRT is not installed"):
        build_command(directory, BuildOptions())
    assert {"engines/trtexec.sh", "engines/prefill.plan"} <= set(manifest_mod.read(directory).files)


# --- both graph sets: the portable graphs and --target onnx's (static cache), and the switch -------


def _kv(shape: str) -> str:
    return ",".join(f"past_key_values.{i}.{kv}:{shape}" for i in range(2) for kv in ("key", "value"))


STD_PREFILL = (
    "trtexec --onnx=onnx/prefill.std.onnx --saveEngine=engines/prefill.std.plan"
    f" --minShapes=input_ids:1x1,attention_mask:1x1,position_ids:1x1,{_kv('1x2x48x8')}"
    f" --optShapes=input_ids:1x24,attention_mask:1x24,position_ids:1x24,{_kv('1x2x48x8')}"
    f" --maxShapes=input_ids:8x48,attention_mask:8x48,position_ids:8x48,{_kv('8x2x48x8')}"
    " --timingCacheFile=engines/timing.cache --memPoolSize=workspace:4096M --builderOptimizationLevel=3"
    " --stronglyTyped --noTF32 --hardwareCompatibilityLevel=none --skipInference"
)
STD_DECODE = (
    "trtexec --onnx=onnx/decode.std.onnx --saveEngine=engines/decode.std.plan"
    f" --minShapes=input_ids:1x1,attention_mask:1x2,position_ids:1x1,write_indices:1,{_kv('1x2x48x8')}"
    f" --optShapes=input_ids:1x1,attention_mask:1x24,position_ids:1x1,write_indices:1,{_kv('1x2x48x8')}"
    f" --maxShapes=input_ids:8x1,attention_mask:8x48,position_ids:8x1,write_indices:8,{_kv('8x2x48x8')}"
    " --timingCacheFile=engines/timing.cache --memPoolSize=workspace:4096M --builderOptimizationLevel=3"
    " --stronglyTyped --noTF32 --hardwareCompatibilityLevel=none --skipInference"
)


def _both(options: BuildOptions | None = None) -> str:
    m = typed_manifest(with_std_target(manifest()))
    options = options or BuildOptions()
    return render_script(engine_profiles(m, options), options, std=engine_profiles(m, options, GraphSet.ONNX))


def test_std_script_holds_both_sets_and_a_switch() -> None:
    text = _both()
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    lines = text.splitlines()
    assert 'graphs="${KILN_GRAPHS:-auto}"' in lines and "if [[ $graphs == onnx ]]; then" in lines and lines[-1] == "fi"
    assert "  banner=$(trtexec --help 2>&1 || true)" in lines
    assert any(
        "auto) if (( version >= 101500 )); then graphs=onnx; else graphs=portable; fi ;;" in line for line in lines
    )
    flat = text.replace(" \\\n    ", " ").splitlines()
    commands = [line.strip() for line in flat if line.strip().startswith("trtexec --onnx")]
    assert commands == [
        STD_PREFILL,
        STD_DECODE,
        PREFILL,
        DECODE,
    ]  # the std set under `then`, the portable one under `else`
    assert 'graphs="${KILN_GRAPHS:-portable}"' in _both(BuildOptions(graphs=GraphSet.PORTABLE)).splitlines()
    assert 'graphs="${KILN_GRAPHS:-onnx}"' in _both(BuildOptions(graphs=GraphSet.ONNX)).splitlines()
    portable_only = render_script(engine_profiles(typed_manifest(manifest()), BuildOptions()), BuildOptions())
    assert (
        "KILN_GRAPHS" not in portable_only and "std" not in portable_only
    )  # an export without the target: today's script


def _fake_trtexec(root: Path, version: int | None) -> dict[str, str]:
    """A trtexec on PATH that prints the first line every trtexec prints (samples/common/logging.h)
    for ``--help`` and logs every other call."""
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    banner = (
        f"&&&& RUNNING TensorRT.trtexec [TensorRT v{version}] [b29] # trtexec --help"
        if version is not None
        else "trtexec of no known version"
    )
    fake = bin_dir / "trtexec"
    fake.write_text(
        f'#!/usr/bin/env bash\nif [[ $1 == --help ]]; then echo "{banner}"; echo "=== Model Options ==="; exit '
        '0; fi\necho "$*" >> "$TRTEXEC_LOG"\n'
    )
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TRTEXEC_LOG": str(root / "calls.log")}


@pytest.mark.parametrize(
    ("version", "graphs", "built"),
    [
        (101501, None, "std"),
        (110100, None, "std"),
        (101400, None, "portable"),
        (None, None, "portable"),
        (101400, "portable", "portable"),
        (110100, "portable", "portable"),
        (None, "onnx", "std"),
        (101600, "onnx", "std"),
    ],
)
def test_std_script_picks_by_trtexec_version(
    tmp_path: Path, version: int | None, graphs: str | None, built: str
) -> None:
    directory = export_dir(tmp_path, with_std_target(manifest()))
    m = manifest_mod.read(directory)
    script = write_script(
        directory, engine_profiles(m, BuildOptions()), BuildOptions(), engine_profiles(m, BuildOptions(), GraphSet.ONNX)
    )
    env = _fake_trtexec(tmp_path, version)
    if graphs is not None:
        env["KILN_GRAPHS"] = graphs
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    expected = [STD_PREFILL, STD_DECODE] if built == "std" else [PREFILL, DECODE]
    assert calls == [c[len("trtexec ") :] for c in expected]
    chosen = "onnx" if built == "std" else "portable"
    seen = (
        f"trtexec TensorRT v{version}" if version is not None and graphs != "portable" else "trtexec's version not read"
    )  # portable by name: not asked
    assert f"trtexec.sh: building the {chosen} graphs (KILN_GRAPHS={graphs or 'auto'}, {seen})" in done.stderr


def test_std_script_refuses_onnx_on_an_older_trtexec(tmp_path: Path) -> None:
    directory = export_dir(tmp_path, with_std_target(manifest()))
    m = manifest_mod.read(directory)
    script = write_script(
        directory, engine_profiles(m, BuildOptions()), BuildOptions(), engine_profiles(m, BuildOptions(), GraphSet.ONNX)
    )
    for graphs, version, code, message in (
        ("onnx", 101400, 1, "KILN_GRAPHS=onnx needs TensorRT 10.15 or newer, trtexec is TensorRT v101400"),
        ("std", 110100, 2, "KILN_GRAPHS must be auto, portable or onnx, found std"),
    ):
        env = {**_fake_trtexec(tmp_path, version), "KILN_GRAPHS": graphs}
        done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == code and message in done.stderr
        assert not (tmp_path / "calls.log").exists()  # nothing built


def test_std_export_without_tensorrt_writes_both_sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    directory = export_dir(tmp_path, with_std_target(manifest()))
    with pytest.raises(EngineError) as info:
        build_command(directory, BuildOptions())
    text = str(info.value)
    assert "\n" not in text and text.startswith("engine: TensorRT is not installed")
    assert text.endswith(
        f"(wrote {directory / 'engines' / 'trtexec.sh'} (it builds the --target onnx graphs where trtexec is "
        "TensorRT 10.15+, else the portable ones))"
    )
    script = (directory / "engines" / "trtexec.sh").read_text()
    assert "--onnx=onnx/decode.std.onnx" in script and "--onnx=onnx/decode.onnx" in script
    assert verify_dir(directory).ok, verify_dir(directory).problems()


def test_graphs_onnx_without_the_target_is_refused_before_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    directory = export_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"--graphs onnx builds the --target onnx graphs .* and this export has none"):
        build_command(directory, BuildOptions(graphs=GraphSet.ONNX))
    assert not (directory / "engines").exists()
