"""Small Triton kernels that run ``kernels._jit_common`` helpers elementwise, for the
interpreter tests (imported only in the ``TRITON_INTERPRET=1`` subprocess)."""

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import e8m0_inv_bf16, e8m0_rceil, e8m0_rceil_bf16, exp2_int


@triton.jit
def e8m0_probe(amax_ptr, out_ptr, N, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    """``out [4, N]`` int32: ``e8m0_rceil``, ``e8m0_rceil_bf16``, and the bits of
    ``exp2_int(127 - e)`` / ``e8m0_inv_bf16(e)`` of each fp32 ``amax``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(amax_ptr + i, mask=i < N, other=0.0)
    e_ref, e_new = e8m0_rceil(a, E5M2), e8m0_rceil_bf16(a, E5M2)
    tl.store(out_ptr + i, e_ref, mask=i < N)
    tl.store(out_ptr + N + i, e_new, mask=i < N)
    tl.store(out_ptr + 2 * N + i, exp2_int(127 - e_ref).to(tl.int32, bitcast=True), mask=i < N)
    tl.store(out_ptr + 3 * N + i, e8m0_inv_bf16(e_new).to(tl.int32, bitcast=True), mask=i < N)
