"""``kernels.dequant``: the MXFP8 and NVFP4 dequantize kernels under the Triton interpreter,
bitwise against the storages' fp32 values (``values(undo_rht=False)``): without per-tensor
scales rounded once to bf16 (exact), with them ``(v · (ta · tb))`` rounded once; NVFP4 with
1×16 and 16×16 blocks, tiles cut by the tensor edge (MXFP8 96 × 160 against its 64 × 128 tiles;
NVFP4 48 × 304 against 32 rows × 128 packed bytes).
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from tests._helpers import assert_bitwise_equal, run_check_under_triton_interpreter

SCALES = {"none": (), "a": (torch.tensor(0.37),), "a,b": (torch.tensor(3.1e-3), torch.tensor(1.7e2))}


def _expected(st, scales) -> torch.Tensor:
    v = st.values(undo_rht=False)
    if scales:
        t = scales[0] if len(scales) == 1 else scales[0] * scales[1]
        v = v * t
    return v.to(torch.bfloat16)


def _storages():
    torch.manual_seed(0)
    out = {}
    for name, q, shape in (("mxfp8", hd.MXFP8Quantizer(), (96, 160)), ("nvfp4", hd.NVFP4Quantizer(), (48, 304)),
                           ("nvfp4 rht", hd.NVFP4Quantizer(rht=True), (48, 304)),
                           ("nvfp4 2d", hd.NVFP4Quantizer(block_2d=True), (48, 304))):
        x = torch.randn(shape, dtype=torch.bfloat16) * 3
        x[5, :32] *= 1e-6  # blocks with small scales
        row, col = q.quantize_storages(x, rowwise=True, columnwise=True)
        out[f"{name} rowwise"], out[f"{name} columnwise"] = row, col
    return out


def _check_kernels() -> None:
    from hybrid_dist.kernels.gemm import bf16_operand

    for name, st in _storages().items():
        for sname, scales in SCALES.items():
            got = bf16_operand(st, *scales)
            assert_bitwise_equal(got, _expected(st, scales), f"{name}, tensor scales {sname}")


def test_dequantize_kernels_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_dequant", "kernels")
