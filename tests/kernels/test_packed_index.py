"""``kernels/packed_index`` (the packed layout's index in one launch) under the Triton
interpreter on CPU and on the GPU: bitwise the torch form of ``moe.packed_index`` (integer
arithmetic, so the interpreter's result is the hardware's), for counts with empty experts
(first, middle, last), one expert, a power-of-two and a ragged expert count, multiples 1,
16 and 128, and no rows at all; every output 16-byte aligned whatever the row count."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_check_under_triton_interpreter

CASES = [  # (tokens per expert, padding multiple)
    ([37, 0, 90, 22, 1], 16),
    ([0, 5, 0, 0, 300, 7, 0], 128),
    ([64, 64, 64, 64], 16),
    ([3], 1),
    ([0, 0, 0], 16),
    ([129, 0, 1, 255, 17, 2, 0, 40, 8, 0, 1, 90], 32),
]


def _torch_form(counts: torch.Tensor, multiple: int):
    from hybrid_dist.moe import packed_index as pi

    rows = int(counts.sum())
    cpu = pi.packed_index(counts.cpu(), rows, multiple)  # CPU: the torch form
    return rows, cpu


def _compare(device: str) -> None:
    from hybrid_dist.kernels.packed_index import packed_index as fused
    from tests._helpers import assert_bitwise_equal

    for counts, multiple in CASES:
        for dtype in (torch.int64, torch.int32):
            m = torch.tensor(counts, dtype=dtype)
            rows, want = _torch_form(m, multiple)
            got = fused(m.to(device), rows, want.capacity, multiple)
            names = ("offsets", "padded_offsets", "eid", "dest", "row_expert")
            for name, tensor in zip(names, got):
                what = f"{name} of counts {counts} (dtype {dtype}), multiple {multiple}"
                assert tensor.dtype == torch.int64, what
                # Triton specializes pointers on 16-byte alignment: an odd row count must not
                # move a view off it (a new kernel variant compiled mid-run)
                assert tensor.data_ptr() % 16 == 0, f"{what}: data_ptr % 16 = {tensor.data_ptr() % 16}"
                assert_bitwise_equal(tensor.cpu(), getattr(want, name), what)


def _check_interpreted() -> None:
    _compare("cpu")


def test_packed_index_kernel_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_packed_index", "interpreted", timeout=600)


@pytest.mark.gpu
def test_packed_index_kernel_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _compare("cuda")
