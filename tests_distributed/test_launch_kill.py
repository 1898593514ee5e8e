"""A ``torchrun`` job killed (SIGKILL) at an arbitrary moment of a run that saves every step
resumes from its newest complete checkpoint.

Each round starts the job (2 gloo ranks, a checkpoint every step), waits until a few steps
are saved, then SIGKILLs torchrun and its workers a little later, most often while a save
is under way. ``--resume DIR`` must then continue from the newest step with a ``COMPLETE``
record, whatever the kill left behind (``.partial`` directories, half-written files).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests._tiers import slow
from tests_distributed._harness import kill_tree


def _job(ckpt: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hybrid_dist.launch.train",
            "--preset", "tiny", "--layers", "1", "--fsdp", "2", "--recipe", "fp8_delayed", "--steps", "1000",
            "--checkpoint-dir", ckpt, "--save-every", "1", "--log-every", "1", *extra]


@slow
@pytest.mark.skipif(sys.platform != "linux", reason="uses ps")
@pytest.mark.parametrize("delay_s", [0.05, 0.2])
def test_sigkill_at_any_moment_resumes_from_the_newest_complete_step(tmp_path, delay_s):
    from hybrid_dist.launch import checkpoint

    ckpt = str(tmp_path / "ckpt")
    job = subprocess.Popen(_job(ckpt), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=os.setsid)  # its own group
    try:
        for line in job.stdout:
            if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= 3:
                break
        time.sleep(delay_s)
    finally:
        kill_tree(job.pid)
        job.wait(timeout=60)
    done = checkpoint.complete_steps(ckpt)
    assert done, f"no complete step after the kill: {sorted(os.listdir(ckpt))}"
    newest = int(os.path.basename(done[-1]).split("_")[1])
    resumed = subprocess.run(_job(ckpt, "--resume", ckpt, "--steps", str(newest + 2)), capture_output=True,
                             text=True, timeout=300, check=False)
    assert resumed.returncode == 0, f"resume after SIGKILL failed ({sorted(os.listdir(ckpt))}):\n" \
        f"{resumed.stdout[-1500:]}\n{resumed.stderr[-1500:]}"
    assert f"step {newest + 1:>5}/" in resumed.stdout, resumed.stdout[-1500:]
