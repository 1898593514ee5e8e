"""``quantized_exchange.receiver_columnwise``: the one-call columnwise requantization of every
local expert's received rows equals the per-expert one bitwise (MXFP8; FP8 128-row blocks
with power-of-two scales), including an empty expert."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear, _wire
from hybrid_dist.moe import quantized_exchange as qx
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
    got = qx.receiver_columnwise(q, rows_all, rows, spans, torch.bfloat16)
    assert len(calls) == 1, f"{recipe_name}: {len(calls)} quantize calls for {len(spans)} experts"
    monkeypatch.undo()
    for j, (st, col) in enumerate(zip(rows, got)):
        want = _wire.columnwise_of(q, st, st.dequantize(torch.bfloat16))
        assert_storage_equal(col, want, f"{recipe_name} expert {j} ({padded[j]} rows)")


def test_nvfp4_columnwise_is_per_expert_and_packed_equals_the_loop():
    """``mxfp8_fwd_nvfp4_bwd``: the NVFP4 columnwise (global scale per expert, RHT) is made
    per expert from the received MXFP8 rows' values, one quantize call per expert (no
    one-call shortcut: a global scale over every expert would be wrong), and the packed
    receiver (``_packed_block_rows``, the rows arriving in another order than the experts')
    gives the loop's bytes in the packed layout."""
    import types

    from hybrid_dist.moe import device_split, split_quantize
    from hybrid_dist.moe.packed_index import IndexCache, packed_index

    recipe = hd.recipe_from_name("mxfp8_fwd_nvfp4_bwd")
    plan = GroupedLinear(4, 256, 256, recipe=recipe).plan(recipe)
    q, multiple = plan.input, plan.multiple
    assert _wire.requantized_columnwise(q)
    counts = [40, 0, 16, 70]
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(m, 256, generator=g) * 10.0 ** (j - 2) for j, m in enumerate(counts)]).bfloat16()
    tokens = torch.tensor(counts)
    rows = q.quantize_storages(x, rowwise=True, columnwise=False)[0]  # the wire rows, expert-major
    padded = [-(-m // multiple) * multiple for m in counts]
    loop = split_quantize(rows.dequantize(torch.bfloat16), tokens, [q] * 4, multiple=multiple)
    dest = packed_index(tokens, sum(counts), multiple).dest  # each row's padded row
    rows_all = _wire.unpack(_wire.pack(rows), rows, dest, sum(padded))
    spans = [(sum(padded[:j]), p) for j, p in enumerate(padded)]
    experts = [rows_all.narrow_dim0(s, p) for s, p in spans]
    got = qx.receiver_columnwise(q, rows_all, experts, spans, torch.bfloat16)
    scales = []
    for j, (col, want) in enumerate(zip(got, loop.columnwise)):
        assert_storage_equal(col, want, f"expert {j} ({counts[j]} rows)")
        scales.append(float(col.global_scale))
    assert len(set(scales[j] for j in (0, 2, 3))) == 3, f"per-expert global scales expected: {scales}"
    regroup = torch.randperm(sum(counts), generator=g)  # expert-major row i = received row regroup[i]
    wire = _wire.pack(rows)
    received = torch.empty_like(wire).index_copy_(0, regroup, wire)
    route = types.SimpleNamespace(tokens_per_local_expert=tokens, regroup=regroup,
                                  index=IndexCache(tokens, sum(counts)))
    packed = qx._packed_block_rows(received, rows, q, route, multiple, True, torch.bfloat16)
    in_order = _wire.split_fields(device_split.place_rows(wire, tokens, multiple)[0], rows)
    for f, t in packed.rowwise.items():
        assert torch.equal(t.view(torch.uint8), getattr(in_order, f).view(torch.uint8)), f"packed rowwise {f}"
    want = loop.packed("columnwise")
    for f, t in packed.columnwise.items():
        ax = loop.columnwise[0].field_axes()[f].get("C")
        if ax is None:  # per-expert [E] fields
            assert torch.equal(t.view(torch.uint8), want[f].view(torch.uint8)), f
            continue
        n = want[f].shape[ax[0]]
        assert torch.equal(t.narrow(ax[0], 0, n).contiguous().view(torch.uint8),
                           want[f].contiguous().view(torch.uint8)), f"packed columnwise field {f}"
