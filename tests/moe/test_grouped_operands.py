"""``moe.grouped_operands``: the per-expert scale fold of packed token operands. On CUDA
the dequantize kernel applies each row's (column's) expert scale in its one pass; that is
bitwise the torch form (exact bf16 values, one fp32 multiply, one rounding) that CPU runs.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe.grouped_operands import fold_columns, fold_rows
from tests._helpers import assert_bitwise_equal

QUANTIZERS = {"mxfp8": hd.MXFP8Quantizer(), "nvfp4": hd.NVFP4Quantizer(), "nvfp4 rht": hd.NVFP4Quantizer(rht=True)}


def _case(name: str):
    """CPU storages of one ``[96, 160]`` tensor (rows and columns each a packed token axis of
    3 experts, the last positions past the last expert) and two per-expert scale vectors."""
    torch.manual_seed(0)
    x = torch.randn(96, 160, dtype=torch.bfloat16) * 3
    row, col = QUANTIZERS[name].quantize_storages(x, rowwise=True, columnwise=True)
    return row, col, (torch.tensor([0.5, 3.0e-3, 7.25]), torch.tensor([1.7e2, 0.31, 2.0]))


def _expert_of(n: int, device: str) -> torch.Tensor:
    """Positions 0..n-1 → experts 0, 1, 2 in runs, the last 5 padding (expert 3 = past the last)."""
    return (torch.arange(n, device=device) * 3 // (n - 5)).clamp(max=3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_cuda_fold_in_the_dequantize_kernel_is_bitwise_the_torch_fold(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    row, col, scales = _case(name)
    for what, fold, st, n in (("rows", fold_rows, row, row.shape2d[0]), ("columns", fold_columns, col, col.shape2d[1])):
        want = fold(st, _expert_of(n, "cpu"), *scales)
        got = fold(st.map_tensors(lambda t: t.cuda()), _expert_of(n, "cuda"), *(s.cuda() for s in scales))
        assert_bitwise_equal(got.cpu(), want, f"{name} fold of {what}")


def test_fold_without_scales_is_the_exact_values():
    row, _, _ = _case("nvfp4")
    got = fold_rows(row, _expert_of(96, "cpu"), None, None)
    assert_bitwise_equal(got, row.values(undo_rht=False).to(torch.bfloat16), "nvfp4 rows, no scales")
