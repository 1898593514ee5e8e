"""``kernels._traced.kernel_op``: the FP8 cast ops decompose, under AOTAutograd, into one
traced Triton launch each, with only the buffers the kernel writes cloned (so inductor can
launch the kernel in place, with nothing copied). Traced without a GPU (``_traced_graphs``)."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.kernels._jit_common import INTERPRET
from tests.kernels._traced_graphs import forward_graph, triton_target  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(INTERPRET.value, reason="under the interpreter the ops are library_ops")


def _launches(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("hybrid_dist" in t for t in targets), f"an opaque hybrid_dist op is left: {targets}"
    assert not any("clone" in t or "copy_" in t for t in targets), f"a copy is made: {targets}"
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and "triton_kernel_wrapper_functional" in str(n.target)]


def test_current_cast_is_one_launch_writing_only_its_outputs(triton_target):
    from hybrid_dist.kernels.fp8.tensor import cast_current_op

    def f(x):
        amax = x.abs().amax().float()
        return cast_current_op(x, amax, torch.float8_e4m3fn, 0.0, False, True, True)

    x = torch.randn(96, 320, device=triton_target).bfloat16()
    (launch,) = _launches(forward_graph(f, x))
    assert sorted(launch.kwargs["tensors_to_clone"]) == ["col_ptr", "row_ptr", "scale_inv_ptr"]
    assert launch.kwargs["grid"] == [(2, 3, 1)]


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_cast_allocates_no_zero_dim_empty(triton_target, delayed):
    """The scale_inv the cast writes is a view of a ``[1]`` buffer: inductor emits a
    one-element fill kernel for every 0-d ``empty`` (``kernels._traced.traced_empty_f32``)."""
    from hybrid_dist.kernels.fp8.tensor import cast_current_op, cast_op

    def f(x, history):
        amax = x.abs().amax().float()
        if delayed:
            return cast_op(x, amax, amax, history, torch.float8_e4m3fn, False, 0.0, False, True, True, True)
        return cast_current_op(x, amax, torch.float8_e4m3fn, 0.0, False, True, True)

    x = torch.randn(96, 320, device=triton_target).bfloat16()
    gm = forward_graph(f, x, torch.zeros(4, device=triton_target))
    empties = [n for n in gm.graph.nodes if n.op == "call_function" and "empty" in str(n.target)]
    assert empties, "no allocation traced"
    shapes = [tuple(n.meta["val"].shape) for n in empties]
    assert () not in shapes, f"a 0-d empty is allocated: {shapes}"


def test_delayed_cast_writes_the_history(triton_target):
    from hybrid_dist.kernels.fp8.tensor import cast_op

    def f(x, scale, history):
        return cast_op(x, scale, scale, history, torch.float8_e4m3fn, False, 0.0, False, True, False, True)

    x = torch.randn(64, 128, device=triton_target).bfloat16()
    scale, history = torch.ones((), device=triton_target), torch.zeros(4, device=triton_target)
    gm = forward_graph(f, x, scale, history)
    (launch,) = [n for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)]
    # rowwise only: the unused columnwise pointer is the rowwise buffer
    assert sorted(launch.kwargs["tensors_to_clone"]) == ["amax_out_ptr", "row_ptr", "scale_inv_ptr"]
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert any(getattr(o, "args", (None, None))[1] == "amax_out_ptr" for o in out.args[0]), "history not written back"


def test_transpose_is_one_launch_writing_only_its_output(triton_target):
    from hybrid_dist.kernels.transpose import transposed_op

    x = torch.randint(0, 255, (200, 130), device=triton_target, dtype=torch.uint8).view(torch.float8_e4m3fn)
    (launch,) = _launches(forward_graph(lambda t: transposed_op(t[5:197]), x))
    assert sorted(launch.kwargs["tensors_to_clone"]) == ["dst_ptr"]
    assert launch.kwargs["grid"] == [(3, 3, 1)]  # ceil(192 / 64) x ceil(130 / 64)
