"""FSDP2 of a model converted by ``hd.convert_to_hybrid(..., quantized_weights=True)``, a
Llama-shaped model of plain torch modules (``tests/_tiny_llama``), on 2 gloo ranks: bitwise
the unsharded converted model.

Every rank runs the same batch, so with 2 ranks FSDP's averaged gradients equal the
unsharded ones exactly. With the kept init (the default) each rank's masters start from its
rows of the original fp32 weights, carried through ``fully_shard``; without it, from the
dequantized shards. Either way losses, fp32 masters and every quantized shard byte equal
the unsharded run's rows bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from tests import _tiny_llama as tiny
from tests._tiers import recipe_groups
from tests_distributed._harness import run_ranks
from tests_distributed.test_fsdp2_numerics import _diff_count, _shard_mismatches

STEPS = 3


def convert(recipe, seed: int = 0, keep: bool = True):
    return hd.convert_to_hybrid(tiny.build(seed), recipe=recipe, quantized_weights=True,
                                keep_high_precision_init=keep)


def shard_llama(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_converted(rank, world, names):
    out = {}
    for name in names:
        recipe = hd.recipe_from_name(name)
        for keep in (True, False):
            ref, model = convert(recipe, keep=keep), shard_llama(convert(recipe, keep=keep))
            opt_ref = hd.MasterWeightOptimizer(torch.optim.AdamW, ref.parameters(), lr=1e-2)
            opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
            originals = dict(tiny.build().named_parameters())
            init_bits = {}
            for fqn, p in model.named_parameters():
                if isinstance(p._local_tensor, hd.QuantizedTensor):
                    rows = p._local_tensor.shape[0]
                    want = originals[fqn].detach()[rank * rows:(rank + 1) * rows]
                    init_bits[fqn] = _diff_count(want, opt.master_of(p)._local_tensor)
            losses = []
            for tokens in tiny.batches(STEPS):
                l_ref = tiny.loss_fn(ref, tokens)
                l_ref.backward()
                l_sh = tiny.loss_fn(model, tokens)
                l_sh.backward()
                for o in (opt_ref, opt):
                    o.step()
                    o.zero_grad()
                losses.append((l_ref.item(), l_sh.item()))
            params = {}
            for (fqn, p_ref), p in zip(ref.named_parameters(), model.parameters()):
                rows = p._local_tensor.shape[0]
                m_ref = opt_ref.master_of(p_ref)[rank * rows:(rank + 1) * rows]
                params[fqn] = {"master_bits": _diff_count(m_ref, opt.master_of(p)._local_tensor),
                               **_shard_mismatches(p_ref, p, rank)}
            out[(name, keep)] = {"losses": losses, "params": params, "init_bits": init_bits}
    return out


@pytest.mark.parametrize("names", recipe_groups())
def test_fsdp2_converted_quantized_weights_bitwise_like_unsharded(names):
    for rank, res in enumerate(run_ranks(train_converted, 2, names)):
        for (name, keep), r in res.items():
            cfg = f"{name} converted with quantized weights, keep_high_precision_init={keep}, 2 ranks (rank {rank})"
            for step, (l_ref, l_sh) in enumerate(r["losses"]):
                assert l_ref == l_sh, f"{cfg}: step {step} loss {l_sh} != unsharded {l_ref}"
            bad = {fqn: {k: v for k, v in m.items() if v} for fqn, m in r["params"].items()}
            bad = {k: v for k, v in bad.items() if v}
            assert not bad, f"{cfg}: masters / shards differ from the unsharded run: {bad}"
            assert len(r["init_bits"]) == tiny.LAYERS * 7 + 1, f"{cfg}: quantized weights {sorted(r['init_bits'])}"
            if keep:
                bad = {k: v for k, v in r["init_bits"].items() if v}
                assert not bad, f"{cfg}: sharded masters did not start from the original weights' rows: {bad}"
