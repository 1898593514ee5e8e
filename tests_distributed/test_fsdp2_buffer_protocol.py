"""The FSDP2 buffer protocol of every storage, without a process group.

``fsdp_extract_buffers`` on each rank's dim-0 shard, an all-gather emulated by
concatenating the ranks' buffers along dim 0 (what FSDP2's all-gather produces), then
``fsdp_assign_gathered``: the result equals the direction of the full quantized tensor
bitwise, for every format and both directions (columnwise storages are transposed for
transport and back). A second gather refreshes the same storage in place (``out=``).
Only dim-0-sharded fields travel (``fsdp_buffer_fields``); per-tensor scalars ride in the
metadata, so the bytes sent per shard are the storage's bytes less those scalars.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.fsdp2 import fsdp_assign_gathered, fsdp_buffer_fields, fsdp_extract_buffers
from tests._helpers import assert_storage_equal

WORLD, M, K = 4, 512, 256  # shards of 128 rows: a multiple of every format's dim-0 block

QUANTIZERS = {
    "fp8_e4m3": hd.Float8Quantizer(),
    "fp8_block_1x128": hd.Float8BlockQuantizer(block="1x128"),
    "fp8_block_128x128": hd.Float8BlockQuantizer(block="128x128"),
    "mxfp8": hd.MXFP8Quantizer(),
    "nvfp4_1d": hd.NVFP4Quantizer(),
    "nvfp4_2d": hd.NVFP4Quantizer(block_2d=True),
    "identity_bf16": hd.IdentityQuantizer(dtype=torch.bfloat16),
    "mxfp8_row_nvfp4_col": hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(), columnwise=hd.NVFP4Quantizer()),
}


def _gather(shards, direction):
    """Each rank's transport buffers, concatenated along dim 0 per field (the all-gather)."""
    per_rank = [fsdp_extract_buffers(s.storage_of(direction)) for s in shards]
    gathered = [torch.cat([bufs[i] for bufs, _ in per_rank]) for i in range(len(per_rank[0][0]))]
    return gathered, per_rank[0][1], per_rank


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_extract_gather_assign_equals_full_tensor(name, direction):
    q = QUANTIZERS[name]
    g = torch.Generator().manual_seed(0)
    w, w_next = (torch.randn(M, K, generator=g) for _ in range(2))
    amax = w.abs().amax()  # one per-tensor scale for every shard (what FSDP2's amax sync gives)
    full = q.quantize(w, amax=amax if q.is_per_tensor else None)
    shards = [full[r * (M // WORLD):(r + 1) * (M // WORLD)] for r in range(WORLD)]
    gathered, meta, per_rank = _gather(shards, direction)
    st, owned = fsdp_assign_gathered(gathered, meta, WORLD)
    assert_storage_equal(st, full.storage_of(direction), f"{name} {direction}: assigned")

    fields = fsdp_buffer_fields(full.storage_of(direction))
    scalar_bytes = sum(t.numel() * t.element_size() for f, t in full.storage_of(direction).tensors().items()
                       if f not in fields)
    sent = sum(b.numel() * b.element_size() for bufs, _ in per_rank for b in bufs)
    assert sent == full.storage_of(direction).nbytes() - scalar_bytes, f"{name} {direction}: bytes sent"

    # a later step: new values gathered into the same storage, in place
    amax_next = w_next.abs().amax()
    full_next = q.quantize(w_next, amax=amax_next if q.is_per_tensor else None)
    gathered, meta, _ = _gather([full_next[r * (M // WORLD):(r + 1) * (M // WORLD)] for r in range(WORLD)], direction)
    ptrs = {f: t.data_ptr() for f, t in st.tensors().items()}
    refreshed, new_owned = fsdp_assign_gathered(gathered, meta, WORLD, out=st)
    assert refreshed is st and new_owned == [], f"{name} {direction}: refresh must reuse the storage"
    assert_storage_equal(st, full_next.storage_of(direction), f"{name} {direction}: refreshed")
    for f in fields:  # gathered fields are written in place (FSDP owns and re-allocates them)
        assert st.tensors()[f].data_ptr() == ptrs[f], f"{name} {direction}: field {f} was replaced"


def test_buffer_fields_are_the_dim0_sharded_ones():
    w = torch.randn(M, K)
    fp8 = hd.Float8Quantizer().quantize(w)
    assert fsdp_buffer_fields(fp8.rowwise) == ("data",)  # scale_inv is per tensor
    assert fsdp_buffer_fields(fp8.columnwise) == ("data",)
    mx = hd.MXFP8Quantizer().quantize(w)
    assert set(fsdp_buffer_fields(mx.rowwise)) == set(fsdp_buffer_fields(mx.columnwise)) == {"data", "scale"}
