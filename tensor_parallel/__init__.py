"""hybrid_dist.tensor_parallel: quantized TP/SP all-gathers and ``ParallelStyle``s for
``hd.Linear`` (see DESIGN §3).

* ``gather_along_first_dim`` / ``reduce_scatter_along_first_dim`` (``gather.py``);
* ``record_wire_bytes`` (bytes on the wire per collective, ``_comm.py``);
* ``HybridColwiseParallel``, ``HybridRowwiseParallel``, ``PrepareHybridModuleInput``
  (``styles.py``; the autograd functions are in ``_linear_fn.py``).
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
    "CollectiveHandle", "HybridColwiseParallel", "HybridRowwiseParallel", "PrepareHybridModuleInput", "WireEvent", "WireLog", "gather_along_first_dim", "quantize_with_group_amax",
    "record_wire_bytes", "reduce_scatter_along_first_dim",
]
