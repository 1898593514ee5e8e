"""A frozen rank fails the job within ``--collective-timeout`` instead of blocking it.

A real ``torchrun`` job of 2 gloo ranks; once rank 0 has logged step 2, rank 1 is stopped
(SIGSTOP, as a hung process would be). Rank 0's next collective must give up after the
timeout (5 s here; the group starts with ``--first-step-timeout``'s 600 s and is shortened
after the first step), the job must exit non-zero well before 600 s, and rank 0's error
must name rank 1 as the rank behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests._tiers import slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


@slow
@pytest.mark.skipif(sys.platform != "linux", reason="uses ps and SIGSTOP")
def test_frozen_rank_fails_the_job_within_the_timeout():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hybrid_dist.launch.train",
           "--preset", "tiny", "--layers", "1", "--steps", "100000", "--fsdp", "2", "--collective-timeout", "5"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stopped = []
    try:
        for line in job.stdout:
            if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= 2:
                break
        workers = _children(job.pid)
        assert len(workers) == 2, f"expected 2 worker processes under torchrun, found {workers}"
        os.kill(workers[1], signal.SIGSTOP)
        stopped.append(workers[1])
        t0 = time.monotonic()
        rc = job.wait(timeout=120)
        waited = time.monotonic() - t0
        rest = job.stdout.read()
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
    assert rc != 0, "the job finished although a rank was frozen"
    assert waited < 90, f"the job took {waited:.0f} s to fail with --collective-timeout 5"
    assert "it is frozen or lost: rank 1 (" in rest, rest[-3000:]
