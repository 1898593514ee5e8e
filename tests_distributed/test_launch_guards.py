"""``launch.guards.first_nonfinite`` on FSDP2-sharded parameters (2 gloo ranks): a NaN or
inf in one rank's local shard, of a parameter's value (a bf16/fp32 DTensor, or the fp32
master of a quantized one under ``--quantized-init``) or of its gradient, is named by
both ranks alike, with one all-reduce for the whole model."""

from __future__ import annotations

import torch

from tests_distributed._harness import run_ranks

VALUE = "layers.1.attention.wo.weight"
GRAD = "layers.0.feed_forward.w2.weight"


def _locate(rank, world_size):
    import torch.distributed as dist

    from hybrid_dist.launch.config import TrainConfig
    from hybrid_dist.launch.guards import first_nonfinite
    from hybrid_dist.launch.loop import build_model, init_distributed, make_optimizer
    from hybrid_dist.launch.mesh import ParallelDims

    out = {}
    real_all_reduce = dist.all_reduce
    for quantized in (False, True):
        cfg = TrainConfig(preset="tiny", layers=2, seq_len=64, batch_size=2, recipe="fp8_current",
                          quantized_init=quantized)
        device = init_distributed()
        dims = ParallelDims(world_size=world_size, hsdp=1, fsdp=-1, tp=1, ep=1)
        model, mcfg, _ = build_model(cfg, dims, dims.build_meshes("cpu"), device)
        opt = make_optimizer(model, cfg)
        params = dict(model.named_parameters())
        got = {"sharded": type(params[VALUE]).__name__,
               "local": type(params[VALUE].to_local()).__name__ if hasattr(params[VALUE], "to_local") else None}
        got["clean"] = first_nonfinite(model, opt)
        calls = []

        def counting(*args, **kwargs):
            calls.append(1)
            return real_all_reduce(*args, **kwargs)

        values = opt.master_of(params[VALUE]) if quantized else params[VALUE]
        with torch.no_grad():
            if rank == 1:
                values.to_local()[0, 0] = float("inf")
        dist.all_reduce = counting
        try:
            got["value"] = first_nonfinite(model, opt)
        finally:
            dist.all_reduce = real_all_reduce
        got["all_reduces"] = len(calls)
        got["value_without_masters"] = first_nonfinite(model)
        with torch.no_grad():
            values.to_local()[0, 0] = 0.0
        tokens = torch.randint(0, mcfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(rank))
        logits, _ = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        got["after_backward"] = first_nonfinite(model, opt)
        if rank == 1:
            params[GRAD].grad.to_local()[-1, -1] = float("nan")
        got["grad"] = first_nonfinite(model, opt)
        out["quantized_init" if quantized else "bf16_params"] = got
    return out


def test_first_nonfinite_names_one_ranks_shard_on_every_rank():
    r0, r1 = run_ranks(_locate, 2, timeout=300)
    assert r0 == r1, f"the ranks name different places:\nrank 0 {r0}\nrank 1 {r1}"
    for name, got in r0.items():
        where = f"fp8_current, tiny L2, FSDP 2 gloo ranks, {name}"
        assert got["sharded"] == "DTensor", f"{where}: {got['sharded']}"
        if name == "quantized_init":
            assert got["local"] == "QuantizedTensor", f"{where}: {got['local']}"
        assert got["clean"] is None and got["after_backward"] is None, f"{where}: {got}"
        assert got["value"].startswith(f"{VALUE} value (1 of "), f"{where}: {got['value']}"
        assert got["all_reduces"] == 1, f"{where}: {got['all_reduces']} all-reduces"
        assert got["grad"].startswith(f"{GRAD} grad (1 of "), f"{where}: {got['grad']}"
        # the quantized values stay finite: only the master shows the inf
        assert (got["value_without_masters"] is None) == (name == "quantized_init"), f"{where}: {got}"
