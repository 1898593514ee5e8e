"""Assertion helpers shared by the CPU tests."""

from __future__ import annotations

import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when equal)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    noise = (ref - approx).pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of ``t`` (so NaNs and fp8 compare bitwise)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ba, bb = as_bits(a), as_bits(b)
    if not torch.equal(ba, bb):
        n = int((ba != bb).sum())
        raise AssertionError(f"{what}: {n} of {ba.numel()} elements differ bitwise")


def assert_storage_equal(a, b, what: str = "") -> None:
    """Two direction storages (or both None) are bitwise equal, field by field."""
    assert (a is None) == (b is None), f"{what}: one direction missing"
    if a is None:
        return
    assert type(a) is type(b) and a.transposed == b.transposed, what
    for f in a.TENSOR_FIELDS:
        assert_bitwise_equal(getattr(a, f), getattr(b, f), f"{what}.{f}")


def run_under_triton_interpreter(call: str, *, done: str, timeout: float = 900) -> None:
    """Run ``call`` (e.g. ``"from tests.x import _check; _check()"``) in a subprocess with
    ``TRITON_INTERPRET=1`` (it must be set before any kernel is defined) from the repository
    root; the call prints ``done`` when its checks pass. Skips without Triton. The
    subprocess first installs ``tests._triton_interpreter_compat`` (NumPy >= 2.4 scalars) and
    runs on one thread, as every pytest-xdist worker does (two workers on two cores)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    call = "import tests._triton_interpreter_compat as c; c.install()\n" + call
    res = subprocess.run([sys.executable, "-c", call], cwd=root, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0 and done in res.stdout, res.stdout[-3000:] + res.stderr[-5000:]


def run_check_under_triton_interpreter(module: str, check: str, *, timeout: float = 900) -> None:
    """``run_under_triton_interpreter`` of ``module._check_<check>()``: one subprocess per
    check, so pytest-xdist spreads the checks over the cores, each with its own timeout."""
    run_under_triton_interpreter(f"from {module} import _check_{check} as c\nc()\nprint('{check} passed')",
                                 done=f"{check} passed", timeout=timeout)
