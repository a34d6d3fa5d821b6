"""``file_pages``: a checkpoint's file pages released once read, never a page whose contents
are not the file's."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.file_pages import release_file_pages, release_module_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the pagemap and madvise are Linux's")

PAGES = 64


def _mapped(path: Path) -> torch.Tensor:
    """A file's bytes as bf16, mapped privately (copy-on-write), as transformers maps a checkpoint."""
    values = (torch.arange(PAGES * mmap.PAGESIZE // 2) % 251).to(torch.bfloat16)
    path.write_bytes(values.view(torch.uint8).numpy().tobytes())
    return torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.bfloat16)


def _resident(tensor: torch.Tensor) -> int:
    """The tensor's pages mapped in this process (pagemap's present bit)."""
    first, count = tensor.data_ptr() // mmap.PAGESIZE, tensor.numel() * tensor.element_size() // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read(8 * count), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def test_a_mapped_tensor_read_is_released_and_reads_the_same(tmp_path: Path) -> None:
    tensor = _mapped(tmp_path / "w.bin")
    before = tensor.float().sum().item()  # every page read: mapped
    assert _resident(tensor) == PAGES
    assert release_file_pages([tensor, tensor[:10]]) == PAGES * mmap.PAGESIZE  # a view's pages once
    assert _resident(tensor) == 0
    assert tensor.float().sum().item() == before  # the file's pages mapped again: the same values


def test_a_page_written_in_place_is_kept(tmp_path: Path) -> None:
    """A written page is the process's own copy (a merged adapter's): releasing it would lose the write."""
    tensor = _mapped(tmp_path / "w.bin")
    tensor.float().sum()
    row = mmap.PAGESIZE // 2  # the second page's first value
    tensor[row] = 1000.0
    assert release_file_pages([tensor]) == (PAGES - 1) * mmap.PAGESIZE
    assert tensor[row].item() == 1000.0 and _resident(tensor) == 1


def test_memory_of_the_process_is_never_released() -> None:
    """Anonymous memory (a converted weight, a computed tensor) holds no file's bytes: nothing released."""
    model = torch.nn.Linear(512, 512)
    with torch.no_grad():
        model.weight.copy_(torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512))
    assert release_module_pages(model) == 0
    assert model.weight.sum().item() == float(sum(range(512 * 512)))
    assert release_file_pages([torch.empty(0), model.weight[:0], model.weight.to_sparse()]) == 0


def test_a_loaded_checkpoint_keeps_none_of_its_pages_once_the_reference_is_ready(tmp_path: Path) -> None:
    """A bf16 checkpoint's weights are its file's pages (transformers maps them): whatever read them
    before, the reference leaves them to the page cache; what is read next maps again."""
    from kiln.exporter.load import prepare_reference
    from kiln.exporter.options import ExportOptions
    from kiln.plugins import load_model
    from kiln.plugins.hf import tiny_model

    tiny_model("llama", seed=1, vocab_size=8192).module.model.to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    embedding = loaded.module.model.get_input_embeddings().weight
    before = embedding.float().sum().item()  # read: mapped
    assert embedding.dtype == torch.bfloat16 and _resident(embedding) == embedding.nbytes // mmap.PAGESIZE
    module = prepare_reference(loaded, ExportOptions.from_flags())
    assert sum(_resident(p) for p in module.parameters()) == 0
    assert embedding.float().sum().item() == before


@pytest.mark.parametrize("read", ["chunks", "array", "lend"])
def test_a_weight_read_for_the_graphs_or_the_reference_leaves_its_pages(tmp_path: Path, read: str) -> None:
    """The weights writer's reads (``ModuleWeight``: by chunks, or whole for a quantizer) and the
    reference's fp32 copies of one module at a time (``Scratch.lend``) each map a weight once."""
    import onnx_ir as ir

    from kiln.exporter.passes.bind import ModuleWeight, WeightSource
    from kiln.exporter.runners.torch_runner import Scratch

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(_mapped(tmp_path / "w.bin").reshape(PAGES, -1), requires_grad=False)
    expected = module.weight.float()
    assert _resident(module.weight) == PAGES
    weight = ModuleWeight(WeightSource(module), "model.weight", ir.DataType.FLOAT)
    if read == "chunks":
        values = np.concatenate([c.copy() for c in weight.chunks(mmap.PAGESIZE * 4)])
    elif read == "array":
        values = weight.array()
    else:
        values = Scratch().lend(module.weight).numpy()
    assert _resident(module.weight) == 0
    assert np.array_equal(values.reshape(expected.shape), expected.numpy())


def test_the_loads_check_of_each_weight_leaves_its_pages(tmp_path: Path) -> None:
    """The load reads every weight once for NaN and Inf (``non_finite``): each one's pages go back after."""
    from kiln.plugins.base import non_finite

    tensor = _mapped(tmp_path / "w.bin")
    assert non_finite(tensor, slice_elements=1000) == 0
    assert _resident(tensor) == 0
