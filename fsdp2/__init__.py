"""hybrid_dist.fsdp2: ``torch.distributed.fsdp.fully_shard`` of quantized parameters.

``hd.QuantizedTensor`` implements FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
by delegating here, so ``fully_shard`` works unchanged on models built under
``hd.quantized_model_init``; each pass all-gathers only the direction it needs (``_hooks``).

Public helpers: the buffer protocol over storages (``fsdp_buffer_fields``,
``fsdp_extract_buffers``, ``fsdp_assign_gathered``), all-gather byte accounting
(``track_all_gather``), and the post-optimizer amax synchronisation of per-tensor formats
(``sync_amax_and_requantize``).
"""

from hybrid_dist.fsdp2._accounting import AllGatherAccounting, track_all_gather
from hybrid_dist.fsdp2._buffers import (
    DirectionGatherMeta,
    fsdp_assign_gathered,
    fsdp_buffer_fields,
    fsdp_extract_buffers,
)

__all__ = [
    "AllGatherAccounting", "DirectionGatherMeta", "fsdp_assign_gathered", "fsdp_buffer_fields",
    "fsdp_extract_buffers", "track_all_gather",
]
