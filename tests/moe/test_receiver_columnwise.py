"""``expert_parallel.receiver_columnwise``: the one-call columnwise requantization of every
local expert's received rows equals the per-expert one bitwise (MXFP8; FP8 128-row blocks
with power-of-two scales), including an empty expert."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear, _wire
from hybrid_dist.moe import expert_parallel as ep
from tests._helpers import assert_storage_equal


@pytest.mark.parametrize("recipe_name", ["mxfp8", "fp8_block"])
def test_one_call_equals_per_expert(recipe_name, monkeypatch):
    recipe = hd.recipe_from_name(recipe_name)
    q = GroupedLinear(2, 256, 256, recipe=recipe).plan(recipe).input
    if not _wire.requantized_columnwise(q):
        pytest.skip(f"{recipe_name}: columnwise not requantized at the receiver")
    block = q.direction_quantizer("columnwise").block_shape("columnwise")[0]
    padded = [2 * block, 0, block, 3 * block]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(padded), 256, generator=g) * torch.logspace(-4, 4, sum(padded))[:, None]
    x = x.bfloat16()
    rows_all = q.quantize_storages(x, rowwise=True, columnwise=False)[0]
    spans = [(sum(padded[:j]), p) for j, p in enumerate(padded)]
    rows = [rows_all.narrow_dim0(s, p) for s, p in spans]
    cq = q.direction_quantizer("columnwise")
    calls, quantize = [], type(cq).quantize_storages
    monkeypatch.setattr(type(cq), "quantize_storages", lambda self, *a, **k: calls.append(1) or quantize(self, *a, **k))
    got = ep.receiver_columnwise(q, rows_all, rows, spans, torch.bfloat16)
    assert len(calls) == 1, f"{recipe_name}: {len(calls)} quantize calls for {len(spans)} experts"
    monkeypatch.undo()
    for j, (st, col) in enumerate(zip(rows, got)):
        want = _wire.columnwise_of(q, st, st.dequantize(torch.bfloat16))
        assert_storage_equal(col, want, f"{recipe_name} expert {j} ({padded[j]} rows)")
