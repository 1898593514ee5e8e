"""The launcher under a real ``torchrun`` (2 gloo ranks): a bad flag is one line from
rank 0 and no traceback from the workers; with ``--max-restarts 1`` a rank killed mid-run
restarts the job, which continues from its newest complete checkpoint by itself, and its
metrics file marks where it resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests._tiers import slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
TRAIN = ["-m", "hybrid_dist.launch.train", "--preset", "tiny", "--layers", "1"]


@slow
def test_bad_flag_under_torchrun_is_one_line_from_rank_0():
    out = subprocess.run([*TORCHRUN, *TRAIN, "--fsdp", "3"], capture_output=True, text=True, timeout=300,
                         check=False)
    text = out.stdout + out.stderr
    errors = [ln for ln in text.splitlines() if ln.startswith("hybrid_dist.launch.train: error: ")]
    assert out.returncode != 0, text[-2000:]
    assert len(errors) == 1 and "hsdp*fsdp*tp = 1*3*1 = 3, but the world size is 2" in errors[0], text[-3000:]
    # torchrun reports the failed workers itself; no traceback comes from the job's code
    assert "launch/loop.py" not in text and "launch/mesh.py" not in text, text[-3000:]


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


@slow
@pytest.mark.skipif(sys.platform != "linux", reason="uses ps")
def test_restarted_job_resumes_from_its_newest_checkpoint(tmp_path):
    """fp8_delayed, a checkpoint every step: rank 1 is SIGKILLed once step 4 is logged;
    torchrun restarts both ranks, which resume from the newest complete step (>= 3) and
    finish; the steps run twice have bitwise the same losses."""
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    cmd = [*TORCHRUN, "--max-restarts", "1", *TRAIN, "--fsdp", "2", "--recipe", "fp8_delayed", "--steps", "12",
           "--checkpoint-dir", ckpt, "--save-every", "1", "--log-every", "1", "--metrics", metrics]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= 4:
                break
        workers = _workers(job.pid)
        assert len(workers) == 2, f"expected 2 workers under torchrun, found {workers}"
        os.kill(workers[1], signal.SIGKILL)
        lines += job.stdout.readlines()
        rc = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(lines)
    assert rc == 0, text[-3000:]
    runs = []  # [start record, {step: loss}] per start of the job
    with open(metrics) as fh:
        for rec in map(json.loads, fh):
            if rec["event"] == "start":
                runs.append((rec, {}))
            elif rec["event"] == "step":
                runs[-1][1][rec["step"]] = rec["loss"]
    assert len(runs) == 2, f"expected the first start and one restart, found {[r[0]['start_step'] for r in runs]}"
    (_, first), (restart, second) = runs
    resumed_at = restart["start_step"]
    assert resumed_at >= 3, f"the restart resumed at step {resumed_at}"
    assert sorted(second) == list(range(resumed_at + 1, 13)), sorted(second)
    again = sorted(set(first) & set(second))
    assert [first[s] for s in again] == [second[s] for s in again], f"steps {again} differ after the restart"
    assert f"summary: {12 - resumed_at} steps" in text, text[-2000:]
