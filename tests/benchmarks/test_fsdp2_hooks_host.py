"""``benchmarks.fsdp2_hooks_host`` runs on the CPU (fake process group) and attributes host
time to the hooks only for quantized weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_table_has_both_passes_and_hook_time_only_for_quantized_weights():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.fsdp2_hooks_host", "--recipes", "bf16,fp8_current", "--cycles", "3",
         "--repeats", "1", "--layers", "2", "--dim", "128"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in out.splitlines()
            if line.startswith("| bf16") or line.startswith("| fp8_current")}
    assert set(rows) == {(r, p) for r in ("bf16", "fp8_current") for p in ("forward", "backward")}, out
    hooks = {k: float(v.strip("|").split("|")[3]) for k, v in rows.items()}
    assert hooks[("bf16", "forward")] == hooks[("bf16", "backward")] == 0.0, out
    assert hooks[("fp8_current", "forward")] > 0 and hooks[("fp8_current", "backward")] > 0, out
