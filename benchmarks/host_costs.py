"""Host (CPU) microseconds per call of what an eager ``hd.Linear`` step is made of: tensor
allocation, a Triton launch (through ``JITFunction.run``, through ``kernels._launch`` and
through the compiled kernel's launcher alone), ``torch._scaled_mm``, an
``autograd.Function``, one quantize, and whole ``hd.Linear`` / ``nn.Linear`` steps (the
``fp8_current`` one also with its launches, its GEMMs or both made no-ops, and the cost of
each allocation, launch and GEMM call timed inside the step). Tiny
tensors, so the GPU never limits: the figures are the host cost of each call. Prints one
table. Run: ``python -m benchmarks.host_costs`` (``--cpu``: the same step's host path on
CPU tensors, no GPU: ``cpu_host_path_rows``).
"""

from __future__ import annotations

import contextlib

import torch

import hybrid_dist as hd
from benchmarks._bench import host_ms, print_table
from hybrid_dist.kernels import _launch
from hybrid_dist.kernels.fp8 import tensor as fp8_tensor


def host_us(fn, n: int = 2000) -> float:
    """Host microseconds per call (``_bench.host_ms`` after 50 warm-up calls)."""
    return host_ms(fn, n, warmup=50) * 1e3


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g


@contextlib.contextmanager
def _no_gpu_work(launches: bool = True, gemms: bool = True):
    """The FP8 quantize kernels' launches (``launches``) and ``torch._scaled_mm`` (``gemms``,
    returning ``torch.empty`` of its output) replaced by no-ops: what is left of an
    ``hd.Linear`` step is the rest of its host work."""
    real_launch, real_mm = fp8_tensor.launch, torch._scaled_mm
    if launches:
        fp8_tensor.launch = lambda *args, **consts: None
    if gemms:
        torch._scaled_mm = lambda a, b, **kw: torch.empty(a.shape[0], b.shape[1], dtype=kw["out_dtype"],
                                                          device=a.device)
    try:
        yield
    finally:
        fp8_tensor.launch, torch._scaled_mm = real_launch, real_mm


def in_step_call_us(step, n: int = 500) -> dict[str, tuple[float, float]]:
    """``{call: (calls per step, host µs per call)}`` of ``torch.empty``, the FP8 kernels'
    launches (``kernels.fp8.tensor.launch``) and ``torch._scaled_mm`` inside ``n`` runs of
    ``step`` (after 50), each call timed where it is made (``perf_counter_ns`` around it)."""
    import time

    totals = {"torch.empty": [0, 0], "fp8 launch": [0, 0], "torch._scaled_mm": [0, 0]}
    real = {"torch.empty": torch.empty, "fp8 launch": fp8_tensor.launch, "torch._scaled_mm": torch._scaled_mm}

    def timed(name):
        fn, acc = real[name], totals[name]

        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            out = fn(*args, **kwargs)
            acc[0] += time.perf_counter_ns() - t0
            acc[1] += 1
            return out
        return call

    for _ in range(50):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    torch.empty, fp8_tensor.launch, torch._scaled_mm = (timed(k) for k in real)
    try:
        for _ in range(n):
            step()
    finally:
        torch.empty, fp8_tensor.launch, torch._scaled_mm = real.values()
    return {k: (c / n, ns / max(c, 1) / 1e3) for k, (ns, c) in totals.items()}


def _linear_rows(x, dy):
    rows = []
    for name in ("bf16", "fp8_current", "fp8_delayed"):
        if name == "bf16":
            lin = torch.nn.Linear(128, 64, bias=False, device="cuda", dtype=torch.bfloat16)
        else:
            lin = hd.Linear(128, 64, bias=False, recipe=hd.recipe_from_name(name), device="cuda",
                            dtype=torch.bfloat16)
        step = lambda lin=lin: torch.autograd.grad(lin(x), [x, lin.weight], dy)  # noqa: E731
        rows.append([f"Linear {name} 64x128x64 fwd + autograd.grad", host_us(step, n=500)])
        if name == "fp8_current":
            for what, launches, gemms in (("its 6 Triton launches", True, False),
                                          ("its 3 torch._scaled_mm", False, True),
                                          ("its launches and torch._scaled_mm", True, True)):
                with _no_gpu_work(launches, gemms):
                    rows.append([f"the same fp8_current step, {what} no-ops", host_us(step, n=500)])
            for call, (per_step, us) in in_step_call_us(step).items():
                rows.append([f"inside that step: {call} ({per_step:.0f} a step), per call", us])
    return rows


def cpu_host_path_rows(n: int = 2000) -> list[list]:
    """The ``fp8_current`` ``hd.Linear`` step's CUDA host path run on CPU tensors (the
    registry's CUDA implementations, every FP8 launch and ``torch._scaled_mm`` a no-op)
    next to an ``nn.Linear`` bf16 step with its CPU compute: the package's own Python,
    allocations and autograd, without a GPU or the CUDA runtime."""
    import time

    from hybrid_dist import _kernel_registry as reg
    from hybrid_dist.kernels import _register

    def us(fn):
        for _ in range(100):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 64, dtype=torch.bfloat16)
    ref = torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    lin = hd.Linear(128, 64, bias=False, recipe=hd.recipe_from_name("fp8_current"), dtype=torch.bfloat16)
    tables = [v for k, v in vars(reg).items()  # the registry's tables: _QUANTIZE, _GEMM, ...
              if k.startswith("_") and not k.startswith("__") and k.isupper() and isinstance(v, (dict, list))]
    saved = reg.quantize_impl_for, reg.gemm_impls_for, [t.copy() for t in tables]
    if hd.Float8Quantizer not in reg._QUANTIZE:  # CPU-only hosts register no CUDA kernels
        _register.register_all()
    reg.quantize_impl_for = lambda q, t: reg._QUANTIZE.get(type(q))
    reg.gemm_impls_for = lambda device: reg._GEMM
    try:
        with _no_gpu_work(True, True):
            hd_us = us(lambda: torch.autograd.grad(lin(x), [x, lin.weight], dy))
    finally:
        reg.quantize_impl_for, reg.gemm_impls_for = saved[:2]
        for table, copy in zip(tables, saved[2]):
            table.clear()
            table.update(copy) if isinstance(table, dict) else table.extend(copy)
    return [["Linear fp8_current 64x128x64 fwd + grad, CUDA host path on CPU, launches and GEMMs no-ops", hd_us],
            ["nn.Linear bf16 64x128x64 fwd + grad (CPU compute)", us(lambda: torch.autograd.grad(ref(x), [x, ref.weight],
                                                                                             dy))]]


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="only the CPU rows (cpu_host_path_rows): no GPU needed")
    if p.parse_args().cpu:
        print_table(["call", "host us"], cpu_host_path_rows(), f"host cost on the CPU (torch {torch.__version__})")
        return
    dev = "cuda"
    x = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    out = torch.zeros((), device=dev)
    a = torch.randn(64, 128, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(64, 128, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)

    def launch():
        return fp8_tensor._amax_kernel[(1, 1)](x, out, 64, 128, 128, 0, BM=64, BK=128, num_warps=4)

    kernel = launch()
    stream = torch.cuda.current_stream().cuda_stream
    args = (x, out, 64, 128, 128, 0, 64, 128)  # every parameter, constexprs included (Triton 3.6 launcher)
    q = hd.Float8Quantizer()
    xg = x.clone().requires_grad_(True)
    rows = [
        ["torch.empty(()) fp32", host_us(lambda: torch.empty((), dtype=torch.float32, device=dev))],
        ["torch.zeros(()) fp32", host_us(lambda: torch.zeros((), dtype=torch.float32, device=dev))],
        ["Triton launch kernel[grid](...) (amax kernel)", host_us(launch)],
        ["the same kernel through kernels._launch.launch",
         host_us(lambda: _launch.launch(fp8_tensor._amax_kernel, (1, 1), x, out, 64, 128, 128, 0, BM=64, BK=128,
                                        num_warps=4))],
        ["the same kernel, compiled launcher called directly",
         host_us(lambda: kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                                    *args))],
        ["torch._scaled_mm 64x128x64", host_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=torch.bfloat16))],
        ["torch.mm bf16 64x128x64", host_us(lambda: torch.mm(x, x.t()))],
        ["autograd.Function identity fwd + autograd.grad", host_us(lambda: torch.autograd.grad(_Identity.apply(xg),
                                                                                            [xg], x))],
        ["Float8Quantizer.quantize_storages row+col", host_us(lambda: q.quantize_storages(x, rowwise=True,
                                                                                         columnwise=True))],
        *_linear_rows(xg, torch.randn(64, 64, device=dev, dtype=torch.bfloat16)),
    ]
    print_table(["call", "host us"], rows, f"host cost per call on {torch.cuda.get_device_name()} "
                f"(torch {torch.__version__})")


if __name__ == "__main__":
    main()
