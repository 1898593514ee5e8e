"""``launch.read_back``: when the loop waits for the device, and the window's batches and
records (values read back once per window, every step still recorded)."""

from __future__ import annotations

import torch

from hybrid_dist.launch.config import TrainConfig
from hybrid_dist.launch.read_back import ReadBackWindow, reads_back


def _cfg(**kw):
    return TrainConfig(preset="tiny", steps=20, log_every=10, quiet=True, **kw)


def test_read_back_steps():
    cfg = _cfg(save_every=4, checkpoint_dir="unused")
    assert [s for s in range(1, 21) if reads_back(s, cfg, 0, False)] == [1, 2, 4, 8, 10, 12, 16, 20]
    assert [s for s in range(9, 21) if reads_back(s, _cfg(), 8, False)] == [9, 10, 20]  # resumed at 8
    assert reads_back(7, cfg, 0, True)  # an inspected step
    assert all(reads_back(s, _cfg(on_nonfinite="skip"), 0, False) for s in range(1, 21))


class _Data:
    def __init__(self):
        self.made = []

    def batch(self, step):
        self.made.append(step)
        return torch.full((1, 3), step)


class _Meter:
    def __init__(self):
        self.excluded, self.recorded = 0.0, []

    def exclude(self, seconds):
        self.excluded += seconds

    def steps(self, window):
        self.recorded.append(window)


def test_window_batches_and_records():
    data, meter = _Data(), _Meter()
    window = ReadBackWindow(_cfg(), 0, meter, data, torch.device("cpu"))
    assert window.batch(3).tolist() == [[3, 3, 3]] and data.made == list(range(3, 11))  # steps 3..10 at once
    assert window.batch(4).tolist() == [[4, 4, 4]] and data.made == list(range(3, 11))
    for step, loss in ((3, 2.5), (4, 2.0)):
        window.add(step, torch.tensor(loss), torch.tensor(float(step)), tokens=100, lr=0.1, ag_bytes=None)
    assert window.read_back() == [(3, 2.5, 3.0), (4, 2.0, 4.0)]
    assert meter.recorded == [[{"step": s, "loss": v, "grad_norm": float(s), "tokens": 100, "lr": 0.1, "ag_bytes": None}
                               for s, v in ((3, 2.5), (4, 2.0))]]
    no_clip = ReadBackWindow(_cfg(grad_clip=0.0), 0, meter, data, torch.device("cpu"))
    no_clip.add(5, torch.tensor(1.5), None, tokens=100, lr=0.1, ag_bytes=None)
    assert no_clip.read_back() == [(5, 1.5, None)]
