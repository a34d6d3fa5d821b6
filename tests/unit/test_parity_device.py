"""``--parity-device auto|cpu|cuda`` (issue 40 item 4): the choice, tested on the CPU with the
machine's probes injected; the refusal of cuda where it cannot run, in one line and before
anything is written; a ``--parity-device cpu`` export as before. The CUDA path itself runs in
tests/gpu/test_parity_cuda.py where a GPU is lent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.exporter.check import check_dir
from kiln.exporter.contract.io import GraphKind
from kiln.exporter.options import ExportOptions
from kiln.exporter.plan import plan
from kiln.exporter.runners import TorchRunner
from kiln.exporter.runners.device import (
    CPU,
    CUDA_PROVIDER,
    ParityDevice,
    Probes,
    current,
    missing,
    on,
    resolve,
)
from kiln.exporter.runners.ort_runner import OrtRunner

CUDA = ParityDevice("cuda")
GPU, NO_GPU = (lambda: True), (lambda: False)
WITH_CUDA_EP = lambda: ("CUDAExecutionProvider", "CPUExecutionProvider")  # noqa: E731
CPU_EP_ONLY = lambda: ("CPUExecutionProvider",)  # noqa: E731
HERE_CUDA = torch.cuda.is_available() and CUDA_PROVIDER in onnxruntime.get_available_providers()


@pytest.mark.parametrize(
    ("torch_gpu", "providers", "asked", "expected"),
    [
        (GPU, WITH_CUDA_EP, "auto", CUDA),
        (GPU, CPU_EP_ONLY, "auto", CPU),  # torch sees a GPU, ONNX Runtime has no CUDA provider
        (NO_GPU, WITH_CUDA_EP, "auto", CPU),
        (NO_GPU, CPU_EP_ONLY, "auto", CPU),
        (GPU, WITH_CUDA_EP, "cuda", CUDA),
        (GPU, WITH_CUDA_EP, "cpu", CPU),
        (NO_GPU, CPU_EP_ONLY, "cpu", CPU),
    ],
)
def test_choice_table(torch_gpu: object, providers: object, asked: str, expected: ParityDevice) -> None:
    probes = Probes(torch_cuda=torch_gpu, ort_providers=providers)  # type: ignore[arg-type]
    assert resolve(asked, probes) == expected, f"--parity-device {asked} chose {resolve(asked, probes)}"


@pytest.mark.parametrize(
    ("torch_gpu", "providers", "named", "not_named"),
    [
        (GPU, CPU_EP_ONLY, "onnxruntime-gpu", "torch sees no CUDA GPU"),
        (NO_GPU, WITH_CUDA_EP, "torch sees no CUDA GPU", "onnxruntime-gpu"),
    ],
)
def test_cuda_refused_names_what_is_missing(torch_gpu: object, providers: object, named: str, not_named: str) -> None:
    probes = Probes(torch_cuda=torch_gpu, ort_providers=providers)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as caught:
        resolve("cuda", probes)
    message = str(caught.value)
    assert "\n" not in message, message
    assert named in message and not_named not in message, message
    assert "--parity-device cpu" in message, f"the way out is named: {message}"


def test_both_missing_are_named() -> None:
    found = missing(Probes(torch_cuda=NO_GPU, ort_providers=CPU_EP_ONLY))
    assert len(found) == 2 and "torch" in found[0] and CUDA_PROVIDER in found[1], found


def test_unknown_choice_refused() -> None:
    with pytest.raises(ConfigError, match="--parity-device must be one of auto, cpu, cuda, found 'gpu'"):
        resolve("gpu")
    with pytest.raises(ConfigError, match="--parity-device must be auto, cpu or cuda, found 'gpu'"):
        ExportOptions.from_flags(parity_device="gpu")


def test_auto_follows_this_machine() -> None:
    """auto with the real probes: cuda only where torch sees a GPU and onnxruntime-gpu is installed
    (the CPU on this project's CI machines)."""
    assert resolve("auto") == (CUDA if HERE_CUDA else CPU), f"auto chose {resolve('auto')}, cuda here: {HERE_CUDA}"


def test_the_default_is_the_cpu_until_the_cuda_path_has_run() -> None:
    """The CUDA path was written from documentation and has not run on a GPU: a GPU machine's export
    must not take it unasked (docs/parity.md), so the default is cpu for the API and both commands."""
    assert ExportOptions().parity.device == "cpu"
    for command in ("export", "check"):
        params = {p.name: p for p in main.commands[command].params}
        assert params["parity_device"].default == "cpu", (command, params["parity_device"].default)


def test_providers_per_device() -> None:
    assert CPU.providers == ["CPUExecutionProvider"], CPU.providers
    assert CUDA.providers == [(CUDA_PROVIDER, {"use_tf32": "0"}), "CPUExecutionProvider"], CUDA.providers


def test_on_sets_the_device_for_its_block_only() -> None:
    assert current() == CPU, "outside any block parity runs on the CPU"
    with on(CPU):
        assert current() == CPU
    with pytest.raises(RuntimeError, match="inside"):
        with on(CPU):
            raise RuntimeError("inside")
    assert current() == CPU, "the device is reset after an error"


def test_runners_take_the_device_of_their_making(tiny_ckpt: Path) -> None:
    """Outside ``on`` and on the CPU: the runners' CPU behaviour (the module where it was, numpy
    out of CPU tensors, CPU sessions)."""
    from kiln.plugins import load_model

    loaded = load_model(tiny_ckpt)
    with on(CPU):
        runner = TorchRunner(loaded.module, loaded.spec.n_layers)
        ort = OrtRunner({})
    assert not runner._cuda and ort._device == CPU, (runner._cuda, ort._device)
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None]}
    logits = runner.run(GraphKind.PREFILL, feeds)["logits"]
    assert isinstance(logits, np.ndarray) and logits.shape[:2] == (1, 3), type(logits)
    assert all(p.device.type == "cpu" for p in loaded.module.parameters()), "the module stays on the CPU"


@pytest.mark.skipif(HERE_CUDA, reason="this machine can run parity on CUDA: nothing to refuse")
def test_export_cuda_refused_before_anything_is_written(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["export", "--model", str(tiny_ckpt), "--out", str(out), "--parity-device", "cuda"]
    )
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, (result.exit_code, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: config: --parity-device cuda: "), result.stderr
    assert "--parity-device cpu" in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not out.exists(), "nothing is written"
    with pytest.raises(ConfigError, match="--parity-device cuda"):
        plan(ExportOptions.from_flags(parity_device="cuda"))


@pytest.mark.skipif(HERE_CUDA, reason="this machine can run parity on CUDA: nothing to refuse")
def test_check_cuda_refused_before_the_directory_is_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--parity-device cuda"):
        check_dir(tmp_path / "no-such-export", parity_device="cuda")


def test_export_on_cpu_passes(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["export", "--model", str(tiny_ckpt), "--out", str(out), "--parity-device", "cpu", "--parity-tokens", "4"]
    result = CliRunner().invoke(main, [*args, "--max-batch", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["parity"]["passed"] is True, summary["parity"]
    assert "parity on cuda" not in result.stderr, "a CPU export notes no device"
