"""``benchmarks.host_costs.in_step_call_us``: counts each timed call of a step and restores
what it wrapped (CPU: the function is device-agnostic; the table itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # host_costs imports the FP8 kernels module

from benchmarks import host_costs  # noqa: E402
from hybrid_dist.kernels.fp8 import tensor as fp8_tensor  # noqa: E402


def test_in_step_call_us_counts_calls_and_restores():
    real = (torch.empty, fp8_tensor.launch, torch._scaled_mm)

    def step():
        torch.empty(3)
        torch.empty(4, 2)
        fp8_tensor.launch("kernel", (1,))  # a no-op launch stands in for the kernel's

    fp8_tensor.launch = lambda *args, **consts: None
    try:
        out = host_costs.in_step_call_us(step, n=20)
    finally:
        fp8_tensor.launch = real[1]
    assert {k: v[0] for k, v in out.items()} == {"torch.empty": 2, "fp8 launch": 1, "torch._scaled_mm": 0}
    assert all(us >= 0 for _, us in out.values()) and out["torch.empty"][1] > 0
    assert (torch.empty, torch._scaled_mm) == (real[0], real[2])


def test_cpu_host_path_rows_run_the_cuda_path_and_restore_the_registry(monkeypatch):
    import hybrid_dist as hd
    from hybrid_dist import _kernel_registry as reg
    from hybrid_dist.kernels import _register

    saved, before, quantized = (reg.quantize_impl_for, reg.gemm_impls_for), dict(reg._QUANTIZE), []
    real_register = _register.register_all

    def register_with_spy():  # the CUDA quantize implementation, counting its calls
        real_register()
        cuda_impl = reg._QUANTIZE[hd.Float8Quantizer]
        reg._QUANTIZE[hd.Float8Quantizer] = lambda *a, **k: quantized.append(1) or cuda_impl(*a, **k)

    if hd.Float8Quantizer in reg._QUANTIZE:
        pytest.skip("CUDA kernels are registered: the CPU rows are for hosts without them")
    monkeypatch.setattr(_register, "register_all", register_with_spy)
    rows = host_costs.cpu_host_path_rows(n=5)
    assert len(rows) == 2 and all(us > 0 for _, us in rows)
    assert quantized, "the fp8_current step did not take the CUDA quantize implementation"
    assert (reg.quantize_impl_for, reg.gemm_impls_for) == saved and reg._QUANTIZE == before
