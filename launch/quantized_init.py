"""``--quantized-init``: create the block weights as QuantizedTensors (``hd.quantized_model_init``).

Sharding quantized parameters with FSDP2 needs the all-gather hooks of
``hybrid_dist.fsdp2``; until that package exports them, a run that would shard (or
mixed-precision-cast) quantized parameters raises ``NotImplementedError`` here instead of
failing deep inside ``fully_shard``.
"""

from __future__ import annotations

def fsdp2_supports_quantized_params() -> bool:
    """True once ``QuantizedTensor`` implements FSDP2's all-gather hooks (``hybrid_dist.fsdp2``)."""
    import hybrid_dist as hd

    return hasattr(hd.QuantizedTensor, "fsdp_pre_all_gather")


def check_quantized_init(*, needs_fsdp: bool, tp: int) -> None:
    """Checkpoints of quantized-init runs hold the fp32 masters (``launch.checkpoint``)."""
    if tp > 1:
        raise NotImplementedError(
            "--quantized-init with --tp > 1 is not supported yet: the tensor-parallel styles shard "
            "high-precision weights; drop --quantized-init or use --tp 1")
    if needs_fsdp and not fsdp2_supports_quantized_params():
        raise NotImplementedError(
            "--quantized-init with FSDP2 needs hybrid_dist.fsdp2's all-gather hooks for quantized "
            "parameters, which have not landed in this checkout; run on one rank with --dtype fp32, or "
            "drop --quantized-init (FSDP2 then shards high-precision weights and each GEMM quantizes)")
