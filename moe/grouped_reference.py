"""The reference quantized ``GroupedLinear`` on the packed layout: no host-side shapes.

Legend: T tokens sorted by expert, E experts, K in, N out, C the packed capacity and
``poff``, ``dest``, ``row_expert`` the packed index space of ``device_split``.

Bitwise the per-expert loop (``grouped_linear``'s reference formulas: ``gemm_nt`` of
each expert's padded slice), computed from buffers whose shapes depend only on T, E and
the padding multiple:

    x, dy          split_quantize_packed (per-expert scales on the device; NVFP4
                   stochastic rounding drawn per expert, ``per_expert_draws``)
    fprop  y  [T, N] = (x.row [C, K]  · W_e.row [N, K]ᵀ per segment) · s_x · s_w  → rows dest
    dgrad  dx [T, K] = (dy.row [C, N] · W_e.col [K, N]ᵀ per segment) · s_dy · s_w → rows dest
    wgrad  dW [E, N, K] = (dy.col [N, C] · x.col [K, C]ᵀ per segment) · s_dy · s_x

Operands are the storages' fp32 ``values()`` (elementwise block dequantization, the same
numbers per element as each expert's own storage; NVFP4 Hadamard domains handled as
``gemm.reference_gemm_nt`` does); the per-segment fp32 products are the opaque ops of
``_segment_ops`` (the same matmul shapes as the loop); the per-tensor scales ``s`` (per
expert: FP8 ``scale_inv``, NVFP4 ``global_scale``) multiply the accumulator rows in the
reference's order. Nothing here reads a tensor's value on the host outside those ops,
so ``torch.compile`` traces a layer with no graph break and no shape that depends on the
routing. It serves CPU calls without expert-parallel operands (``fits``); CUDA calls keep
their kernels (``grouped_quantized``) or the per-expert loop.
"""

from __future__ import annotations

import torch

from hybrid_dist import saved_storages
from hybrid_dist.inspection import active_stats
from hybrid_dist.moe import device_split
from hybrid_dist.moe._segment_ops import segment_mm_rows, segment_mm_tokens
from hybrid_dist.moe.exchange_io import carries_operands, hand_off_input_grad, input_grad_sender
from hybrid_dist.moe.grouped_operands import expert_weight_storages, row_scales, token_operand
from hybrid_dist.quantized_tensor import QuantizedTensor

__all__ = ["fits", "grouped_linear"]


def fits(plan, x: torch.Tensor, io) -> bool:
    """True when this path computes the call: CPU, no exchanged operands in ``io``, and
    token quantizers ``split_quantize_packed`` serves."""
    return (not carries_operands(io) and x.device.type == "cpu"
            and all(device_split.unsupported_reason(q) is None for q in (plan.input, plan.grad_output)))


def _split(t, tokens_per_expert, q, states, multiple, *, rowwise: bool, columnwise: bool):
    """``(PackedSplit, rowwise storage or None, columnwise storage or None)`` of ``t [T, *]``."""
    ps = device_split.split_quantize_packed(t, tokens_per_expert, q, rowwise=rowwise, columnwise=columnwise,
                                            states=states, multiple=multiple, per_expert_draws=True)
    row = token_operand(q.direction_quantizer("rowwise"), ps.rowwise, "rowwise").storage if rowwise else None
    col = token_operand(q.direction_quantizer("columnwise"), ps.columnwise, "columnwise").storage \
        if columnwise else None
    return ps, row, col


def _values(a, b):
    """fp32 values of a pair as ``reference_gemm_nt`` multiplies them (shared Hadamard domain kept)."""
    seed_a, seed_b = getattr(a, "rht_seed", None), getattr(b, "rht_seed", None)
    undo = not (seed_a is not None and seed_a == seed_b)
    return a.values(undo_rht=undo), b.values(undo_rht=undo)


def _expert_scales(storages) -> torch.Tensor | None:
    scales = [st.tensor_scale() for st in storages]
    return None if scales[0] is None else torch.stack([s.reshape(()) for s in scales])


def _rows_gemm(a, b_list, ps, out_dtype) -> torch.Tensor:
    """``out [T, R]``: packed token storage ``a [C, Kc]`` times expert storages ``b_e [R, Kc]``."""
    va, _ = _values(a, b_list[0])
    vb = torch.stack([_values(a, b)[1] for b in b_list])
    acc = segment_mm_rows(va, vb, ps.padded_offsets)
    for s in (a.tensor_scale(), _expert_scales(b_list)):
        if s is not None:
            acc = acc * row_scales(s, ps.row_expert)[:, None]
    return acc.to(out_dtype).index_select(0, ps.dest)


def _tokens_gemm(a, b, ps, out_dtype) -> torch.Tensor:
    """``dW [E, Ra, Rb]``: packed token storages ``a [Ra, C]``, ``b [Rb, C]``, per segment."""
    va, vb = _values(a, b)
    acc = segment_mm_tokens(va, vb, ps.padded_offsets)
    for s in (a.tensor_scale(), b.tensor_scale()):
        if s is not None:
            acc = acc * s.float()[:, None, None]
    return acc.to(out_dtype)


class _PackedReferenceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, plan, io):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.dx_sender = input_grad_sender(io)
        ps, x_row, x_col = _split(x, tokens_per_expert, plan.input, plan.states["input"], plan.multiple,
                                  rowwise=True, columnwise=need_wgrad)
        w_rows, w_cols = expert_weight_storages(weight, plan, need_dgrad=need_dgrad)
        ctx.stats = stats = active_stats(plan)  # None unless a logging step captures (no op when off)
        if stats is not None:
            e = len(w_rows)
            stats.record_experts("input", x, [x_row], [x_col] if need_wgrad else None, num_experts=e,
                                 offsets=ps.offsets, poff=ps.padded_offsets)
            # a quantized weight's columnwise bytes are valid in backward (FSDP2 refills them then)
            ctx.w_col_stats = isinstance(weight, QuantizedTensor) and need_dgrad
            stats.record_experts("weight", weight, w_rows, w_cols if need_dgrad and not ctx.w_col_stats else None,
                                 num_experts=e)
        # fprop: y [T, N] = x_e [p_e, K] · W_e [N, K]ᵀ per segment, rows dest
        y = _rows_gemm(x_row, w_rows, ps, plan.recipe.fprop.out_dtype or x.dtype)
        saved_storages.pack(ctx, x_col, *(w_cols if need_dgrad else [None] * len(w_cols)))
        ctx.plan, ctx.x_dtype, ctx.w_dtype = plan, x.dtype, weight.dtype
        ctx.tokens_per_expert = tokens_per_expert  # device [E]; the layout is rebuilt from it
        return y

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        saved = saved_storages.unpack(ctx)
        x_col, w_cols = saved[0], saved[1:]
        plan.advance("grad_output")
        ps, dy_row, dy_col = _split(dy.contiguous(), ctx.tokens_per_expert, plan.grad_output,
                                    plan.states["grad_output"], plan.multiple, rowwise=need_dgrad,
                                    columnwise=need_wgrad)
        if ctx.stats is not None:
            ctx.stats.record_experts("grad_output", dy, [dy_row] if need_dgrad else None,
                                     [dy_col] if need_wgrad else None, num_experts=len(w_cols),
                                     offsets=ps.offsets, poff=ps.padded_offsets)
            if ctx.w_col_stats:
                ctx.stats.record_experts("weight", None, None, w_cols, num_experts=len(w_cols))
        dx = dw = None
        if need_dgrad:
            # dgrad: dx [T, K] = dy_e [p_e, N] · W_e [N, K] per segment (W_e columnwise stored [K, N])
            dx = _rows_gemm(dy_row, w_cols, ps, plan.recipe.dgrad.out_dtype or ctx.x_dtype)
            dx = hand_off_input_grad(ctx.dx_sender, dx)  # its exchange runs during the wgrad
        if need_wgrad:
            # wgrad: dW_e [N, K] = dy_eᵀ [N, p_e] · x_e [p_e, K] (segments along the packed tokens)
            dw = _tokens_gemm(dy_col, x_col, ps, plan.recipe.wgrad.out_dtype or ctx.w_dtype)
        return dx, dw, None, None, None


def grouped_linear(x, weight, tokens_per_expert, plan, io=None) -> torch.Tensor:
    """``y [T, N]`` of ``GroupedLinear`` (module doc); ``plan`` a ``GroupedPlan`` whose
    input and weight states this step has advanced; ``io`` an ``ExchangeIO`` without
    operands (its early sender takes dx, ``hand_off_input_grad``) or None."""
    return _PackedReferenceFn.apply(x, weight, tokens_per_expert, plan, io)
