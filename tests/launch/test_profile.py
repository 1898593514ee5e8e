"""``launch.profile.StepProfiler``: one trace over consecutive steps on rank 0, the device
waited for only after the last; the loop reads back after the last profiled step only."""

from __future__ import annotations

import gzip
import json

from hybrid_dist.launch.config import TrainConfig
from hybrid_dist.launch.profile import StepProfiler
from hybrid_dist.launch.read_back import reads_back
from hybrid_dist.launch.train import main


def test_profiles_only_its_steps_and_rank_0():
    prof = StepProfiler(3, 2, rank=0)
    assert [s for s in range(1, 8) if prof.profiles(s)] == [3, 4]
    assert not any(StepProfiler(0, 2, rank=0).profiles(s) for s in range(1, 8))  # --profile-step 0: off
    cfg = TrainConfig(preset="tiny", steps=20, log_every=10, quiet=True, profile_step=5, profile_steps=3)
    assert [s for s in range(3, 10) if reads_back(s, cfg, 0, False)] == [7]  # the last profiled step only


def test_trace_spans_the_profiled_steps(tmp_path, capsys):
    """Without CUDA, --profile-device-only still records the host (there is no device)."""
    trace = tmp_path / "steps.json.gz"
    assert main(["--preset", "tiny", "--steps", "4", "--log-every", "100", "--profile-step", "2",
                 "--profile-steps", "2", "--profile-trace", str(trace), "--profile-device-only"]) == 0
    out = capsys.readouterr().out
    assert "profile: 2 step(s)" in out, out[-2000:]
    with gzip.open(trace, "rt") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    assert names.count("hd::forward") == 2 and names.count("hd::optimizer") == 2
