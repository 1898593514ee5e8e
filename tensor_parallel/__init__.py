"""hybrid_dist.tensor_parallel: quantized TP/SP all-gathers and ``ParallelStyle``s for
``hd.Linear`` (see docs/design.md §3).

Usage (a sequence-parallel MLP on the ``tp`` axis; activations seq-first ``[S/tp, B, H]``)::

    from torch.distributed.tensor.parallel import parallelize_module
    from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel

    parallelize_module(mlp, mesh["tp"], {
        "fc1": HybridColwiseParallel(sequence_parallel=True),   # gathers x in its fprop format
        "fc2": HybridRowwiseParallel(sequence_parallel=True),   # reduce-scatters y (bf16)
    })
    with record_wire_bytes() as log:                            # bytes per collective
        mlp(x).backward(dy)

Files: ``gather.py`` (``gather_along_first_dim`` — quantized path bitwise equal to
gather-then-quantize — and ``reduce_scatter_along_first_dim``), ``_comm.py`` (byte-packed
collectives, async handles, ``record_wire_bytes``), ``_inputs.py`` (SP input gather and
the saved wgrad operand), ``_linear_fn.py`` (column/row-parallel autograd functions),
``styles.py`` (``HybridColwiseParallel``, ``HybridRowwiseParallel``,
``PrepareHybridModuleInput``).
"""

from hybrid_dist.tensor_parallel._comm import CollectiveHandle, WireEvent, WireLog, record_wire_bytes
from hybrid_dist.tensor_parallel.gather import (
    gather_along_first_dim,
    quantize_with_group_amax,
    reduce_scatter_along_first_dim,
)
from hybrid_dist.tensor_parallel.styles import (
    HybridColwiseParallel,
    HybridRowwiseParallel,
    PrepareHybridModuleInput,
)

__all__ = [
    "CollectiveHandle", "HybridColwiseParallel", "HybridRowwiseParallel", "PrepareHybridModuleInput", "WireEvent",
    "WireLog", "gather_along_first_dim", "quantize_with_group_amax", "record_wire_bytes",
    "reduce_scatter_along_first_dim",
]
