"""Per-expert per-tensor FP8 cast of token rows straight into the packed layout (Triton).

Legend: T input rows, K columns, C packed capacity, ``dest [T]`` each row's packed row
(``device_split``), ``scale [T]`` fp32 the encode scale of each row's expert.

    row [C, K]:  row[dest[t], :] = cast_fp8(x[t, :] · scale[t])
    col [K, C]:  col[:, dest[t]] = the same codes (transposed in registers)

One read of ``x``, no padded high-precision copy; padding rows (columns) stay zero (the
buffers are allocated zeroed, and quantized zeros are zero bytes). The product is one
fp32 multiply and the cast saturates and rounds to nearest even, as
``_numerics.cast_to_fp8(x_pad · scale_rows)``: bitwise the torch form on the GPU
(``tests/moe/test_device_split`` GPU case) and, under the Triton interpreter, on inputs
whose casts are exact (``tests/moe/test_fp8_rows_interpreter``). bf16 inputs only: the
in-register transpose of fp32 tiles gave wrong bytes on Triton 3.6 / H100 (see
``kernels/fp8_tensor``), so other dtypes use the torch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats._numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import cast_fp8

__all__ = ["fp8_rows"]

_BM, _BK = 64, 128


@triton.jit
def _fp8_rows_kernel(x_ptr, scale_ptr, dest_ptr, row_ptr, col_ptr, T, K, C, stride_t, FMAX: tl.constexpr,
                     ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)[:, None]).to(tl.int64)
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    mask = (rm < T) & (rk < K)
    x = tl.load(x_ptr + rm * stride_t + rk, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + rm, mask=rm < T, other=1.0)
    out_ty = row_ptr.dtype.element_ty if ROW else col_ptr.dtype.element_ty
    q = cast_fp8(x * s, FMAX, out_ty)
    if ROW:
        d = tl.load(dest_ptr + rm, mask=rm < T, other=0)
        tl.store(row_ptr + d * K + rk, q, mask=mask)
    if COL:  # element (t, k) goes to col[k, dest[t]]
        rm_t = (pid_m * BM + tl.arange(0, BM)[None, :]).to(tl.int64)
        rk_t = (pid_k * BK + tl.arange(0, BK)[:, None]).to(tl.int64)
        d_t = tl.load(dest_ptr + rm_t, mask=rm_t < T, other=0)
        tl.store(col_ptr + rk_t * C + d_t, tl.trans(q), mask=(rk_t < K) & (rm_t < T))


def fp8_rows(x: torch.Tensor, scale: torch.Tensor, dest: torch.Tensor, capacity: int, dtype: torch.dtype, *,
             rowwise: bool, columnwise: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(row [C, K] or None, col [K, C] or None)`` fp8 (module doc); ``x [T, K]`` bf16
    with unit stride along K, ``scale [T]`` fp32, ``dest [T]`` int64, all on one device."""
    t, k = x.shape
    zeros = lambda r, c: torch.zeros((r, c), dtype=torch.uint8, device=x.device).view(dtype)  # noqa: E731
    row = zeros(capacity, k) if rowwise else zeros(0, 0)
    col = zeros(k, capacity) if columnwise else zeros(0, 0)
    if t and k and (rowwise or columnwise):
        grid = (triton.cdiv(t, _BM), triton.cdiv(k, _BK))
        _fp8_rows_kernel[grid](x, scale.float().contiguous(), dest.contiguous(), row, col, t, k, capacity,
                               x.stride(0), FMAX=FP8_MAX[dtype], ROW=rowwise, COL=columnwise, BM=_BM, BK=_BK,
                               num_warps=8)
    return (row if rowwise else None), (col if columnwise else None)
