"""``DirectionStorage.dequantize(torch.bfloat16)`` through a registered kernel
(``_kernel_registry.register_dequantize_bf16``; MXFP8 on CUDA: ``kernels.gemm.bf16_operand``):
the kernel is taken for bf16 only, a columnwise storage comes back as the logical
transpose, and the values are bitwise the torch reference (``values().to(bf16)``), on the
GPU and under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist import _kernel_registry
from hybrid_dist.formats.mxfp8 import MXFP8Storage
from tests._helpers import assert_bitwise_equal, run_check_under_triton_interpreter


def _reference(st) -> torch.Tensor:
    v = st.values()
    return (v.t() if st.transposed else v).to(torch.bfloat16)


def _storages(device: str):
    torch.manual_seed(0)
    x = torch.randn(96, 160, device=device, dtype=torch.bfloat16) * 3
    x[5, :32] *= 1e-6  # blocks with small scales
    row, col = hd.MXFP8Quantizer().quantize_storages(x, rowwise=True, columnwise=True)
    return {"rowwise": row, "columnwise": col, "columnwise narrowed": col.narrow_dim0(32, 64)}


def test_bf16_dequantize_takes_the_registered_kernel(monkeypatch):
    calls = []

    def impl(st):
        calls.append(st)
        return st.values().to(torch.bfloat16)

    monkeypatch.setattr(_kernel_registry, "dequantize_bf16_impl_for",
                        lambda st, device: impl if isinstance(st, MXFP8Storage) else None)
    for name, st in _storages("cpu").items():
        calls.clear()
        assert_bitwise_equal(st.dequantize(torch.bfloat16), _reference(st), name)
        assert calls == [st], name
        calls.clear()
        st.dequantize(torch.float32)
        assert calls == [], f"{name}: the fp32 dequantize took the bf16 kernel"


def test_cpu_storages_run_the_reference():
    for st in _storages("cpu").values():
        assert _kernel_registry.dequantize_bf16_impl_for(st, st.device) is None


@pytest.mark.gpu
def test_mxfp8_bf16_dequantize_bitwise_on_cuda():
    for name, st in _storages("cuda").items():
        assert _kernel_registry.dequantize_bf16_impl_for(st, st.device) is not None, "no MXFP8 kernel registered"
        assert_bitwise_equal(st.dequantize(torch.bfloat16), _reference(st), name)


def _check_mxfp8_kernel() -> None:
    from hybrid_dist.kernels.gemm import bf16_operand

    for name, st in _storages("cpu").items():
        out = bf16_operand(st)
        assert_bitwise_equal(out.t() if st.transposed else out, _reference(st), f"interpreted kernel, {name}")


def test_mxfp8_bf16_dequantize_kernel_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.formats.test_storage_dequantize", "mxfp8_kernel")
