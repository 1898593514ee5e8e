"""``python -m hybrid_dist.launch.train``: bad flags, a layout that does not fit the world
size and a shape that does not fit a recipe's blocks give one line on stderr (naming the
module) and exit code 2 before the model is built; without ``torchrun`` the job runs as
one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybrid_dist.launch.train import main


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--recipe", "nope"], "--recipe 'nope' is unknown"),
    (["--preset", "huge"], "--preset 'huge' is unknown"),
    (["--save-every", "2"], "--save-every needs --checkpoint-dir"),
    (["--gc-every", "-1"], "--gc-every must be >= 0 (0 = Python's automatic collector), got -1"),
    (["--fsdp-unit", "-1"], "--fsdp-unit must be >= 0 (0 = by block size), got -1"),
    (["--fsdp-prefetch", "-1"], "--fsdp-prefetch must be >= 0 (0 = FSDP2's implicit prefetch), got -1"),
    (["--reshard-after-forward", "sometimes"],
     "--reshard-after-forward must be one of default, always, never, got 'sometimes'"),
    (["--sequence-parallel"], "--sequence-parallel splits the sequence over the TP ranks: it needs --tp 2"),
    (["--sequence-parallel", "--tp", "2", "--moe-experts", "4"], "run MoE models without --sequence-parallel"),
    (["--sequence-parallel", "--tp", "2", "--seq-len", "63"], "--seq-len 63 must be a multiple of --tp 2"),
])
def test_bad_flag_is_one_line_and_exit_2(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid_dist.launch.train: error: ") and says in err[0], err


@pytest.mark.parametrize("argv, says", [
    (["--fsdp", "3"], "hsdp*fsdp*tp = 1*3*1 = 3, but the world size is 1; the degrees must multiply"),
    (["--recipe", "nvfp4", "--batch-size", "1", "--seq-len", "8"],
     "attention.wq input has local shape [8, 256] (tp=1, tokens per rank=8), which recipe 'nvfp4' cannot "
     "quantize columnwise"),
])
def test_bad_layout_or_block_is_one_line_before_the_model_is_built(capsys, monkeypatch, argv, says):
    """Checks that need the world size (the mesh) or the recipe's blocks: one line naming
    the flag or the module, exit 2, and no model built."""
    from hybrid_dist.launch import loop

    built = []

    def transformer(*args, **kwargs):
        built.append(1)
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "Transformer", transformer)
    assert main(["--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid_dist.launch.train: error: ") and says in err[0], err
    assert not built


def test_runs_as_one_process_without_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "hybrid_dist.launch.train", "--preset", "tiny", "--steps", "2",
                          "--recipe", "fp8_current"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "summary: 2 steps" in out.stdout, out.stdout[-2000:]
