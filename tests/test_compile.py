"""``torch.compile(fullgraph=True)`` of an ``hd.Linear`` forward + backward.

CPU: the ``aot_eager`` backend runs the traced aten graph eagerly, so on the reference
backend the compiled step must equal the eager step bitwise (outputs, input, weight and
bias gradients), over several steps (stochastic-rounding generators advance alike).
GPU: the default inductor backend against eager on the CUDA kernels.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from tests._helpers import assert_bitwise_equal, sqnr_db

COMPILE_RECIPES = ["fp8_current", "mxfp8_fwd_nvfp4_bwd"]


def _pair(name: str, k: int, n: int, *, bias: bool, device: str, dtype: torch.dtype):
    """Two identical modules (same weights, fresh states with the same seeds)."""
    recipe = hd.recipe_from_name(name)
    torch.manual_seed(0)
    eager = hd.Linear(k, n, bias=bias, recipe=recipe, device=device, dtype=dtype)
    compiled = hd.Linear(k, n, bias=bias, recipe=recipe, device=device, dtype=dtype)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def _steps(module, fn, xs, dys):
    """Per step: (y, dx, dW[, db]) of ``fn(x)`` with upstream gradient ``dy``."""
    out = []
    for x, dy in zip(xs, dys):
        module.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(dy)
        out.append([y.detach(), x.grad] + [p.grad for p in module.parameters()])
    return out


def _inputs(m: int, k: int, n: int, steps: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(1)
    xs = [torch.randn(2, m // 2, k, generator=g).to(device, dtype) for _ in range(steps)]
    dys = [torch.randn(2, m // 2, n, generator=g).to(device, dtype) for _ in range(steps)]
    return xs, dys


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", COMPILE_RECIPES)
def test_compiled_linear_equals_eager_bitwise_cpu(name, bias):
    torch._dynamo.reset()
    m, k, n = 64, 64, 32
    eager, compiled = _pair(name, k, n, bias=bias, device="cpu", dtype=torch.bfloat16)
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    xs, dys = _inputs(m, k, n, 3, "cpu", torch.bfloat16)
    ref = _steps(eager, eager, xs, dys)
    got = _steps(compiled, fn, xs, dys)
    what = ["y", "dx", "dW", "db"]
    for step, (r, c) in enumerate(zip(ref, got)):
        for i, (a, b) in enumerate(zip(r, c)):
            assert_bitwise_equal(b, a, f"{name} bias={bias} step {step} {what[i]} (compiled vs eager)")


def test_compiled_linear_traces_one_graph_per_module():
    """Three steps of one compiled module compile once (no recompiles from state changes)."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    eager, compiled = _pair("mxfp8_fwd_nvfp4_bwd", 64, 32, bias=False, device="cpu", dtype=torch.bfloat16)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=counter, fullgraph=True)
    xs, dys = _inputs(64, 64, 32, 3, "cpu", torch.bfloat16)
    _steps(compiled, fn, xs, dys)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} frames for 3 identical steps"


@pytest.mark.gpu
@pytest.mark.parametrize("name", COMPILE_RECIPES)
def test_compiled_linear_inductor_gpu(name):
    """Inductor on the CUDA kernels: fp8_current bitwise (every op is a kernel op, a
    reshape or a GEMM); mxfp8_fwd_nvfp4_bwd within SQNR 40 dB of eager (inductor
    recompiles the per-tensor NVFP4 scale arithmetic)."""
    torch._dynamo.reset()
    m, k, n = 256, 512, 256
    eager, compiled = _pair(name, k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(compiled, fullgraph=True)
    xs, dys = _inputs(m, k, n, 2, "cuda", torch.bfloat16)
    ref = _steps(eager, eager, xs, dys)
    got = _steps(compiled, fn, xs, dys)
    for step, (r, c) in enumerate(zip(ref, got)):
        for what, a, b in zip(["y", "dx", "dW"], r, c):
            if name == "fp8_current":
                assert_bitwise_equal(b, a, f"{name} step {step} {what} (inductor vs eager)")
            else:
                s = sqnr_db(a, b)
                assert s >= 40, f"{name} step {step} {what}: SQNR {s:.1f} dB (inductor vs eager)"
