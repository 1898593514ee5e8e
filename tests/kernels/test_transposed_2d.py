"""``kernels.transposed_2d`` (the one transposed copy of quantized bytes: FSDP2's columnwise
transport, the TP gather along a token axis, the MoE receiver) is ``t.t().contiguous()``
bitwise, on CPU (torch) and on CUDA (the tiled kernel), for 1- to 8-byte elements and views."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.kernels import kernels_serve, transposed_2d
from tests._helpers import assert_bitwise_equal


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_transposed_2d_is_a_transposed_copy(device, dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 100, (130, 200), generator=gen).to(device)
    t = base.to(torch.uint8).view(dtype) if dtype.itemsize == 1 and dtype != torch.uint8 else base.to(dtype)
    # contiguous, a strided view, and vectors (a byte copy: no kernel variant for a dimension of 1)
    for src in (t, t[3:101, 7:190], t[5:6, 3:150], t[2:90, 4:5], t[7:8, 9:10]):
        got = transposed_2d(src)
        assert got.is_contiguous() and got.shape == src.shape[::-1]
        assert_bitwise_equal(got, src.t().contiguous(), f"{dtype} {tuple(src.shape)} on {device}")
    assert kernels_serve(t) == (device == "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_transposed_2d_compiled_is_the_kernel_and_bitwise(dtype):
    """While compiling, CUDA transposes trace to the kernel's op (``hybrid_dist::transposed_2d``)
    and inductor's launch of it is bitwise the eager kernel, on a strided view too."""
    base = torch.randint(0, 100, (300, 260), device="cuda")
    t = base.to(torch.uint8).view(dtype) if dtype.itemsize == 1 else base.to(dtype)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    f = torch.compile(lambda s: transposed_2d(s[7:290, 3:]), backend=backend, fullgraph=True)
    got = f(t)
    assert_bitwise_equal(got, transposed_2d(t[7:290, 3:]), f"compiled {dtype}")
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("transposed_2d" in s for s in targets), targets
