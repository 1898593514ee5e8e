"""``kernels.dequant``: MXFP8 and NVFP4 (1D, 2D blocks) to bf16 bitwise the torch values —
exact without a tensor scale, ``bf16((q · s_block) · scale)`` with one — under the Triton
interpreter on CPU (the GEMM tests cover the kernels on CUDA)."""

from __future__ import annotations

import torch

from hybrid_dist.formats import MXFP8Quantizer, NVFP4Quantizer
from tests._helpers import run_check_under_triton_interpreter


def _check_dequant():
    from hybrid_dist.kernels import dequant

    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 160, generator=g) * torch.logspace(-3, 3, 160)
    scale = torch.tensor(0.7391, dtype=torch.float32)
    for name, q in (("mxfp8", MXFP8Quantizer()), ("nvfp4", NVFP4Quantizer()), ("nvfp4_2d", NVFP4Quantizer(block_2d=True))):
        st = q.quantize_storages(x, rowwise=True, columnwise=False)[0]
        for s in (None, scale):
            if name == "mxfp8":
                got = dequant.mxfp8_dequantize_op.fn(st.data, st.scale, s)
            else:
                got = dequant.nvfp4_dequantize_op.fn(st.data, st.block_scale, st.block_rows, s)
            v = st.values(undo_rht=False)
            want = (v if s is None else v * s).to(torch.bfloat16)
            assert torch.equal(got.float(), want.float()), f"{name} scale={s}"  # (±0 compare equal)
            if s is None:
                assert torch.equal(got.float(), v), f"{name}: not exact"


def test_dequant_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_dequant", "dequant")
