"""``launch.heartbeat``: the shorter timeout after the first step, and a timeout message that
names the ranks behind."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hybrid_dist.launch.heartbeat import Heartbeat, is_timeout, shorten_timeouts, timeout_message
from tests_distributed._harness import run_ranks


def test_message_names_the_ranks_behind():
    store = dist.HashStore()
    beats = [Heartbeat(r, 4, store) for r in range(4)]
    beats[0].beat(5)
    beats[1].beat(4)
    beats[3].beat(5)  # rank 2 never finished a step
    msg = timeout_message(beats[0], step=6, seconds=30)
    assert msg.startswith("rank 0: a collective of step 6 waited more than 30 s")
    assert "rank 1 (last finished step 4)" in msg and "rank 2 (last finished step none)" in msg
    assert "rank 3" not in msg
    assert beats[0].last_steps() == {0: 5, 1: 4, 2: None, 3: 5}


def test_message_names_the_rank_that_did_not_report():
    """Every rank finished the previous step: the ranks that report no timeout of their own
    within the grace period are named."""
    store = dist.HashStore()
    beats = [Heartbeat(r, 3, store) for r in range(3)]
    for b in beats:
        b.beat(3)
    store.set("hybrid_dist/0/timed_out/2", "4")  # rank 2 timed out too; rank 1 is silent
    msg = timeout_message(beats[0], step=4, seconds=5, grace_s=0.5)
    assert "it is frozen or lost: rank 1 (no timeout of its own reported within 0.5 s)" in msg, msg
    assert "rank 2 (" not in msg
    for b in beats[1:]:
        b.silent_ranks(4, 0)
    assert "every rank timed out in it" in timeout_message(beats[0], step=4, seconds=5, grace_s=0.5)


def test_is_timeout():
    assert is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv"))
    assert not is_timeout(RuntimeError("Connection closed by peer"))


def _late_rank(rank, world_size):
    """Rank 1 joins an all-reduce 4 s late: with the group's timeout shortened to 1 s, rank 0's
    wait times out (the group was created with gloo's default, 30 min)."""
    shorten_timeouts(1.0)
    if rank == 1:
        time.sleep(4)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        return is_timeout(e)
    return False


def test_shortened_timeout_applies_to_the_group():
    timed_out = run_ranks(_late_rank, 2, timeout=120)
    assert timed_out[0], "rank 0 waited past the 1 s timeout set by shorten_timeouts"


@pytest.mark.parametrize("flag", ["--collective-timeout", "--first-step-timeout"])
def test_timeouts_must_be_positive(flag):
    from hybrid_dist.launch.config import parse_args

    with pytest.raises(ValueError, match=flag):
        parse_args(["--preset", "tiny", flag, "0"])
