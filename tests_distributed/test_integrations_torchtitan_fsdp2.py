"""torchtitan's Llama 3 (tiny) converted by ``HybridLinearConverter(quantized_all_gather=True)``
under FSDP2 on 2 gloo ranks: weights all-gathered quantized per direction, losses bitwise the
unsharded converted model's and each block's forward all-gather moves about a
quarter of the fp32 bytes (every rank runs the same batch, so the averaged gradients equal
the unsharded ones). Skipped without torchtitan."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e \".[torchtitan]\")")

from hybrid_dist.fsdp2 import track_all_gather  # noqa: E402
from hybrid_dist.integrations.torchtitan import HybridLinearConverter  # noqa: E402
from tests.integrations import _titan_llama as tl  # noqa: E402
from tests_distributed._harness import run_ranks  # noqa: E402

STEPS = 3


def _model(recipe: str, gather: bool):
    cfg = HybridLinearConverter.Config(recipe=recipe, quantized_all_gather=gather).build().convert(tl.config())
    return tl.build(cfg, meta=True)


def train(rank, world, recipe):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref, model = _model(recipe, False), _model(recipe, True)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    tokens = tl.batches(1)[0]
    losses = []
    with track_all_gather() as acc:
        for _ in range(STEPS):
            pair = [tl.loss_fn(m, tokens) for m in (ref, model)]
            for loss, opt in zip(pair, opts):
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append((pair[0].item(), pair[1].item()))
    # the blocks' weights: the root (lm_head) is not resharded after forward, so it gathers
    # both directions once, under another pass
    fp32 = sum(m.weight.numel() * 4 // world for m in ref.layers.modules() if hasattr(m, "plan_for"))
    return {"losses": losses, "forward_bytes": acc.input_bytes["forward"], "fp32_bytes": fp32 * STEPS}


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8_fwd_nvfp4_bwd"])
def test_converter_fsdp2_quantized_all_gather_bitwise_like_unsharded(recipe):
    for rank, res in enumerate(run_ranks(train, 2, recipe)):
        for step, (want, got) in enumerate(res["losses"]):
            assert got == want, f"{recipe}, rank {rank}, step {step}: sharded loss {got!r} != unsharded {want!r}"
        assert res["losses"][-1][1] < res["losses"][0][1], res["losses"]
        ratio = res["forward_bytes"] / res["fp32_bytes"]  # rowwise 8-bit elements (+ scales) vs fp32 shards
        assert 0.25 <= ratio < 0.3, f"{recipe}, rank {rank}: forward all-gather {ratio:.3f} of the fp32 bytes"
