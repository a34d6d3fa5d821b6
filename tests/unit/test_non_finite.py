"""``plugins.base.non_finite``: the NaN/Inf count every checkpoint load runs on every weight. A
sound slice is cleared by its min and max alone; any slice holding a NaN or an Inf is counted
exactly, whatever the dtype (complex, which torch has no min/max for, by the mask; fp8 widened)."""

from __future__ import annotations

import pytest
import torch

from kiln.plugins.base import non_finite

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_sound_tensor_has_none(dtype: torch.dtype) -> None:
    tensor = (torch.randn(5, 13, generator=torch.Generator().manual_seed(0)) * 1e3).to(dtype)
    tensor[0, 0] = torch.finfo(dtype).max  # the largest finite values are finite
    tensor[0, 1] = torch.finfo(dtype).min
    assert non_finite(tensor) == 0 and non_finite(tensor, slice_elements=7) == 0


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_every_nan_and_inf_is_counted_in_every_slice(dtype: torch.dtype, bad: float) -> None:
    tensor = torch.randn(5, 13, generator=torch.Generator().manual_seed(1)).to(dtype)
    flat = tensor.view(-1)
    flat[[0, 6, 7, 40, 64]] = bad  # the first and last elements, both sides of a slice's edge
    flat[20] = float("nan")
    for size in (7, 13, 1 << 24):
        assert non_finite(tensor, slice_elements=size) == 6
    assert non_finite(tensor[2:3]) == 0 and non_finite(tensor[1:2]) == 1  # views: row 2 holds none, row 1 one


def test_a_dtype_without_min_max_is_counted_by_the_mask() -> None:
    tensor = torch.tensor([1 + 1j, 2 - 1j, 3j, -1 + 0j], dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="aminmax"):
        torch.aminmax(tensor)  # why: the fast path has no complex min/max
    assert non_finite(tensor) == 0
    tensor[2] = complex(float("inf"), 0)
    tensor[3] = complex(0, float("nan"))
    assert non_finite(tensor, slice_elements=3) == 2


def test_an_empty_tensor_has_none() -> None:
    assert non_finite(torch.empty(0, 4)) == 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_are_counted_not_a_raw_error(dtype: torch.dtype) -> None:
    """torch 2.13 has no ``aminmax`` for fp8 and no ``isfinite`` for e4m3fn: fp8 slices are counted widened."""
    if dtype is torch.float8_e4m3fn:
        with pytest.raises(NotImplementedError, match="isfinite"):
            torch.isfinite(torch.zeros(2, dtype=dtype))  # why: without widening, a raw error
    tensor = torch.randn(5, 13, generator=torch.Generator().manual_seed(2))
    assert non_finite(tensor.to(dtype)) == 0
    flat = tensor.view(-1)
    flat[[0, 30, 64]] = float("nan")  # e4m3fn holds no Inf: NaN is the non-finite value both hold
    assert non_finite(tensor.to(dtype), slice_elements=7) == 3
