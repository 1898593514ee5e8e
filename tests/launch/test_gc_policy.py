"""``launch.gc_policy.StepGC``: the collector runs as usual through the warm-up steps; then
the survivors are frozen, automatic collection is off and garbage made later is collected
every ``every`` steps; ``close`` restores the collector; ``every=0`` leaves it alone. A
launcher run leaves the process's collector as it found it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest

from hybrid_dist.launch.gc_policy import StepGC


class _Node:
    pass


def _cycle(finalized: list) -> None:
    """A reference cycle that only the collector frees; ``finalized`` gets a 1 when it does."""
    node = _Node()
    node.self = node
    weakref.finalize(node, finalized.append, 1)


def _collected_at(steps: StepGC, quiet: tuple, step: int) -> None:
    """A cycle made now survives the steps ``quiet`` and is collected at ``step``."""
    finalized = []
    _cycle(finalized)
    for s in quiet:
        steps.after_step(s)
    assert finalized == [], f"collected before step {step}"
    steps.after_step(step)
    assert finalized == [1], f"not collected at step {step}"


@pytest.fixture
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable() if was else gc.disable()


def test_warmup_survivors_frozen_later_garbage_collected_every_n_steps(collector_enabled):
    steps = StepGC(every=3, start=0, warmup=2)
    steps.after_step(1)
    assert gc.isenabled() and gc.get_freeze_count() == 0, "changed during the warm-up"
    steps.after_step(2)
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    finalized = []
    _cycle(finalized)
    for _ in range(3):  # the automatic collector would have run by now
        [_Node() for _ in range(2000)]
    assert finalized == []
    steps.after_step(3)
    assert finalized == [1]
    _collected_at(steps, (4, 5), 6)
    steps.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_resumed_run_freezes_after_its_own_warmup(collector_enabled):
    steps = StepGC(every=10, start=40, warmup=2)
    steps.after_step(41)
    assert gc.isenabled()
    finalized = []
    gc.disable()  # so that only the schedule can collect the cycle
    _cycle(finalized)
    steps.after_step(42)  # the last warm-up step: full collection, then freeze
    assert finalized == [1] and gc.get_freeze_count() > 0
    _collected_at(steps, (43, 49), 50)
    steps.close()


def test_every_zero_leaves_the_automatic_collector(collector_enabled):
    steps = StepGC(every=0, start=0, warmup=2)
    for step in (1, 2, 3):
        steps.after_step(step)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    steps.close()
    assert gc.isenabled()


def test_launcher_run_restores_the_collector():
    code = ("import gc\n"
            "from hybrid_dist.launch.config import TrainConfig\n"
            "from hybrid_dist.launch.loop import train\n"
            "out = train(TrainConfig(preset='tiny', recipe='bf16', layers=1, steps=4, batch_size=2, seq_len=32, "
            "gc_every=2, quiet=True))\n"
            "print('losses', len(out['losses']), 'enabled', gc.isenabled(), 'frozen', gc.get_freeze_count())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "losses 4 enabled True frozen 0" in out.stdout, out.stdout[-2000:]
