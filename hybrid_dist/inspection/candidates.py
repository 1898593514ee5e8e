"""Format labels and the candidate formats measured beside the ones a recipe uses.

At a logging step each high-precision GEMM operand is also quantized, in each direction,
with every candidate (``CANDIDATES``), so that statistics say how the tensor would fare in
MXFP8 or NVFP4 whatever the run used. The candidates are deterministic (no stochastic
rounding: its noise would make two measurements differ) and are exactly the quantizers the
advisor writes into a recipe.
"""

from __future__ import annotations

import torch

from hybrid_dist.formats import (
    Float8BlockQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)

# (tensor_type, direction) -> the GEMM that direction feeds (docs/design.md §1)
GEMM_OF = {("input", "rowwise"): "fprop", ("input", "columnwise"): "wgrad",
           ("weight", "rowwise"): "fprop", ("weight", "columnwise"): "dgrad",
           ("grad_output", "rowwise"): "dgrad", ("grad_output", "columnwise"): "wgrad"}

# candidate name -> tensor_type -> quantizer (its rowwise and columnwise directions are measured)
CANDIDATES: dict[str, dict[str, Quantizer]] = {
    "mxfp8": {t: MXFP8Quantizer() for t in ("input", "weight", "grad_output")},
    "nvfp4": {"input": NVFP4Quantizer(rht=True), "weight": NVFP4Quantizer(),
              "grad_output": NVFP4Quantizer(rht=True)},
}


def format_label(q: Quantizer, direction: str) -> str:
    """A short name of the format ``q`` uses for ``direction``: ``fp8_e4m3``,
    ``fp8_e5m2_delayed``, ``fp8_block_1x128``, ``mxfp8``, ``nvfp4``, ``nvfp4_rht_sr``,
    ``nvfp4_2d``, ``high_precision``."""
    q = q.direction_quantizer(direction)
    if isinstance(q, Float8Quantizer):
        name = "fp8_e4m3" if q.dtype == torch.float8_e4m3fn else "fp8_e5m2"
        return name + ("_delayed" if q.scaling == "delayed" else "")
    if isinstance(q, Float8BlockQuantizer):
        return f"fp8_block_{q.block}"
    if isinstance(q, MXFP8Quantizer):
        return "mxfp8" if q.dtype == torch.float8_e4m3fn else "mxfp8_e5m2"
    if isinstance(q, NVFP4Quantizer):
        rht = q.rht and direction == "columnwise"
        return "nvfp4" + ("_2d" if q.block_2d else "") + ("_rht" if rht else "") + \
            ("_sr" if q.stochastic_rounding else "")
    if isinstance(q, IdentityQuantizer):
        return "high_precision"
    return type(q).__name__


def fits(q: Quantizer, m: int, k: int, direction: str) -> bool:
    """Whether ``[m, k]`` fits ``q``'s blocks in ``direction`` (a static shape check)."""
    bm, bk = q.direction_quantizer(direction).block_shape(direction)
    return m % bm == 0 and k % bk == 0
