"""Traced graphs of ``kernel_op`` launches without a GPU: a ``triton_target`` fixture that
hands Triton an sm_90 target on a CPU-only machine (the decomposition reads the kernel's
TTIR to find the tensors it stores to, which needs an active driver), and the forward graph
AOTAutograd hands a backend."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def triton_target(monkeypatch):
    if torch.cuda.is_available():
        return "cuda"
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", _Sm90())
    return "cpu"


class _Captured(Exception):
    pass


def forward_graph(fn, *args, min_cut: bool = False) -> torch.fx.GraphModule:
    """The functionalized forward graph AOTAutograd hands a backend for ``fn(*args)``;
    ``min_cut``: partitioned as inductor partitions (with AOTAutograd's CSE)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    graphs = []

    def backend(gm, example_inputs):
        def capture(g, _):
            graphs.append(g)
            raise _Captured

        partition = min_cut_rematerialization_partition if min_cut else default_partition
        return aot_module_simplified(gm, example_inputs, fw_compiler=capture, partition_fn=partition)

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:  # the backend stops after tracing (nothing runs)
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert graphs, f"no graph traced: {info.value!r}"
    return graphs[0]
