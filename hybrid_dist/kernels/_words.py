"""Helpers of the ``*_words`` quantize kernels, which read bf16 ``x [M, K]`` as int32 words
``[M, K/2]``: word ``c`` holds ``x[., 2c]`` in its low half and ``x[., 2c+1]`` in its high half."""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import INTERPRET


@triton.jit
def umax16x2(a, b):
    """Per-halfword unsigned max of int32 ``a``, ``b`` whose bit 31 is 0 (``max.u16x2``)."""
    if INTERPRET:
        return tl.maximum(a & 0x7FFF0000, b & 0x7FFF0000) | tl.maximum(a & 0xFFFF, b & 0xFFFF)
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def unpack(w):
    """bf16 pair word → (fp32 of the low half, fp32 of the high half)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def load8w(p, rows, ok_k, M, stride_w):
    """Words at ``p + j·stride_w`` for ``j < 8`` (rows ``rows + j``), 0 where the row is
    ``>= M`` or ``ok_k`` is false."""
    w0 = tl.load(p, mask=(rows < M) & ok_k, other=0)
    w1 = tl.load(p + stride_w, mask=(rows + 1 < M) & ok_k, other=0)
    w2 = tl.load(p + 2 * stride_w, mask=(rows + 2 < M) & ok_k, other=0)
    w3 = tl.load(p + 3 * stride_w, mask=(rows + 3 < M) & ok_k, other=0)
    w4 = tl.load(p + 4 * stride_w, mask=(rows + 4 < M) & ok_k, other=0)
    w5 = tl.load(p + 5 * stride_w, mask=(rows + 5 < M) & ok_k, other=0)
    w6 = tl.load(p + 6 * stride_w, mask=(rows + 6 < M) & ok_k, other=0)
    w7 = tl.load(p + 7 * stride_w, mask=(rows + 7 < M) & ok_k, other=0)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def load16w_even(p, stride_w):
    """Words at ``p + j·stride_w`` for ``j < 16``, unmasked (every row and word in range)."""
    return (tl.load(p), tl.load(p + stride_w), tl.load(p + 2 * stride_w), tl.load(p + 3 * stride_w),
            tl.load(p + 4 * stride_w), tl.load(p + 5 * stride_w), tl.load(p + 6 * stride_w),
            tl.load(p + 7 * stride_w), tl.load(p + 8 * stride_w), tl.load(p + 9 * stride_w),
            tl.load(p + 10 * stride_w), tl.load(p + 11 * stride_w), tl.load(p + 12 * stride_w),
            tl.load(p + 13 * stride_w), tl.load(p + 14 * stride_w), tl.load(p + 15 * stride_w))


@triton.jit
def st64(ptr, v, mask):
    """``tl.store`` of int64 ``v`` in the layout ``v`` has (an ``st.global.b64`` per element:
    Triton would move data whose addresses are not contiguous along the thread's elements
    through shared memory first)."""
    if INTERPRET:
        tl.store(ptr, v, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.b32 $0, 0; }", "=r,l,l,r",
            [ptr, v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def st8(ptr, v, mask):
    """``st64`` for the low byte of int32 ``v`` (uint8 ``ptr``)."""
    if INTERPRET:
        tl.store(ptr, v.to(tl.uint8), mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
            [ptr, v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
