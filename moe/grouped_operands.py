"""Operands of the sync-free quantized grouped GEMMs (``grouped_quantized``).

Legend: E experts, C the packed capacity (``PackedSplit.capacity``), K in, N out.

Token side (x, dy): the packed fields of ``split_quantize_packed`` wrapped as ONE storage
over the whole padded buffer — rowwise stored ``[C, K]``, columnwise stored ``[K, C]`` —
plus the per-expert per-tensor scale ``[E]`` (FP8 ``scale_inv``, NVFP4 ``global_scale``;
None for block-only formats) kept beside it (``TokenOperand``).

Weight side: the E experts' storages (rowwise stored ``[N, K]``, columnwise ``[K, N]``)
stacked along stored rows into one storage ``[E·R, C]`` (per-tensor fields stacked to
``[E]``): ``WeightOperand``. High-precision weights are quantized expert by expert with
their own states (a loop over the host int E: no device-to-host sync); a quantized
``[E, N, K]`` weight (``quantized_model_init``) is narrowed per expert (one shared scale).

FP8 weights in bf16 on CUDA skip the loop: one amax and one cast-transpose launch over
``[E, N, K]`` (delayed scaling: one launch, eager only) write the stacked storages directly
(``batched_fp8_weights``; bitwise the loop, each expert its own amax and scale).

``bf16_values``: stored ``[R, C]`` as bf16 with block scales applied and the per-tensor
scale NOT applied. Exact for FP8 (any dtype), MXFP8 (E4M3 × 2^k) and NVFP4 (E2M1 × E4M3);
FP8 blocks (fp32 block scales) round once to bf16. NVFP4 stays in its Hadamard domain.
``fold``: multiply per-expert scales in fp32 into one operand, then cast to bf16 (one
rounding per element; the other operand stays exact).
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist import gemm
from hybrid_dist.formats import DirectionStorage
from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.float8_block import Float8BlockQuantizer, Float8BlockStorage
from hybrid_dist.formats.identity import IdentityQuantizer, IdentityStorage
from hybrid_dist.formats.mxfp8 import MXFP8Quantizer, MXFP8Storage
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer, NVFP4Storage
from hybrid_dist.kernels import TRITON_INSTALLED
from hybrid_dist.library_op import library_op
from hybrid_dist.quantized_tensor import QuantizedTensor

__all__ = ["TokenOperand", "WeightOperand", "batched_fp8_weights", "bf16_values", "expert_weight_storages",
           "fold_experts", "fold_columns", "fold_rows", "fold_source", "token_operand", "stack_experts", "row_scales",
           "stack_dim0_segments", "unstack_experts"]

BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenOperand:
    """One direction of a packed token tensor: ``storage`` stored ``[C, K]`` (rowwise) or
    ``[K, C]`` (columnwise); ``scale`` fp32 ``[E]`` or None."""

    storage: DirectionStorage
    scale: torch.Tensor | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightOperand:
    """E experts' storages stacked: stored ``[E·R, C]``; ``scale`` fp32 ``[E]`` or None."""

    storage: DirectionStorage
    scale: torch.Tensor | None
    num_experts: int


def token_operand(dq, fields: dict[str, torch.Tensor], direction: str) -> TokenOperand:
    """Wrap ``split_quantize_packed`` fields of one direction (quantizer ``dq``) as a storage."""
    t = direction == "columnwise"
    if isinstance(dq, Float8Quantizer):
        st = Float8Storage(data=fields["data"], scale_inv=fields["scale_inv"], transposed=t)
        return TokenOperand(storage=st, scale=fields["scale_inv"])
    if isinstance(dq, NVFP4Quantizer):
        st = NVFP4Storage(data=fields["data"], block_scale=fields["block_scale"], global_scale=fields["global_scale"],
                          block_rows=dq.block_rows, rht_seed=dq.rht_seed if (t and dq.rht) else None, transposed=t)
        return TokenOperand(storage=st, scale=fields["global_scale"])
    if isinstance(dq, MXFP8Quantizer):
        return TokenOperand(storage=MXFP8Storage(data=fields["data"], scale=fields["scale"], transposed=t), scale=None)
    if isinstance(dq, Float8BlockQuantizer):
        st = Float8BlockStorage(data=fields["data"], scale_inv=fields["scale_inv"], block_rows=dq.block_rows,
                                transposed=t)
        return TokenOperand(storage=st, scale=None)
    if isinstance(dq, IdentityQuantizer):
        return TokenOperand(storage=IdentityStorage(data=fields["data"], transposed=t), scale=None)
    raise NotImplementedError(f"no grouped token operand for {type(dq).__name__}")


def stack_experts(storages: list[DirectionStorage]) -> WeightOperand:
    """Stack per-expert storages (same class and metadata) along stored rows."""
    first = storages[0]
    out = {}
    for f in first.TENSOR_FIELDS:
        ts = [getattr(st, f) for st in storages]
        ax = first.field_axes()[f].get("R")
        out[f] = torch.stack([t.reshape(()) for t in ts]) if ax is None else torch.cat(ts, dim=ax[0])
    st = first.with_tensors(out)
    return WeightOperand(storage=st, scale=st.tensor_scale(), num_experts=len(storages))


@library_op("hybrid_dist::stack_segments")
def _stack_segments_op(after: torch.Tensor, t: torch.Tensor, cut_dim: int, segments: int,
                       cat_dim: int) -> torch.Tensor:
    """``t`` cut into ``segments`` equal parts along ``cut_dim`` and concatenated along
    ``cat_dim``. ``after`` is not read: it orders the copy after ``after`` is computed."""
    return torch.cat(t.chunk(segments, cut_dim), dim=cat_dim)


@_stack_segments_op.register_fake
def _(after, t, cut_dim, segments, cat_dim):
    shape = list(t.shape)
    shape[cut_dim] //= segments
    shape[cat_dim] *= segments
    return t.new_empty(shape)


def stack_dim0_segments(st: DirectionStorage, num_experts: int, after: torch.Tensor) -> WeightOperand:
    """``stack_experts`` of ``st``'s ``num_experts`` equal logical dim-0 segments (a
    quantized ``[E·N, K]`` weight's per-expert storages), bitwise, each field copied by one
    opaque operator that takes ``after`` (a tensor of the backward pass): a compiled
    graph's partitioner would otherwise compute the copy in forward, as it may for any
    value of forward inputs alone, where under FSDP2 the columnwise buffers are not yet
    refilled (``grouped_quantized._weights``)."""
    key, axes = ("C" if st.transposed else "R"), st.field_axes()  # the logical dim 0 of the stored layout
    out = {}
    for f, t in st.tensors().items():
        ax = axes[f]
        if key in ax:
            out[f] = _stack_segments_op(after, t, ax[key][0], num_experts, ax["R"][0])
        else:  # per-tensor: one value per expert
            out[f] = torch.stack([t.reshape(())] * num_experts)
    stacked = st.with_tensors(out)
    return WeightOperand(storage=stacked, scale=stacked.tensor_scale(), num_experts=num_experts)


def unstack_experts(op: WeightOperand) -> list[DirectionStorage]:
    """The E per-expert storages of a stacked operand (``stack_experts``'s inverse): views
    of the stacked fields, per-tensor fields taken at each expert."""
    st, e = op.storage, op.num_experts
    parts: dict[str, list[torch.Tensor]] = {}
    for f, t in st.tensors().items():
        ax = st.field_axes()[f].get("R")
        parts[f] = list(t.reshape(-1)) if ax is None else list(t.chunk(e, dim=ax[0]))
    return [st.with_tensors({f: ts[i] for f, ts in parts.items()}) for i in range(e)]


def expert_weight_storages(weight, plan, *, need_dgrad: bool):
    """Per-expert lists (rowwise stored [N, K], columnwise [K, N] or None) of ``weight [E, N, K]``
    (``grouped_linear`` note: expert weights); ``plan`` a ``GroupedPlan``."""
    e, n, _ = weight.shape
    if isinstance(weight, QuantizedTensor):
        row = gemm.operand(weight, "rowwise", "weight", "fprop")
        col = gemm.operand(weight, "columnwise", "weight", "dgrad") if need_dgrad else None
        rows = [row.narrow_dim0(i * n, n) for i in range(e)]
        cols = [col.narrow_dim0(i * n, n) if need_dgrad else None for i in range(e)]
        return rows, cols
    rows, cols = [], []
    for i in range(e):
        r, c = plan.weight.quantize_storages(weight[i], rowwise=True, columnwise=need_dgrad,
                                             state=plan.states["weight"][i])
        rows.append(r)
        cols.append(c)
    return rows, cols


def _batched_fp8_quantizer(weight, q) -> Float8Quantizer | None:
    """The ``Float8Quantizer`` making both directions of ``weight`` when the batched kernel
    serves it (bf16 on CUDA, unit stride along K, Triton; delayed scaling eagerly, current
    scaling also compiled), else None."""
    if isinstance(weight, QuantizedTensor) or not weight.is_cuda or weight.dtype != torch.bfloat16:
        return None
    if weight.stride(-1) != 1 or not TRITON_INSTALLED:
        return None
    rq, cq = q.direction_quantizer("rowwise"), q.direction_quantizer("columnwise")
    if not (isinstance(rq, Float8Quantizer) and rq == cq):
        return None
    if rq.scaling == "delayed" and torch.compiler.is_compiling():
        return None
    return rq


def batched_fp8_weights(weight, plan, *, need_dgrad: bool) -> tuple[WeightOperand, WeightOperand | None] | None:
    """Stacked rowwise / columnwise operands of ``weight [E, N, K]`` from the batched FP8
    kernel (module doc), or None when it does not apply (``expert_weight_storages``)."""
    q = _batched_fp8_quantizer(weight, plan.weight)
    if q is None:
        return None
    from hybrid_dist.kernels.fp8.tensor import quantize_fp8_batched  # Triton: CUDA installs only

    e, n, k = weight.shape
    states = plan.states["weight"] if q.scaling == "delayed" else None
    row, col, scale_inv = quantize_fp8_batched(q, weight.detach(), columnwise=need_dgrad, states=states)
    rows = WeightOperand(storage=Float8Storage(data=row.view(e * n, k), scale_inv=scale_inv, transposed=False),
                         scale=scale_inv, num_experts=e)
    if not need_dgrad:
        return rows, None
    cols = WeightOperand(storage=Float8Storage(data=col.view(e * k, n), scale_inv=scale_inv, transposed=True),
                         scale=scale_inv, num_experts=e)
    return rows, cols


def bf16_values(st: DirectionStorage) -> torch.Tensor:
    """bf16 stored ``[R, C]``, block scales applied, per-tensor scale not (module doc): on
    CUDA the dequantize kernels of the GEMM backend, else torch ops."""
    if st.device.type == "cuda":
        from hybrid_dist.kernels.gemm import bf16_operand  # Triton: CUDA installs only

        v = bf16_operand(st)
        if v is not None:
            return v
    if isinstance(st, (Float8Storage, IdentityStorage)):
        return st.data.to(BF16)
    if isinstance(st, (MXFP8Storage, NVFP4Storage, Float8BlockStorage)):
        return st.values(undo_rht=False).to(BF16)
    raise NotImplementedError(f"no bf16 values for {type(st).__name__}")


def fold_source(st: DirectionStorage) -> torch.Tensor:
    """What ``fold_*`` multiplies: FP8 codes as stored (cast once, in fp32, with the
    scale), else ``bf16_values``."""
    return st.data if isinstance(st, Float8Storage) else bf16_values(st)


def _combine(*scales: torch.Tensor | None) -> torch.Tensor | None:
    out = None
    for s in scales:
        if s is not None:
            out = s.float() if out is None else out * s.float()
    return out


def _times(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 of the fp32 product ``v · scale`` (broadcast): one rounding. FP8 codes are
    widened first (few elementwise kernels take FP8); bf16 promotes in the multiply."""
    return ((v.float() if v.element_size() == 1 else v) * scale).to(BF16)


def fold_experts(v: torch.Tensor, num_experts: int, *scales: torch.Tensor | None) -> torch.Tensor:
    """``v [E·R, C]`` (any float dtype) → bf16 ``[E, R, C]`` times ``Π scales[e]`` (fp32)."""
    v = v.reshape(num_experts, -1, v.shape[-1])
    s = _combine(*scales)
    return v.to(BF16) if s is None else _times(v, s[:, None, None])


def row_scales(scale: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """fp32 ``[C]``: ``scale[e]`` of each packed row's expert (1 past the last expert)."""
    return torch.cat([scale.float(), scale.new_ones(1, dtype=torch.float32)])[row_expert]


def _line_folded(st: DirectionStorage, row_expert, scales, axis: int) -> torch.Tensor:
    """``st`` stored ``[R, C]`` in bf16 times ``Π scales[expert]`` of each row (``axis=0``)
    or column (``axis=1``), the packed token axis: in the dequantize kernel's one pass on
    CUDA (MXFP8, NVFP4), else ``fold_source`` then one fp32 multiply and cast (bitwise
    alike: the kernel's values are the exact ``bf16_values``)."""
    s = _combine(*scales)
    if s is None:
        return fold_source(st).to(BF16)
    line = row_scales(s, row_expert)
    if st.device.type == "cuda" and isinstance(st, (MXFP8Storage, NVFP4Storage)):
        from hybrid_dist.kernels.gemm import bf16_operand  # Triton: CUDA installs only

        return bf16_operand(st, **{"row_scale" if axis == 0 else "col_scale": line})
    return _times(fold_source(st), line[:, None] if axis == 0 else line[None, :])


def fold_rows(st: DirectionStorage, row_expert: torch.Tensor, *scales: torch.Tensor | None) -> torch.Tensor:
    """Packed tokens stored ``[C, R]`` (C = packed token axis) → bf16 times
    ``Π scales[expert of row]``."""
    return _line_folded(st, row_expert, scales, axis=0)


def fold_columns(st: DirectionStorage, row_expert: torch.Tensor, *scales: torch.Tensor | None) -> torch.Tensor:
    """Packed tokens stored ``[R, C]`` (C = packed token axis) → bf16 times
    ``Π scales[expert of column]``."""
    return _line_folded(st, row_expert, scales, axis=1)
