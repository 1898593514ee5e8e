"""hybrid_dist.fsdp2: ``torch.distributed.fsdp.fully_shard`` of quantized parameters.

``hd.QuantizedTensor`` implements FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
by delegating to ``_hooks``, registered when this package is imported (``import hybrid_dist``
imports it), so ``fully_shard`` works unchanged on models built under
``hd.quantized_model_init``; each pass all-gathers only the direction it needs (``_hooks``).

Public helpers: the buffer protocol over storages (``fsdp_buffer_fields``,
``fsdp_extract_buffers``, ``fsdp_assign_gathered``), all-gather byte accounting
(``track_all_gather``), the post-optimizer amax synchronisation of per-tensor formats
(``sync_amax_and_requantize``, from ``hybrid_dist.sharded_params``;
``hd.MasterWeightOptimizer`` calls it for sharded parameters), and quantize-on-all-gather for high-precision parameters
(``quantize_on_all_gather`` / ``HighPrecisionParam``), which is also the fallback for
shards that do not align with a format's blocks. ``grad_copy_in.copy_in`` packs gradients
for the reduce-scatter as FSDP2 does, with host work per parameter where
``torch._chunk_cat`` has it per 2 KiB of gradient (the launcher's default, ``--fsdp-copy-in``).

Compositions: activation recompute under ``reshard_after_forward=True`` (recomputed
modules gather both directions, ``_pass`` [Note: activation recompute]); a 2D ``(dp, tp)``
mesh where ``hybrid_dist.tensor_parallel`` styles first slice quantized weights on ``tp``
and ``fully_shard`` then shards the tp-local ``QuantizedTensor`` over ``dp``. Delayed-
scaling amax histories and stochastic-rounding streams are part of the state dicts of
``hd.Linear`` and ``GroupedLinear`` (``_extra_state``), so DCP checkpoints carry them.
"""

from hybrid_dist.fsdp2._accounting import AllGatherAccounting, track_all_gather
from hybrid_dist.fsdp2._buffers import (
    DirectionGatherMeta,
    fsdp_assign_gathered,
    fsdp_buffer_fields,
    fsdp_extract_buffers,
)
from hybrid_dist.fsdp2._hooks import post_all_gather, pre_all_gather
from hybrid_dist.fsdp2._hp_param import HighPrecisionParam
from hybrid_dist.fsdp2._quantize_on_gather import quantize_on_all_gather
from hybrid_dist.quantized_tensor import register_fsdp_hooks
from hybrid_dist.sharded_params import sync_amax_and_requantize

register_fsdp_hooks(pre_all_gather, post_all_gather)

__all__ = [
    "AllGatherAccounting", "DirectionGatherMeta", "HighPrecisionParam", "fsdp_assign_gathered",
    "fsdp_buffer_fields", "fsdp_extract_buffers", "quantize_on_all_gather",
    "sync_amax_and_requantize", "track_all_gather",
]
