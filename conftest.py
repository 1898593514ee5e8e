"""Shared pytest setup for tests/ and tests_distributed/: the ``gpu`` marker skips without CUDA."""

import os

# Inductor compiles in this process, not in a pool of compile workers: a gloo rank's pool
# (spawned under a pytest-xdist worker) once left both ranks waiting on a C++ compile
# future forever; on the 2-core CI machine the pool saves nothing.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # Under pytest-xdist each worker gets one intra-op thread: 2 workers on 2 cores would
    # otherwise oversubscribe the CPU and slow every test down.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        torch.set_num_threads(1)
        # Spread single-GPU tests over the host's GPUs: worker gwN uses GPU N mod count
        # (multi-GPU tests start their own processes and pick their devices themselves).
        if torch.cuda.is_available() and worker.startswith("gw"):
            torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())
