"""Sync-free quantized ``GroupedLinear`` on CUDA: packed split-quantize + grouped GEMMs.

Legend: T tokens sorted by expert, E experts, K in, N out, C the packed capacity
(``device_split``: every expert's segment padded to ``b = lcm(token_multiple, 16)`` rows,
zeros in the padding), ``offs [E]`` int32 = cumulative padded counts (device), ``dest [T]``
each token's packed row, ``row_expert [C]`` each packed row's expert.

    fprop  y_pad  [C, N]    = x.row [C, K]   · W_e.row [N, K]ᵀ   per group   y  = y_pad[dest]
    dgrad  dx_pad [C, K]    = dy.row [C, N]  · W_e.col [K, N]ᵀ   per group   dx = dx_pad[dest]
    (the Triton kernels write y / dx in token order directly: no padded buffer, no gather)
    wgrad  dW     [E, N, K] = dy.col [N, C]  · x.col [K, C]ᵀ     groups along C

Each GEMM picks, from its operand pair:

* both per-tensor FP8 E4M3: ``torch._scaled_grouped_mm`` (CUTLASS, Hopper) with the
  per-expert ``scale_inv`` expanded on the device to fp32 row/column vectors: fprop/dgrad
  2d × 3d (``scale_a [C]``, ``scale_b [E, N]``, mat_b column-major), wgrad 2d × 2d
  (``scale_a [E·N]``, ``scale_b [E·K]``, mat_b column-major; group offsets along C are
  multiples of 16, which FP8 needs).
* both per-tensor FP8 with an E5M2 operand (the gradients of ``fp8_current`` /
  ``fp8_delayed``: dgrad E5M2 × E4M3, wgrad E5M2 × E4M3) on CUDA: the Triton grouped
  kernels of ``kernels/fp8/grouped_gemm`` (mixed-dtype FP8 wgmma, fp32 accumulation, the two
  per-expert ``scale_inv`` multiplied on the accumulator, bf16 out; empty wgrad groups
  written as zeros; a compiled graph calls them as operators). On CPU the pair takes the
  bf16 path below.
* anything else (MXFP8, NVFP4 1D/2D, FP8 blocks, identity, mixed pairs):
  both operands to bf16 (``grouped_operands.bf16_values``: block scales applied, exact but
  for FP8 blocks), the two per-expert per-tensor scales folded in fp32 into ONE operand
  before its bf16 cast (fprop and dgrad: the token rows, each by its expert's scales, so
  that an expert's output does not depend on how many rows the others hold; wgrad: the
  token operand with fewer feature rows, a choice fixed by the layer's shape), then
  ``torch._grouped_mm`` (fp32 accumulation, bf16 out). NVFP4 operands that share a
  Hadamard seed multiply in the transformed domain (wgrad of the NVFP4 recipes).

Nothing here reads a device value on the host; forward + backward make no device-to-host
sync except an eager NVFP4 split's one read of its offsets (``device_split``). Empty
experts: their wgrad block is set to zero on the device (the kernel need not write a group
with no tokens). CPU: the same code with a loop over groups in place of the
two torch kernels (``_emulated``), which also runs each call's arguments through the
kernels' meta checks (shapes, strides, dtypes) — what the CPU tests use.
"""

from __future__ import annotations

import math
import os

import torch

from hybrid_dist import gemm, saved_storages
from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.identity import IdentityQuantizer
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer
from hybrid_dist.inspection import active_stats
from hybrid_dist.kernels import TRITON_INSTALLED
from hybrid_dist.moe import _wire, device_split
from hybrid_dist.moe.exchange_io import hand_off_input_grad, input_grad_sender
from hybrid_dist.moe.grouped_operands import (
    BF16, TokenOperand, WeightOperand, batched_fp8_weights, bf16_values, expert_weight_storages, fold_columns,
    fold_experts, fold_rows, row_scales, stack_dim0_segments, stack_experts, token_operand,
    unstack_experts,
)
from hybrid_dist.quantized_tensor import QuantizedTensor

__all__ = ["exchange_packable", "fits", "unsupported_reason", "grouped_linear", "packed_multiple"]

E4M3 = torch.float8_e4m3fn
FP8_GROUP_ALIGN = 16  # token offsets along a contraction dim: multiples of 16 for FP8


def packed_multiple(plan) -> int:
    """Padding multiple of the packed layout: the plan's block multiple and 16."""
    return math.lcm(plan.multiple, FP8_GROUP_ALIGN)


# --- kernels: CUDA, or an emulation on CPU ----------------------------------------------
def _meta_check(op, *args, **kwargs) -> None:
    """Run ``op``'s meta registration on meta copies (same shapes/strides): raises where the
    CUDA kernel's argument checks would."""
    def meta(t):
        return t.to("meta") if isinstance(t, torch.Tensor) else t
    op(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})


def _emulated(a, b, offs, scale_a=None, scale_b=None) -> torch.Tensor:
    """Loop over groups (host reads ``offs``: CPU only): fp32 products of the (scaled)
    operands, one bf16 rounding; rows/columns past ``offs[-1]`` stay zero."""
    ends = [int(v) for v in offs.tolist()]
    starts = [0] + ends[:-1]
    af, bf = a.float(), b.float()
    if b.dim() == 3:  # 2d x 3d: groups of rows of a
        out = a.new_zeros(a.shape[0], b.shape[-1], dtype=torch.float32)
        for g, (s, e) in enumerate(zip(starts, ends)):
            ag, bg = af[s:e], bf[g]
            if scale_a is not None:
                ag, bg = ag * scale_a[s:e, None], bg * scale_b[g][None, :]
            out[s:e] = ag @ bg
        return out.to(BF16)
    n_a, n_b = a.shape[0], b.shape[1]  # 2d x 2d: groups along the contraction dim
    out = a.new_zeros(len(ends), n_a, n_b, dtype=torch.float32)
    for g, (s, e) in enumerate(zip(starts, ends)):
        ag, bg = af[:, s:e], bf[s:e]
        if scale_a is not None:
            ag, bg = ag * scale_a[g * n_a:(g + 1) * n_a, None], bg * scale_b[g * n_b:(g + 1) * n_b][None, :]
        out[g] = ag @ bg
    return out.to(BF16)


def _grouped_mm(a, b, offs) -> torch.Tensor:
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    _meta_check(torch._grouped_mm, a, b, offs=offs)
    return _emulated(a, b, offs)


def _scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum: bool) -> torch.Tensor:
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=BF16, use_fast_accum=fast_accum)
    _meta_check(torch._scaled_grouped_mm, a, b, scale_a, scale_b, offs=offs, out_dtype=BF16)
    return _emulated(a, b, offs, scale_a, scale_b)


def _both_e4m3(a, b) -> bool:
    return (isinstance(a, Float8Storage) and isinstance(b, Float8Storage)
            and a.data.dtype == E4M3 and b.data.dtype == E4M3)


def _triton_fp8(a, b) -> bool:
    """Per-tensor FP8 pair (any E4M3/E5M2 mix) on CUDA with Triton: ``kernels/fp8/grouped_gemm``
    (also on CPU under the Triton interpreter, ``TRITON_INTERPRET=1``: its CPU test)."""
    on_device = a.data.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return isinstance(a, Float8Storage) and isinstance(b, Float8Storage) and on_device and TRITON_INSTALLED


# --- the three grouped GEMMs ------------------------------------------------------------
def rows_gemm(a: TokenOperand, b: WeightOperand, offs, row_expert, config, dest, tok_offs) -> torch.Tensor:
    """``out [T, R]``: ``A [C, Kc] · B_e [R, Kc]ᵀ`` for the rows of each group (fprop, dgrad),
    in token order (``out_pad.index_select(0, dest)``; the Triton kernel stores token rows
    directly, ``tok_offs [E]`` int32 the cumulative token counts)."""
    e, sa, sb = b.num_experts, a.storage, b.storage
    r, kc = sb.shape2d[0] // e, sb.shape2d[1]
    if _both_e4m3(sa, sb):
        scale_b = b.scale.float()[:, None].expand(e, r).contiguous()
        out = _scaled_grouped_mm(sa.data, sb.data.view(e, r, kc).transpose(1, 2), row_scales(a.scale, row_expert),
                                 scale_b, offs, config.use_fast_accum)
    elif _triton_fp8(sa, sb):
        from hybrid_dist.kernels.fp8.grouped_gemm import grouped_rows  # Triton: CUDA installs only

        return grouped_rows(sa.data, sb.data.view(e, r, kc), a.scale, b.scale, offs, config.use_fast_accum,
                            tok_offs, dest.numel())
    else:  # both scales folded into the token rows, whatever the routing: an expert's rows come
        # out the same however many rows the other experts (or ranks) hold
        va, vb = fold_rows(sa, row_expert, a.scale, b.scale), fold_experts(bf16_values(sb), e)
        out = _grouped_mm(va, vb.transpose(1, 2), offs)  # vb [E, R, Kc]
    return out.index_select(0, dest)


def tokens_gemm(a: TokenOperand, b: TokenOperand, offs, row_expert, counts, config) -> torch.Tensor:
    """``dW [E, Ra, Rb] = A [Ra, C] · B [Rb, C]ᵀ`` grouped along C (wgrad); empty groups 0."""
    e, sa, sb = counts.numel(), a.storage, b.storage
    ra, rb = sa.shape2d[0], sb.shape2d[0]
    if not _both_e4m3(sa, sb) and _triton_fp8(sa, sb):  # writes zeros for empty groups
        from hybrid_dist.kernels.fp8.grouped_gemm import grouped_tokens  # Triton: CUDA installs only

        return grouped_tokens(sa.data, sb.data, a.scale, b.scale, offs, config.use_fast_accum)
    if _both_e4m3(sa, sb):
        scale_a = a.scale.float()[:, None].expand(e, ra).reshape(-1)
        scale_b = b.scale.float()[:, None].expand(e, rb).reshape(-1)
        out = _scaled_grouped_mm(sa.data, sb.data.t(), scale_a, scale_b, offs, config.use_fast_accum)
    elif ra <= rb:  # fold both scales into the smaller operand
        va = fold_columns(sa, row_expert, a.scale, b.scale)
        out = _grouped_mm(va, bf16_values(sb).t(), offs)
    else:
        vb = fold_columns(sb, row_expert, a.scale, b.scale)
        out = _grouped_mm(bf16_values(sa), vb.t(), offs)
    return torch.where((counts > 0)[:, None, None], out, out.new_zeros(()))


# --- autograd ---------------------------------------------------------------------------
def _token(q, fields, direction) -> TokenOperand:
    return token_operand(q.direction_quantizer(direction), fields, direction)


def _weights(weight, plan, need_dgrad):
    """``(fprop operand, dgrad source)``: the stacked rowwise operand, and what backward
    stacks the dgrad operand from (``_dgrad_operand``): for a high-precision weight the
    operand quantized now; for a ``QuantizedTensor`` its columnwise storage itself, read
    only in backward (under FSDP2 a forward gathers the rowwise direction alone and the
    columnwise buffers are refilled before backward: a copy made in forward would hold
    stale bytes)."""
    if isinstance(weight, QuantizedTensor):
        row = expert_weight_storages(weight, plan, need_dgrad=False)[0]
        col = gemm.operand(weight, "columnwise", "weight", "dgrad") if need_dgrad else None
        return stack_experts(row), col
    batched = batched_fp8_weights(weight, plan, need_dgrad=need_dgrad)
    if batched is not None:
        return batched[0], (batched[1].storage if need_dgrad else None)
    rows, cols = expert_weight_storages(weight, plan, need_dgrad=need_dgrad)
    return stack_experts(rows), (stack_experts(cols).storage if need_dgrad else None)


def _dgrad_operand(source, num_experts: int, from_weight: bool, after: torch.Tensor | None) -> WeightOperand:
    """The stacked dgrad operand from ``_weights``' source: a quantized weight's columnwise
    storage ``[K, E·N]`` (``grouped_linear`` note: expert weights) split into its E experts
    and stacked, copied after ``after`` (``stack_dim0_segments``), or the operand stacked in
    forward."""
    if from_weight:
        return stack_dim0_segments(source, num_experts, after)
    return WeightOperand(storage=source, scale=source.tensor_scale(), num_experts=num_experts)


class _QuantizedGroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, plan, io):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        mult = packed_multiple(plan)
        xs = io.get("x_packed") if io else None  # expert parallel: the received rows, packed
        index = io.get("index") if io else None  # expert parallel: the route's packed index
        x_hp = x if xs is None else None  # rows exchanged already quantized: no reference
        if xs is None:
            xs = device_split.split_quantize_packed(x, tokens_per_expert, plan.input, rowwise=True,
                                                    columnwise=need_wgrad, states=plan.states["input"], multiple=mult,
                                                    index=index)
        offs = xs.padded_offsets[1:].to(torch.int32)
        tok_offs = xs.offsets[1:].to(torch.int32)
        w_row, w_col = _weights(weight, plan, need_dgrad)
        from_weight = isinstance(weight, QuantizedTensor)
        x_row = _token(plan.input, xs.rowwise, "rowwise")
        y = rows_gemm(x_row, w_row, offs, xs.row_expert, plan.recipe.fprop, xs.dest, tok_offs)
        x_col = _token(plan.input, xs.columnwise, "columnwise").storage if need_wgrad else None
        ctx.stats = stats = active_stats(plan)  # None unless a logging step captures (no op when off)
        if stats is not None:
            e = weight.shape[0]
            stats.record_experts("input", x_hp, [x_row.storage],
                                 [x_col] if need_wgrad else None, num_experts=e, offsets=xs.offsets,
                                 poff=xs.padded_offsets)
            # a quantized weight's columnwise bytes are valid in backward (FSDP2 refills them then)
            cols = unstack_experts(_dgrad_operand(w_col, e, False, None)) if need_dgrad and not from_weight else None
            stats.record_experts("weight", weight, unstack_experts(w_row), cols, num_experts=e)
        saved_storages.pack(ctx, x_col, w_col)
        ctx.plan, ctx.mult, ctx.num_experts, ctx.w_from_weight = plan, mult, weight.shape[0], from_weight
        ctx.io = io if io and "packed" in io else None  # only dy_packed is read back (not the x rows)
        ctx.dx_sender = input_grad_sender(io)
        ctx.offs, ctx.tok_offs, ctx.tokens_per_expert = offs, tok_offs, tokens_per_expert  # device int tensors
        ctx.index = index
        return y

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_col, w_col = saved_storages.unpack(ctx)
        dys = ctx.io.get("dy_packed") if ctx.io else None  # expert parallel: filled by the combine's backward
        dy_hp = dy if dys is None else None  # gradient exchanged already quantized: no reference
        if dys is None:  # (else the exchange that quantized dy advanced its states)
            plan.advance("grad_output")
            dys = device_split.split_quantize_packed(dy.contiguous(), ctx.tokens_per_expert, plan.grad_output,
                                                     rowwise=need_dgrad, columnwise=need_wgrad,
                                                     states=plan.states["grad_output"], multiple=ctx.mult,
                                                     index=ctx.index)
        w_op = _dgrad_operand(w_col, ctx.num_experts, ctx.w_from_weight, dy) if need_dgrad else None
        if ctx.stats is not None:
            row = [_token(plan.grad_output, dys.rowwise, "rowwise").storage] if need_dgrad else None
            col = [_token(plan.grad_output, dys.columnwise, "columnwise").storage] if need_wgrad else None
            ctx.stats.record_experts("grad_output", dy_hp, row, col, num_experts=ctx.num_experts,
                                     offsets=dys.offsets, poff=dys.padded_offsets)
            if need_dgrad and ctx.w_from_weight:
                ctx.stats.record_experts("weight", None, None, unstack_experts(w_op), num_experts=ctx.num_experts)
        dx = dw = None
        if need_dgrad:
            dx = rows_gemm(_token(plan.grad_output, dys.rowwise, "rowwise"), w_op, ctx.offs, dys.row_expert,
                           plan.recipe.dgrad, dys.dest, ctx.tok_offs)
            dx = hand_off_input_grad(ctx.dx_sender, dx)  # its exchange runs during the wgrad
        if need_wgrad:
            x_op = TokenOperand(storage=x_col, scale=x_col.tensor_scale())
            dw = tokens_gemm(_token(plan.grad_output, dys.columnwise, "columnwise"), x_op, ctx.offs, dys.row_expert,
                             ctx.tokens_per_expert, plan.recipe.wgrad)
        return dx, dw, None, None, None


def grouped_linear(x, weight, tokens_per_expert, plan, io=None) -> torch.Tensor:
    """``y [T, N]`` of the grouped quantized path (module doc); the caller advances the
    input/weight states as for the reference path. Runs on CPU too (emulated kernels).
    ``io``: expert-parallel packed operands (``"x_packed"``, and ``"dy_packed"`` filled
    before the backward) that replace the quantization of x / dy."""
    return _QuantizedGroupedFn.apply(x, weight, tokens_per_expert, plan, io)


def exchange_packable(plan, tensor_type: str) -> bool:
    """An expert-parallel exchange can hand this path ``tensor_type``'s rows packed: per-tensor
    FP8 with columnwise = rowwise transposed (``device_split.packed_fp8_rows``; delayed scaling's
    scales and histories kept by the exchange, ``quantized_exchange``),
    or a block format without per-tensor fields whose columnwise the receiver requantizes
    from the rows (MXFP8; FP8 blocks with power-of-two scales: ``_wire``'s module doc)."""
    q = getattr(plan, tensor_type)
    row = q.direction_quantizer("rowwise")
    if isinstance(row, Float8Quantizer):
        return _wire.derivable_columnwise(q)
    return (not row.is_per_tensor and _wire.requantized_columnwise(q)
            and _wire.unsupported_reason(q, need_columnwise=True) is None)


# --- when it applies --------------------------------------------------------------------
def _rht_seed(q, direction):
    dq = q.direction_quantizer(direction)
    return dq.rht_seed if (isinstance(dq, NVFP4Quantizer) and dq.rht and direction == "columnwise") else None


def _token_side_reason(q) -> str | None:
    for d in ("rowwise", "columnwise"):
        dq = q.direction_quantizer(d)
        if isinstance(dq, IdentityQuantizer) and dq.dtype not in (None, BF16):
            return f"identity {d} in {dq.dtype}"
    return device_split.unsupported_reason(q)


def unsupported_reason(plan, x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when this path computes the call on any device (the CPU runs it emulated); else why not."""
    recipe = plan.recipe
    wq = weight.quantizer if isinstance(weight, QuantizedTensor) else plan.weight
    if not (hasattr(torch, "_grouped_mm") and hasattr(torch, "_scaled_grouped_mm")):
        return "torch has no _grouped_mm"
    if x.dtype != BF16 or weight.dtype != BF16:
        return f"x {x.dtype} / weight {weight.dtype} (bf16 only)"
    if any(c.out_dtype not in (None, BF16) for c in (recipe.fprop, recipe.dgrad, recipe.wgrad)):
        return "a GEMM output dtype other than bf16"
    if x.shape[1] % 16 or weight.shape[1] % 16:
        return f"K={x.shape[1]}, N={weight.shape[1]} (multiples of 16 only)"
    for q in (plan.input, plan.grad_output):
        reason = _token_side_reason(q)
        if reason is not None:
            return reason
    for d in ("rowwise", "columnwise"):
        dq = wq.direction_quantizer(d)
        if isinstance(dq, IdentityQuantizer) and dq.dtype not in (None, BF16):
            return f"weight identity {d} in {dq.dtype}"
    pairs = ((plan.input, "rowwise", wq, "rowwise"), (plan.grad_output, "rowwise", wq, "columnwise"),
             (plan.grad_output, "columnwise", plan.input, "columnwise"))
    for qa, da, qb, db in pairs:
        if _rht_seed(qa, da) != _rht_seed(qb, db):
            return f"Hadamard seeds differ ({da} {_rht_seed(qa, da)} vs {db} {_rht_seed(qb, db)})"
    return None


def fits(plan, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``GroupedLinear`` on CUDA takes this path (module doc)."""
    return x.is_cuda and unsupported_reason(plan, x, weight) is None
