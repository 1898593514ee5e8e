"""High-precision parameters quantized on all-gather (``quantize_on_all_gather``), and the
high-precision fallback for shards that do not align with a format's blocks.

The reference is the unsharded model with plain fp32 weights, which ``hd.Linear``
quantizes in full every forward. Sharded (2 gloo ranks, same batch on every rank) it must
train bitwise the same: aligned shards are quantized per rank with the all-reduced amax
and gathered per direction; unaligned ones warn once and gather fp32 then quantize.
``fp8_delayed`` is left out: its reference weights use delayed scaling state, the
all-gather quantizes with current scaling.
"""

from __future__ import annotations

import warnings

import torch

import hybrid_dist as hd
from tests_distributed._harness import run_ranks
from tests_distributed.test_fsdp2_numerics import _diff_count, shard

NAMES = [n for n in hd.RECIPE_NAMES if n != "fp8_delayed"]
# A custom recipe whose weights use RHT on the columnwise direction: its global scale comes
# from the transformed tensor's amax, so the gather must fall back to high precision.
EXTRA = {"custom:nvfp4_rht_weights": hd.CustomRecipe(
    lambda role: hd.NVFP4Quantizer(rht=True), name="nvfp4_rht_weights")}
ALIGNED = ((256, 128), (256, 256))  # (out, in): 128-row shards on 2 ranks


def _build(recipe, layers, quantized: bool = False):
    torch.manual_seed(0)
    if quantized:  # hd.quantized_model_init weights (keeps the high-precision init)
        with hd.quantized_model_init(recipe):
            return torch.nn.Sequential(*[hd.Linear(i, o, bias=False, recipe=recipe) for o, i in layers])
    return torch.nn.Sequential(*[hd.Linear(i, o, bias=False, recipe=recipe) for o, i in layers])


def train_hp(rank, world, names, layers, steps=2):
    from hybrid_dist.fsdp2 import quantize_on_all_gather, track_all_gather

    out = {}
    all_layers = layers
    for name in names:
        layers = all_layers[name] if isinstance(all_layers, dict) else all_layers
        quantized = name.startswith("qinit:")
        recipe = EXTRA.get(name) or hd.recipe_from_name(name.removeprefix("qinit:"))
        ref, model = _build(recipe, layers, quantized), _build(recipe, layers, quantized)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quantize_on_all_gather(model, shard_world_size=world)
        model = shard(model, reshard=True)
        opts = [hd.MasterWeightOptimizer(torch.optim.AdamW, m.parameters(), lr=1e-2) for m in (ref, model)]
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            x = torch.randn(128, layers[0][1], generator=gen)
            with track_all_gather() as acct:
                ls = [m(x).square().mean() for m in (ref, model)]
                for loss in ls:
                    loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
            losses.append([loss.item() for loss in ls])
        diffs = {}
        for (fqn, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            local = p._local_tensor._data
            rows = -(-p_ref.shape[0] // world)
            master = opts[0].master_of(p_ref)  # the fp32 parameter itself for fp32 weights
            diffs[fqn] = _diff_count(local, master.detach()[rank * rows:rank * rows + local.shape[0]])
        out[name] = {"losses": losses, "diffs": diffs, "warnings": [str(w.message) for w in caught],
                     "bytes": dict(acct.output_bytes)}
    return out


def _assert_equal(res, layers):
    for rank, r in enumerate(res):
        for name, v in r.items():
            cfg = f"{name} layers={layers} rank {rank}"
            for step, (a, b) in enumerate(v["losses"]):
                assert a == b, f"{cfg}: step {step} loss {b} != unsharded {a}"
            bad = {k: n for k, n in v["diffs"].items() if n}
            assert not bad, f"{cfg}: parameters differ bitwise from the unsharded run: {bad}"


def test_quantize_on_all_gather_aligned_trains_bitwise_every_recipe():
    res = run_ranks(train_hp, 2, NAMES, ALIGNED)
    _assert_equal(res, ALIGNED)
    elems = sum(o * i for o, i in ALIGNED)
    fp8 = res[0]["fp8_current"]
    assert fp8["warnings"] == [], fp8["warnings"]
    assert fp8["bytes"] == {"forward": elems, "backward": elems}, f"fp8_current bytes {fp8['bytes']}"
    nv = res[0]["nvfp4"]["bytes"]
    assert nv == {"forward": elems * (0.5 + 1 / 256), "backward": elems * (0.5 + 1 / 256)}, f"nvfp4 bytes {nv}"


def test_unaligned_shards_warn_once_and_fall_back_bitwise():
    # one layer; 0.weight shards of 48 rows (MXFP8 columnwise needs 32), 24 (NVFP4 and the
    # hybrid's NVFP4 columnwise need 16), 192 (FP8 128x128 needs 128); the full weights are
    # valid for their formats
    layers = {"mxfp8": ((96, 128),), "nvfp4": ((48, 128),), "mxfp8_fwd_nvfp4_bwd": ((48, 128),),
              "fp8_block": ((384, 128),),
              # hd.quantized_model_init weights that cannot be split quantized: same fallback
              "qinit:nvfp4": ((48, 128),), "qinit:fp8_block": ((384, 128),)}
    res = run_ranks(train_hp, 2, list(layers), layers)
    _assert_equal(res, layers)
    for name, ls in layers.items():
        rows = ls[0][0] // 2
        block = {"fp8_block": 128, "mxfp8": 32}.get(name.removeprefix("qinit:"), 16)
        msgs = [m for m in res[0][name]["warnings"] if "0.weight" in m]
        assert len(msgs) == 1 and f"{rows} rows" in msgs[0] and f"{block}-row block" in msgs[0], (
            f"{name}: expected one warning naming 0.weight, {rows} rows, block {block}: {msgs}")
        assert res[0][name]["bytes"]["forward"] >= 4 * ls[0][0] * ls[0][1], f"{name}: fp32 fallback gather expected"


def test_rht_columnwise_weights_gather_in_high_precision_bitwise():
    name = "custom:nvfp4_rht_weights"
    res = run_ranks(train_hp, 2, [name], ALIGNED)
    _assert_equal(res, ALIGNED)
