"""A rank that fails with an unexpected error ends the ``torchrun`` job: it prints its
traceback and aborts its process groups (the orderly shutdown would wait on NCCL for
collectives the other ranks never complete), so ``torchrun`` sees it exit and stops the
others. Two ranks, rank 1 failing with a collective in flight while rank 0 waits in
another (``_crash_one_rank.py``): the job exits non-zero within the time limit and names the
error; gloo on CPU, NCCL on 2 GPUs (``gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests_distributed._harness import kill_tree

LIMIT_S = 120


def _job(backend: str) -> tuple[int | None, str]:
    script = os.path.join(os.path.dirname(__file__), "_crash_one_rank.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, backend]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = job.communicate(timeout=LIMIT_S)
        return job.returncode, out
    except subprocess.TimeoutExpired:
        kill_tree(job.pid)
        out, _ = job.communicate()
        return None, out


def _check(backend: str) -> None:
    rc, out = _job(backend)
    assert rc is not None, f"{backend}: the job still ran {LIMIT_S} s after rank 1 failed:\n{out[-3000:]}"
    assert rc != 0, f"{backend}: the job exited 0 after rank 1 failed:\n{out[-3000:]}"
    assert "RuntimeError: injected fault on rank 1" in out, f"{backend}: rank 1's error not shown:\n{out[-3000:]}"


def test_a_failing_rank_ends_the_job_gloo():
    _check("gloo")


@pytest.mark.gpu
def test_a_failing_rank_ends_the_job_nccl():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check("nccl")
