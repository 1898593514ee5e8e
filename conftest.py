"""Shared pytest setup for tests/ and tests_distributed/: the ``gpu`` marker skips without CUDA."""

import pytest
import torch


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
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
