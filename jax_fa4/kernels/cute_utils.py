"""Small CuTe DSL helpers the kernels share: dtype mapping, tensor re-views,
and the sm90 swizzled SMEM operand layout."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def as_cutlass_dtype(dtype: Any, kernel: str) -> type[cutlass.Numeric]:
    """Accept cutlass types, numpy/jax dtypes or their names (bf16 and fp16 only)."""
    if isinstance(dtype, type) and issubclass(dtype, cutlass.Numeric):
        return dtype
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    table = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
    if name not in table:
        raise ValueError(f"{kernel} supports bfloat16 and float16, got {dtype!r}")
    return table[name]


def permute(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """Re-view a tensor with its modes reordered (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an SMEM tensor without moving data
    (e.g. V (n, dv, stage) -> V^T (dv, n, stage))."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def sm90_smem_layout(dtype, rows: int, cols: int, stages: int | None = None):
    """Row-major (cols contiguous) swizzled SMEM tile for a (rows, cols[, stages])
    wgmma operand: K-major as it is, MN-major through `transpose_smem`."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))
