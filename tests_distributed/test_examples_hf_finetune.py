"""``examples/hf_finetune_fsdp2.py`` on 2 gloo ranks (as under ``torchrun --nproc-per-node 2``):
each rank trains its own batches, and the run resumed from the DCP checkpoint repeats the
second half's losses bitwise on every rank. Skipped without ``transformers``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e \".[hf]\")")

from tests.examples.test_hf_finetune_fsdp2 import example  # noqa: E402
from tests_distributed._harness import run_ranks  # noqa: E402


def fine_tune(rank, world, folder):
    return example().main(["--steps", "4", "--checkpoint-dir", folder])


def test_two_ranks_train_and_resume_bitwise(tmp_path):
    results = run_ranks(fine_tune, 2, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        assert out["resumed"] == out["losses"][2:], f"rank {rank}: {out}"
        assert out["losses"][-1] < out["losses"][0], f"rank {rank}: {out['losses']}"
    assert results[0]["losses"] != results[1]["losses"]  # each rank's own batches
