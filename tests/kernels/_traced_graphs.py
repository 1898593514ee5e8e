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


def cuda_kernels_on_cpu(monkeypatch) -> None:
    """Route the kernel registry's lookups to the CUDA implementations for CPU tensors too
    (registered here on a CPU-only host; every table restored after the test), so a traced
    model takes its CUDA path: ``kernel_op`` launches, ``torch._scaled_mm``."""
    import hybrid_dist as hd
    from hybrid_dist import _kernel_registry as reg
    from hybrid_dist.kernels import _register

    for name, table in list(vars(reg).items()):  # the registry's tables: _QUANTIZE, _GEMM, ...
        if name.startswith("_") and not name.startswith("__") and name.isupper() and isinstance(table, (dict, list)):
            monkeypatch.setattr(reg, name, table.copy())
    if hd.Float8Quantizer not in reg._QUANTIZE:  # CPU-only hosts register no CUDA kernels
        _register.register_all()
    monkeypatch.setattr(reg, "quantize_impl_for", lambda q, t: reg._QUANTIZE.get(type(q)))
    monkeypatch.setattr(reg, "gemm_impls_for", lambda device: reg._GEMM)


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
