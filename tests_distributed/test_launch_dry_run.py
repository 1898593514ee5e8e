"""``--dry-run --world-size 64`` on the fake process group: fsdp×tp×ep meshes validate,
and bad configurations raise ``ValueError``s that say what is wrong."""

from __future__ import annotations

import pytest

from hybrid_dist.launch.config import TrainConfig
from hybrid_dist.launch.dry_run import dry_run, format_report
from hybrid_dist.launch.presets import preset

GOOD = {
    "fsdp32_tp2_fp8_block": dict(preset="125m", fsdp=32, tp=2, recipe="fp8_block", batch_size=1, seq_len=1024),
    "hsdp2_fsdp8_tp4_ep4_moe8": dict(preset="125m", hsdp=2, fsdp=8, tp=4, ep=4, moe_experts=8,
                                     recipe="mxfp8_fwd_nvfp4_bwd", batch_size=2, seq_len=512),
    "fsdp64_nvfp4": dict(preset="tiny", recipe="nvfp4", batch_size=2, seq_len=64),
    "8b_fsdp16_tp4_fp8_block": dict(preset="8b", fsdp=16, tp=4, recipe="fp8_block", batch_size=1, seq_len=8192),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_dry_run_world_64_succeeds(name):
    kw = GOOD[name]
    report = dry_run(TrainConfig(**kw), world_size=64)
    mesh = report["mesh"]
    assert mesh["hsdp"] * mesh["fsdp"] * mesh["tp"] == 64, f"{name}: {mesh}"
    assert mesh["tp"] == kw.get("tp", 1) and mesh["ep"] == kw.get("ep", 1), f"{name}: {mesh}"
    m = preset(kw["preset"], moe_experts=kw.get("moe_experts", 0))
    assert report["params_total"] == m.num_params(), name
    # FSDP shards over dp_shard ranks (HSDP replicates over dp_replicate); TP splits the blocks
    shards = mesh["fsdp"] * mesh["tp"]
    assert m.num_params() / shards * 0.9 <= report["params_per_rank"] <= m.num_params() / mesh["fsdp"] + 64, name
    # 7 block projections x (weight, input, grad_output); MoE: 4 attention x 3 + 2 expert weights
    expected = 14 if kw.get("moe_experts") else 21
    assert report["checked_operands"] == expected, f"{name}: {report['checked_operands']}"
    assert report["memory_gib_per_rank"]["total"] > 0, name
    assert "dry run OK for 64 ranks" in format_report(report)


BAD = {
    "degrees_do_not_multiply": (dict(fsdp=3, tp=4), r"must multiply to the number of ranks"),
    "tp_not_dividing_world": (dict(tp=3), r"not divisible by hsdp\*tp"),
    "ep_not_dividing_fsdp": (dict(fsdp=16, tp=4, ep=3, moe_experts=6), r"--ep 3 must divide --fsdp 16"),
    "ep_not_dividing_experts": (dict(fsdp=16, tp=4, ep=4, moe_experts=6), r"--ep 4 must divide --moe-experts 6"),
    "tp_not_dividing_kv_heads": (dict(preset="tiny", seq_len=64, fsdp=16, tp=4), r"n_kv_heads=2"),
    "tokens_not_fitting_fp8_block": (dict(recipe="fp8_block", batch_size=1, seq_len=64),
                                     r"tokens per rank=64.*fp8_block.*columnwise.*multiple of the 128"),
    "tp_shard_not_fitting_fp8_block": (dict(recipe="fp8_block", fsdp=16, tp=4),
                                       r"attention.wq weight has local shape \[192, 768\] \(tp=4.*multiple of the 128"),
    "seq_too_long": (dict(preset="tiny", seq_len=4096), r"exceeds the preset's max_seq_len 256"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_dry_run_bad_config_raises_clear_error(name):
    kw, pattern = BAD[name]
    kw = {"preset": "125m", "batch_size": 2, "seq_len": 512, **kw}
    with pytest.raises(ValueError, match=pattern):
        dry_run(TrainConfig(**kw), world_size=64)


def test_config_rejects_ep_without_moe():
    with pytest.raises(ValueError, match=r"--ep 2 needs an MoE model"):
        TrainConfig(ep=2)
