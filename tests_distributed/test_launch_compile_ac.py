"""``--compile --activation-checkpointing`` (2 gloo ranks, 2 blocks, FSDP 2).

A module with its own recipe keeps no Python state in its forward, so a checkpointed block
compiles whole (Dynamo refuses a side effect inside the checkpoint's higher-order op and
would run the whole block eagerly): one graph, no break, and the losses bitwise those of the
compiled run without recompute. Blocks that advance delayed-scaling states in their forward,
or hold an expert-parallel exchange or tensor-parallel linears, run eagerly instead, with a
warning (``launch.parallelize.compiled_recompute_refusal``): a compiled recompute would
recompute that advance from the already advanced state, the exchange cannot run inside a
compiled checkpoint (Dynamo cannot break there), and AOTAutograd cannot save the TP linears'
device mesh there; their losses are bitwise the eager recompute's.
"""

from __future__ import annotations

import warnings

from tests_distributed._harness import run_ranks
from tests_distributed.test_launch_train import STEPS, _cfg, _compiled_run


def _runs(rank, world_size):
    from hybrid_dist.launch.loop import train

    out = {}
    kw = dict(layers=2)
    current = {ac: _compiled_run(_cfg("fp8_current", compile=True, activation_checkpointing=ac, **kw))
               for ac in (False, True)}
    out["current"] = {ac: (r["losses"], r["compile_stats"]) for ac, r in current.items()}
    for name, recipe, extra, word in (("delayed", "fp8_delayed", {}, "delayed-scaling"),
                                      ("ep", "fp8_current", dict(moe_experts=4, ep=2), "expert-parallel"),
                                      ("tp", "fp8_current", dict(tp=2, fsdp=1), "tensor-parallel")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = _compiled_run(_cfg(recipe, compile=True, activation_checkpointing=True, **kw, **extra))
        eager = train(_cfg(recipe, activation_checkpointing=True, **kw, **extra))
        out[name] = (compiled["losses"], compiled["compile_stats"], eager["losses"],
                     [str(w.message) for w in caught if word in str(w.message)])
    return out


def test_compiled_recompute_compiles_whole_or_stays_eager_for_delayed_scaling():
    r0, _ = run_ranks(_runs, 2)
    (plain, plain_stats), (ac, ac_stats) = r0["current"][False], r0["current"][True]
    where = "tiny layers=2 fsdp=2 gloo --compile"
    assert ac_stats == plain_stats == {"graphs": 1, "graph_breaks": 0}, (
        f"{where} fp8_current: with recompute {ac_stats}, without {plain_stats}")
    assert ac == plain and len(ac) == STEPS, f"{where} fp8_current: losses with recompute {ac}, without {plain}"
    for name, what in (("delayed", "fp8_delayed"), ("ep", "fp8_current moe_experts=4 ep=2"),
                       ("tp", "fp8_current tp=2")):
        compiled, stats, eager, warned = r0[name]
        assert stats["graphs"] == 0 and warned, f"{where} {what} --activation-checkpointing: {stats}, {warned}"
        assert compiled == eager, f"{where} {what} with recompute: losses {compiled}, eager {eager}"
