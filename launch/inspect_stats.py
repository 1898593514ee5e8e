"""``--inspect-every N``: quantization statistics of every ``hd.Linear`` at logging steps.

The first step of a run and every N-th step after it run inside a ``StatsCollector``
capture on rank 0 (``hybrid_dist.inspection``); its records go to the metrics JSONL as one
``{"event": "inspect", "step", "rank", "records": [...]}`` line. Every other step runs
exactly as without ``--inspect-every`` (no hook, no op). Under ``--compile`` the first
(captured) step compiles the blocks' capturing graph, inside the timing warm-up.

What a record describes (also in the record): the operand on rank 0: a weight gathered by
FSDP2 is the full weight (``"scope": "full"``); under tensor parallelism weights and the
sharded activations / gradients are rank 0's shards (``"scope": "shard"``); activations and
gradients are rank 0's micro-batch. A sequence-parallel (gathered) input or gradient is not
recorded: rank 0 holds only its shard in high precision.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hybrid_dist.inspection import StatsCollector


def is_inspect_step(step: int, *, every: int, start: int) -> bool:
    """The run's first step and every ``every``-th step (``every`` 0: never)."""
    return every > 0 and (step == start + 1 or step % every == 0)


class StepInspector:
    """Captures and reads the statistics of inspect steps on rank 0."""

    def __init__(self, model: nn.Module, *, every: int, start: int, rank: int, device: torch.device):
        self.every, self.start = every, start
        self.collector = StatsCollector(model, device=device) if every > 0 and rank == 0 else None

    def active(self, step: int) -> bool:
        return self.collector is not None and is_inspect_step(step, every=self.every, start=self.start)

    def capture(self, step: int):
        return self.collector.capture() if self.active(step) else contextlib.nullcontext()

    def records(self, step: int) -> list[dict] | None:
        """This step's records (one device-to-host copy), or None off an inspect step."""
        return self.collector.read() if self.active(step) else None
