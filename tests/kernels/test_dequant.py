"""``kernels.dequant``: the MXFP8 and NVFP4 dequantize kernels under the Triton interpreter,
bitwise against the storages' fp32 values (``values(undo_rht=False)``): without per-tensor
scales rounded once to bf16 (exact), with them ``(v · (ta · tb))`` rounded once, then times a
per-row or per-column fp32 scale where given (the grouped GEMMs' token fold); NVFP4 with
1×16 and 16×16 blocks, tiles cut by the tensor edge (MXFP8 96 × 160 against its 64 × 128 tiles;
NVFP4 48 × 304 against 32 rows × 128 packed bytes).
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from tests._helpers import assert_bitwise_equal, run_check_under_triton_interpreter

SCALES = {"none": (), "a": (torch.tensor(0.37),), "a,b": (torch.tensor(3.1e-3), torch.tensor(1.7e2))}


LINES = ("none", "rows", "columns")


def _line_scales(st, line: str) -> dict:
    r, c = st.shape2d
    g = torch.Generator().manual_seed(r * 1000 + c)
    if line == "rows":
        return {"row_scale": torch.rand(r, generator=g) * 7 + 1e-3}
    if line == "columns":
        return {"col_scale": torch.rand(c, generator=g) * 7 + 1e-3}
    return {}


def _expected(st, scales, lines: dict) -> torch.Tensor:
    v = st.values(undo_rht=False)
    if scales:
        t = scales[0] if len(scales) == 1 else scales[0] * scales[1]
        v = v * t
    if "row_scale" in lines:
        v = v * lines["row_scale"][:, None]
    if "col_scale" in lines:
        v = v * lines["col_scale"][None, :]
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
            for line in LINES if sname != "a" else ("none",):
                lines = _line_scales(st, line)
                got = bf16_operand(st, *scales, **lines)
                assert_bitwise_equal(got, _expected(st, scales, lines), f"{name}, tensor scales {sname}, line {line}")


def test_dequantize_kernels_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_dequant", "kernels")
