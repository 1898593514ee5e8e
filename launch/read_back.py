"""The training loop's read-back window: steps run without the host waiting for the device.

Each step's data-parallel mean loss and gradient norm stay on the device; the loop waits
for the device and reads them back (one copy for the whole window) only at *read-back
steps*: log steps, the last step, the first (compilation done) and the last untimed step
(timing starts after it), before each checkpoint (nothing non-finite is saved), at inspected
steps, after the last profiled step, and every step with ``--on-nonfinite skip`` (whose check
syncs anyway). In between, the host queues step N+1 while the device finishes step N, as torchtitan's loop
does between its log steps. Every step's values are still checked and written: a window's
wall time is shared equally by its steps (``Meter.steps``).

A window's synthetic batches are made at its first step, while the device is idle (a
read-back just ended), and left out of the step times as before; on CUDA they are pinned,
so each step's copy is queued without waiting for the device.
"""

from __future__ import annotations

import math
import time

import torch

from hybrid_dist.launch.config import TrainConfig


def reads_back(step: int, cfg: TrainConfig, start: int, inspected: bool) -> bool:
    """Whether the loop waits for the device after ``step`` (see the module note)."""
    return (step % cfg.log_every == 0 or step == cfg.steps or step == start + 1 or step == start + cfg.timing_warmup
            or bool(cfg.save_every and step % cfg.save_every == 0) or inspected or cfg.on_nonfinite == "skip"
            or step == cfg.profile_step + cfg.profile_steps - 1)


class ReadBackWindow:
    """``batch(step)`` before a step, ``add(...)`` after it, and ``read_back()`` when
    ``due(step, inspected)``: ``[(step, loss, grad_norm or None)]`` of the steps since the
    last read-back, recorded in ``meter``."""

    def __init__(self, cfg: TrainConfig, start: int, meter, data, device: torch.device):
        self.cfg, self.start, self.meter, self.data, self.device = cfg, start, meter, data, device
        self._pending: list[tuple] = []  # (step, [loss, norm] on the device, the record's other fields)
        self._batches: dict[int, torch.Tensor] = {}

    def batch(self, step: int) -> torch.Tensor:
        """``step``'s tokens on the device (the window's batches are made at its first step)."""
        if step not in self._batches:
            end = step
            while not reads_back(end, self.cfg, self.start, False):
                end += 1
            t0 = time.perf_counter()
            pin = self.device.type == "cuda"
            self._batches = {s: self.data.batch(s).pin_memory() if pin else self.data.batch(s)
                             for s in range(step, end + 1)}
            self.meter.exclude(time.perf_counter() - t0)
        return self._batches.pop(step).to(self.device, non_blocking=True)

    def add(self, step: int, loss_mean: torch.Tensor, grad_norm: torch.Tensor | None, **record) -> None:
        """``record``: the step record's other fields (``Meter.steps``: tokens, lr, ag_bytes,
        host_s)."""
        norm = loss_mean.new_full((), math.nan) if grad_norm is None else grad_norm.float()
        values = torch.stack([loss_mean, norm])
        self._pending.append((step, values, record))

    def due(self, step: int, inspected: bool) -> bool:
        return reads_back(step, self.cfg, self.start, inspected)

    def read_back(self) -> list[tuple[int, float, float | None]]:
        values = torch.stack([p[1] for p in self._pending]).tolist()  # one host sync for the window
        clipped = self.cfg.grad_clip > 0
        out = [(p[0], v[0], v[1] if clipped else None) for p, v in zip(self._pending, values)]
        self.meter.steps([{"step": step, "loss": loss, "grad_norm": norm, **p[2]}
                          for p, (step, loss, norm) in zip(self._pending, out)])
        self._pending = []
        return out


__all__ = ["ReadBackWindow", "reads_back"]
