"""GEMM dispatch: which direction of each operand feeds fprop, dgrad and wgrad.

Every stored direction is ``[rows, contraction]`` (see ``formats/_storage``), so all three
GEMMs of a Linear ``y = x Wᵀ`` are one kind, ``out = A_stored @ B_stored.T`` (``gemm_nt``):

    fprop  y [M, N]  = x.rowwise    [M, K] · W.rowwise    [N, K]ᵀ
    dgrad  dx[M, K]  = dy.rowwise   [M, N] · W.columnwise [K, N]ᵀ
    wgrad  dW[N, K]  = dy.columnwise[N, M] · x.columnwise [K, M]ᵀ

The reference backend computes **any** pair of formats (docs/design.md §4.3): each operand is
dequantized by its block scales into fp32 (exact for E4M3/E2M1 values under E8M0/E4M3
block scales), the product accumulates in fp32, and per-tensor fp32 scales are applied to
the accumulator. Two NVFP4 operands transformed with the same Hadamard matrix are
multiplied in the transformed domain (``T`` is orthogonal, so the product is unchanged);
an operand whose partner is not transformed the same way is transformed back first.
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist import _kernel_registry
from hybrid_dist.warn import warn_once
from hybrid_dist.formats._storage import DirectionStorage
from hybrid_dist.quantized_tensor import QuantizedTensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Per-GEMM precision: output dtype (None = the input's) and FP8 fast accumulation."""

    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False


def _rht_seed(st: DirectionStorage):
    return getattr(st, "rht_seed", None)


def reference_gemm_nt(a: DirectionStorage, b: DirectionStorage, *, out_dtype: torch.dtype) -> torch.Tensor:
    """``A_stored @ B_stored.T`` in fp32 from dequantized block values (see module doc)."""
    shared_rht = _rht_seed(a) is not None and _rht_seed(a) == _rht_seed(b)
    va = a.values(undo_rht=False) if shared_rht else a.values()
    vb = b.values(undo_rht=False) if shared_rht else b.values()
    acc = va @ vb.t()
    for s in (a.tensor_scale(), b.tensor_scale()):
        if s is not None:
            acc = acc * s
    return acc.to(out_dtype)


def gemm_nt(a: DirectionStorage, b: DirectionStorage, *, out_dtype: torch.dtype, config: GemmConfig) -> torch.Tensor:
    """``out [Ra, Rb] = A [Ra, C] · B [Rb, C]ᵀ`` on the best backend for the pair."""
    (ra, ca), (rb, cb) = a.shape2d, b.shape2d
    if ca != cb:
        raise ValueError(f"gemm_nt: contraction dims differ: A is [{ra}, {ca}], B is [{rb}, {cb}]")
    device = a.device
    if device != b.device:
        raise ValueError(f"gemm_nt: operands on different devices: {device} and {b.device}")
    for impl in _kernel_registry.gemm_impls_for(device):
        out = impl(a, b, out_dtype=out_dtype, config=config)
        if out is not NotImplemented:
            return out
    if device.type == "cuda" and not torch.compiler.is_compiling():
        warn_once(f"gemm_nt: no CUDA kernel serves {type(a).__name__} x {type(b).__name__} here; "
                  "using the fp32 reference GEMM (exact, slow)")
    return reference_gemm_nt(a, b, out_dtype=out_dtype)


def operand(t: QuantizedTensor, direction: str, role: str, gemm: str) -> DirectionStorage:
    """``t``'s ``direction`` storage as the ``role`` operand of ``gemm`` (``ValueError`` naming
    them where ``t`` lacks it); an attribute read, so Dynamo traces it."""
    st = t._rowwise if direction == "rowwise" else t._columnwise  # attribute reads: traceable
    if st is None:
        raise ValueError(
            f"{gemm} needs the {direction} direction of {role}, but the QuantizedTensor has "
            f"only {list(t.nbytes_by_direction())}. Quantize it with {direction}=True."
        )
    return st


def fprop(x: QuantizedTensor, w: QuantizedTensor, *, out_dtype, config: GemmConfig) -> torch.Tensor:
    """``y [M, N] = x [M, K] · W [N, K]ᵀ``."""
    return gemm_nt(operand(x, "rowwise", "input", "fprop"), operand(w, "rowwise", "weight", "fprop"),
                   out_dtype=out_dtype, config=config)


def dgrad(dy: QuantizedTensor, w: QuantizedTensor, *, out_dtype, config: GemmConfig) -> torch.Tensor:
    """``dx [M, K] = dy [M, N] · W [N, K]``."""
    return gemm_nt(operand(dy, "rowwise", "grad_output", "dgrad"), operand(w, "columnwise", "weight", "dgrad"),
                   out_dtype=out_dtype, config=config)


def wgrad(dy: QuantizedTensor, x: QuantizedTensor, *, out_dtype, config: GemmConfig) -> torch.Tensor:
    """``dW [N, K] = dyᵀ [N, M] · x [M, K]``."""
    return gemm_nt(operand(dy, "columnwise", "grad_output", "wgrad"), operand(x, "columnwise", "input", "wgrad"),
                   out_dtype=out_dtype, config=config)
