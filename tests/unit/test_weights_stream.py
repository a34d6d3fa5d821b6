"""The weights writer's streaming (``passes.weights_stream``): a module weight computed and written
a chunk at a time gives the bytes of one whole write; content is matched by a sampled fingerprint
that is confirmed byte for byte; a write's error reaches the caller."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch import nn

from kiln.exporter.passes import WEIGHTS_FILE, WeightsWriter
from kiln.exporter.passes.bind import ModuleWeight, WeightSource
from kiln.exporter.passes.transposes import TRANSPOSE
from kiln.exporter.passes.weights_stream import HASH_ALL_BYTES, ChunkFile, Fingerprint, tensor_chunks
from kiln.exporter.precision.fp16 import FP16

FLOAT = ir.DataType.FLOAT


class Weights(nn.Module):
    """bf16 and fp32 parameters (one with values fp16 must fix: under- and overflows), an int buffer."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        wide = torch.randn(37, 2100, generator=generator) * 0.02
        wide[0, :4] = torch.tensor([1e-30, -1e-30, 1e6, -1e6])
        wide[36, -1] = 0.0
        self.wide = nn.Parameter(wide.bfloat16())  # rows of its transpose: over _SHORT_ROW, the blocked path
        self.narrow = nn.Parameter((torch.randn(300, 41, generator=generator) * 0.02).bfloat16())
        self.full = nn.Parameter(torch.randn(53, 29, generator=generator))
        self.vector = nn.Parameter(torch.randn(1000, generator=generator).bfloat16())
        self.register_buffer("positions", torch.arange(777, dtype=torch.int64).reshape(7, 111))


def recipes(source: WeightSource) -> list[ModuleWeight]:
    made = []
    for name in ("model.wide", "model.narrow", "model.full"):
        plain = ModuleWeight(source, name, FLOAT)
        made += [plain, plain.then(TRANSPOSE), plain.then(TRANSPOSE).then(FP16), plain.then(FP16)]
    made.append(ModuleWeight(source, "model.vector", FLOAT).then(FP16))
    made.append(ModuleWeight(source, "model.positions", ir.DataType.INT64).then(TRANSPOSE))
    return made


@pytest.mark.parametrize("limit", [1, 1000, 4096 * 7 + 3, 1 << 30])
def test_chunked_conversion_gives_the_bytes_of_the_whole_tensor(limit: int) -> None:
    """One row at a time, odd sizes, or all at once: the same bytes as ``array()`` (the whole
    tensor's conversion), for every recipe: transposed (both paths), fp16 with its fixes, none."""
    source = WeightSource(Weights())
    for weight in recipes(source):
        whole = weight.array().tobytes()
        chunks = list(tensor_chunks(weight, limit))
        assert b"".join(bytes(c) for c in chunks) == whole, f"{weight.key} at {limit} bytes a chunk"
        row = len(whole) // weight.shape[0]
        assert all(len(c) <= max(limit, row) for c in chunks), f"{weight.key}: a chunk over {limit} bytes"
        assert len(chunks) == (1 if limit >= len(whole) else -(-weight.shape[0] // max(1, limit // row)))


def test_fingerprint_is_the_same_however_the_bytes_are_chunked_and_samples_large_tensors() -> None:
    big = np.random.default_rng(1).standard_normal(HASH_ALL_BYTES // 2).astype(np.float32)  # 2 MiB: sampled
    tensor = ir.tensor(big)

    def key(data: bytes, sizes: int, of: ir.TensorProtocol = tensor) -> bytes:
        fingerprint = Fingerprint(of)
        for start in range(0, len(data), sizes):
            fingerprint.update(memoryview(data)[start : start + sizes])
        return fingerprint.key()

    data = big.tobytes()
    assert not Fingerprint(tensor).exact
    assert key(data, len(data)) == key(data, 4097) == key(data, 1 << 18) == key(data, 333_333)
    inside, outside = bytearray(data), bytearray(data)
    inside[(1 << 18) + 10] ^= 1  # in the sampled window of the second 256 KiB
    outside[(1 << 18) + 5000] ^= 1  # past it: the fingerprint cannot see it (the writer compares bytes)
    assert key(bytes(inside), 4097) != key(data, 4097)
    assert key(bytes(outside), 4097) == key(data, 4097)
    small = ir.tensor(big[:1000])
    changed = bytearray(small.tobytes())
    changed[3000] ^= 1
    assert Fingerprint(small).exact and key(bytes(changed), 512, small) != key(small.tobytes(), 512, small)
    other_shape = ir.tensor(big.reshape(2, -1))
    assert key(data, 4097, other_shape) != key(data, 4097)


def bound(source: WeightSource, name: str, recipe: str = "") -> ir.Value:
    tensor = ModuleWeight(source, name, FLOAT)
    tensor = tensor.then(TRANSPOSE) if recipe == "T" else tensor
    return ir.val(f"{name}{recipe}", FLOAT, list(tensor.shape.numpy()), const_value=tensor)


def initializers_model(values: list[ir.Value]) -> ir.Model:
    x = ir.val("x", FLOAT, [1])
    graph = ir.Graph([x], [x], nodes=[], initializers=values, opset_imports={"": 19}, name="g")
    return ir.Model(graph, ir_version=10)


class Large(nn.Module):
    """Streamed weights (over HASH_ALL_BYTES): ``a``; ``same``, a copy of it; ``near``, a copy
    differing only where the fingerprint does not look; ``other``, different."""

    def __init__(self) -> None:
        super().__init__()
        a = torch.randn(600, 700, generator=torch.Generator().manual_seed(2)).bfloat16()  # 1.6 MiB as fp32
        near = a.clone()
        near.view(-1)[(1 << 18) // 4 + 2000] += 1  # an fp32 byte offset past the second sampled window
        self.a, self.same, self.near = nn.Parameter(a), nn.Parameter(a.clone()), nn.Parameter(near)
        self.other = nn.Parameter(torch.randn(600, 700, generator=torch.Generator().manual_seed(3)).bfloat16())


def test_streamed_weights_are_matched_byte_for_byte(tmp_path: Path) -> None:
    module = Large()
    source = WeightSource(module)
    names = ["model.a", "model.same", "model.near", "model.other"]
    model = initializers_model([bound(source, name) for name in names])
    keys = []
    for name in ("model.a", "model.near"):
        fingerprint = Fingerprint(model.graph.initializers[name].const_value)  # type: ignore[arg-type]
        for chunk in tensor_chunks(ModuleWeight(source, name, FLOAT)):
            fingerprint.update(chunk)
        keys.append(fingerprint.key())
    assert keys[0] == keys[1]  # near is told apart by its bytes only
    path = tmp_path / WEIGHTS_FILE
    with WeightsWriter(path, rename=False) as writer:
        writer.externalize(model)
        shared = writer.close()
    stored = {name: model.graph.initializers[name].const_value for name in names}
    offsets = {name: t.offset for name, t in stored.items() if isinstance(t, ir.ExternalTensor)}
    size = 600 * 700 * 4
    # same: written, found equal, cut back; near: the same fingerprint, other bytes: its own
    assert offsets == {"model.a": 0, "model.same": 0, "model.near": size, "model.other": 2 * size}
    assert shared.tensors == 3 and shared.bytes == path.stat().st_size == 3 * size
    data = path.read_bytes()
    for name in ("model.a", "model.near", "model.other"):
        want = source.tensor(name).detach().float().numpy().tobytes()
        assert data[offsets[name] : offsets[name] + size] == want, name


def test_in_memory_tensors_are_matched_byte_for_byte(tmp_path: Path) -> None:
    """Tensors a pass made (not module weights): a sampled fingerprint too, confirmed against the file."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((700, 600)).astype(np.float32)
    near = a.copy()
    near.reshape(-1)[(1 << 18) // 4 + 2000] += 1
    values = [ir.val(n, const_value=ir.tensor(v, name=n)) for n, v in [("a", a), ("same", a.copy()), ("near", near)]]
    model = initializers_model(values)
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        writer.externalize(model)
        shared = writer.close()
    assert sorted(model.graph.initializers) == ["weights/a", "weights/near"]  # same merged into a
    assert shared.tensors == 2 and shared.references == 2 and shared.bytes == 2 * a.nbytes
    assert (tmp_path / WEIGHTS_FILE).read_bytes() == a.tobytes() + near.tobytes()


def test_a_tied_weight_is_computed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two names of one parameter (tied), transposed alike: one computation, one stored tensor."""
    module = Large()
    module.tied = module.a
    source = WeightSource(module)
    computed: list[str] = []
    original = ModuleWeight.chunks

    def counting(self: ModuleWeight, limit: int):  # type: ignore[no-untyped-def]
        computed.append(self.module_name)
        return original(self, limit)

    monkeypatch.setattr(ModuleWeight, "chunks", counting)
    model = initializers_model([bound(source, "model.a", "T"), bound(source, "model.tied", "T")])
    with WeightsWriter(tmp_path / WEIGHTS_FILE, rename=True) as writer:
        writer.externalize(model)
        shared = writer.close()
    assert computed == ["model.a"]
    assert shared.tensors == 1 and shared.references == 1 and sorted(model.graph.initializers) == ["weights/model.aT"]


def test_a_failed_write_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    file = ChunkFile(tmp_path / "w.bin")
    file.write(0, memoryview(b"abc"))
    file.flush()
    monkeypatch.setattr(os, "pwrite", full)
    file.write(3, memoryview(b"def"))
    with pytest.raises(OSError, match="No space left on device"):
        file.flush()
    with pytest.raises(OSError, match="No space left on device"):
        file.write(6, memoryview(b"ghi"))
    with pytest.raises(OSError, match="No space left on device"):
        file.close()
    assert file.closed and (tmp_path / "w.bin").read_bytes() == b"abc"
    file.close()  # again: nothing
    quiet = ChunkFile(tmp_path / "q.bin")
    quiet.write(0, memoryview(b"x"))
    quiet.close(check=False)  # while another error unwinds: the write's is not raised over it
    assert quiet.closed
