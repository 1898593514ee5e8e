"""Diagnostic recipes for convergence studies (``--recipe benchmarks.diag_recipes:NAME``).

Each changes one thing against ``fp8_current`` so a loss gap can be pinned on it:

| recipe                  | fprop x | fprop W | dgrad / wgrad          | fast accum (fprop) |
| fp8_current_slow_accum  | E4M3    | E4M3    | E5M2 dy, E4M3 W/x      | no                 |
| fp8_input_only          | E4M3    | bf16    | bf16                   | —                  |
| fp8_weight_only         | bf16    | E4M3    | bf16                   | —                  |
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from hybrid_dist.gemm import GemmConfig

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _table(input, weight, grad_output):
    table = {"input": input, "weight": weight, "grad_output": grad_output}
    return lambda role: table[role.tensor_type]


def fp8_current_slow_accum() -> hd.Recipe:
    f, g = hd.Float8Quantizer(dtype=E4M3), hd.Float8Quantizer(dtype=E5M2)
    return hd.CustomRecipe(_table(f, f, g), name="fp8_current_slow_accum", fprop=GemmConfig(use_fast_accum=False))


def _fwd_only(fp8_role: str, name: str) -> hd.Recipe:
    i = hd.IdentityQuantizer()
    h = hd.HybridQuantizer(rowwise=hd.Float8Quantizer(dtype=E4M3), columnwise=i)
    return hd.CustomRecipe(_table(h if fp8_role == "input" else i, h if fp8_role == "weight" else i, i), name=name)


def fp8_input_only() -> hd.Recipe:
    return _fwd_only("input", "fp8_input_only")


def fp8_weight_only() -> hd.Recipe:
    return _fwd_only("weight", "fp8_weight_only")
