"""``examples/hf_finetune_fsdp2.py``: its tiny default (one process) trains a converted
``LlamaForCausalLM`` under FSDP2 and a run resumed from its DCP checkpoint repeats the
second half's losses bitwise. Skipped without ``transformers``."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e \".[hf]\")")

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_finetune_fsdp2.py")


def example():
    spec = importlib.util.spec_from_file_location("hf_finetune_fsdp2", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_default_trains_and_resumes_bitwise(tmp_path):
    out = example().main(["--steps", "6", "--checkpoint-dir", str(tmp_path / "ckpt")])
    losses = out["losses"]
    assert len(losses) == 6 and out["resumed"] == losses[3:], out
    assert losses[-1] < losses[0] - 0.5, losses
    assert (tmp_path / "ckpt" / ".metadata").exists()
