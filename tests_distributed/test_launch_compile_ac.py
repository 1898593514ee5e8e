"""``--compile --activation-checkpointing`` (2 gloo ranks, 2 blocks, FSDP 2).

A module with its own recipe keeps no Python state in its forward, so a checkpointed block
compiles whole (Dynamo refuses a side effect inside the checkpoint's higher-order op and
would run the whole block eagerly): one graph, no break, and the losses bitwise those of the
compiled run without recompute. Delayed scaling compiles whole too: the launcher moves the
layers' state advance into the root's forward pre-hook (``hybrid_dist.hoisted_advance``),
outside the checkpoints; its losses are bitwise those of the compiled run without
recompute. Blocks that hold an expert-parallel exchange or tensor-parallel linears run
eagerly instead, with a warning (``launch.parallelize.compiled_recompute_refusal``): the
exchange cannot run inside a compiled checkpoint (Dynamo cannot break there), and
AOTAutograd cannot save the TP linears' device mesh there; their losses are bitwise the
eager recompute's.
"""

from __future__ import annotations

import warnings

from tests_distributed._harness import run_ranks
from tests_distributed.test_launch_train import STEPS, _cfg, _compiled_run


def _runs(rank, world_size):
    from hybrid_dist.launch.loop import train

    out = {}
    kw = dict(layers=2)
    for recipe in ("fp8_current", "fp8_delayed"):
        runs = {ac: _compiled_run(_cfg(recipe, compile=True, activation_checkpointing=ac, **kw))
                for ac in (False, True)}
        out[recipe] = {ac: (r["losses"], r["compile_stats"]) for ac, r in runs.items()}
    for name, recipe, extra, word in (("ep", "fp8_current", dict(moe_experts=4, ep=2), "expert-parallel"),
                                      ("tp", "fp8_current", dict(tp=2, fsdp=1), "tensor-parallel")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = _compiled_run(_cfg(recipe, compile=True, activation_checkpointing=True, **kw, **extra))
        eager = train(_cfg(recipe, activation_checkpointing=True, **kw, **extra))
        out[name] = (compiled["losses"], compiled["compile_stats"], eager["losses"],
                     [str(w.message) for w in caught if word in str(w.message)])
    return out


def test_compiled_recompute_compiles_whole_or_stays_eager_for_parallel_blocks():
    r0, _ = run_ranks(_runs, 2)
    where = "tiny layers=2 fsdp=2 gloo --compile"
    for recipe in ("fp8_current", "fp8_delayed"):
        (plain, plain_stats), (ac, ac_stats) = r0[recipe][False], r0[recipe][True]
        assert ac_stats == plain_stats == {"graphs": 1, "graph_breaks": 0}, (
            f"{where} {recipe}: with recompute {ac_stats}, without {plain_stats}")
        assert ac == plain and len(ac) == STEPS, f"{where} {recipe}: losses with recompute {ac}, without {plain}"
    for name, what in (("ep", "fp8_current moe_experts=4 ep=2"), ("tp", "fp8_current tp=2")):
        compiled, stats, eager, warned = r0[name]
        assert stats["graphs"] == 0 and warned, f"{where} {what} --activation-checkpointing: {stats}, {warned}"
        assert compiled == eager, f"{where} {what} with recompute: losses {compiled}, eager {eager}"
