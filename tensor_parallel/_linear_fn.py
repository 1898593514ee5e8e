"""Tensor-parallel Linear autograd functions (Megatron layout, local tensors).

Shapes (``tp`` = group size, ``M`` = all rows, ``M/tp`` = a sequence-parallel shard):

column-parallel, ``W_local [N/tp, K]``:
    fprop  y [M, N/tp]  = x [M, K] · W_localᵀ          x gathered from [M/tp, K] under SP
    dgrad  dx[M, K]     = dy [M, N/tp] · W_local        partial: reduce-scatter (SP) / all-reduce
    wgrad  dW[N/tp, K]  = dyᵀ [N/tp, M] · x [M, K]      x re-gathered columnwise (``_inputs``)
row-parallel, ``W_local [N, K/tp]``:
    fprop  y [M, N]     = x [M, K/tp] · W_localᵀ        partial: reduce-scatter (SP) / all-reduce
    dgrad  dx[M, K/tp]  = dy [M, N] · W_local           dy gathered from [M/tp, N] under SP
    wgrad  dW[N, K/tp]  = dyᵀ [N, M] · x [M, K/tp]

Per-tensor scales use the amax of the whole (unsharded) tensor: weights, inputs and output
gradients whose sharded dim is a quantization dim reduce their amax over the group, so
every GEMM operand equals the single-process one (bitwise, see ``gather``). Gradient
reductions (reduce-scatter / all-reduce of dx and of the row-parallel output) run in high
precision. Communication overlaps compute where backward allows: the wgrad input gather
runs during the dgrad GEMM, the dgrad reduction during the wgrad GEMM.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from hybrid_dist import gemm, saved_storages
from hybrid_dist.inspection import active_stats, is_capturing
from hybrid_dist.linear import weight_operands
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.tensor_parallel import _comm
from hybrid_dist.tensor_parallel._inputs import WgradInput, gather_input
from hybrid_dist.tensor_parallel.gather import (
    ShardRequest,
    all_reduce_sum,
    gather_storages_along_first_dim,
    quantize_shards_with_group_amax,
    quantize_with_group_amax,
    reduce_scatter_along_first_dim,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPConfig:
    """How one ``hd.Linear`` is split. ``gather_path``: ``"auto"`` gathers quantized
    where valid, ``"high_precision"`` always gathers high precision (for comparisons).
    ``reduce_input_grad`` (column-parallel, replicated input): False leaves the input
    gradient partial over the TP ranks, for a parent that reduces the sum of its
    consumers' gradients once."""

    kind: str  # "colwise" | "rowwise"
    group: Any  # the TP ProcessGroup
    sequence_parallel: bool = False
    gather_path: str = "auto"
    reduce_input_grad: bool = True


# id(rowwise data tensor of a prepared, gathered-once input) -> (weakref to it, its
# SharedWgradInput). Keyed by the storage's tensor, not the wrapper: dispatch modes
# (CommDebugMode) may hand consumers an alias of the wrapper, which shares the storages.
# An entry is removed when its tensor dies.
_PREPARED: dict[int, tuple[weakref.ref, "SharedWgradInput"]] = {}


def _register_prepared(key: torch.Tensor, holder: "SharedWgradInput") -> None:
    k = id(key)
    _PREPARED[k] = (weakref.ref(key, lambda _: _PREPARED.pop(k, None)), holder)


def prepared_holder(x) -> "SharedWgradInput | None":
    """The shared wgrad operand if ``x`` came out of ``PreparedGatherFn``, else None."""
    if not isinstance(x, QuantizedTensor) or x.rowwise is None:
        return None
    key = next(iter(x.rowwise.tensors().values()))
    entry = _PREPARED.get(id(key))
    return entry[1] if entry is not None and entry[0]() is key else None


class SharedWgradInput:
    """One prepared input's wgrad operand shared by ``uses`` consumers: the first one to
    ask starts the gather, the last one drops it."""

    def __init__(self, wgrad: WgradInput, uses: int, stats_x: torch.Tensor | None = None):
        self._wgrad, self._uses, self._handle = wgrad, uses, None
        self.stats_x = stats_x  # a logging step: the gathered high-precision rows, the consumers' reference

    def start(self) -> _comm.CollectiveHandle:
        if self._wgrad is None and self._handle is None:
            raise AssertionError("prepared input has no wgrad operand (gathered with grad disabled?)")
        if self._handle is None:
            self._handle = self._wgrad.start()
        handle = self._handle
        self._uses -= 1
        if self._uses <= 0:
            self._handle = self._wgrad = None
        return handle


def _weight_request(weight, plan, *, need_dgrad: bool) -> ShardRequest | None:
    """The local weight shard, quantized with the group amax (in the input's all-reduce);
    None for a quantized weight (used as stored, see ``_weight_pair``)."""
    if isinstance(weight, QuantizedTensor):
        return None
    return ShardRequest(quantizer=plan.weight, x2d=weight, rowwise=True, columnwise=need_dgrad,
                        state=plan.states["weight"])


def _weight_pair(weight, plan, w_req, requests_out, *, need_dgrad: bool):
    """``(rowwise, columnwise)`` weight storages: from ``requests_out`` (the quantized
    request's result) or, for a quantized weight, its stored directions."""
    if w_req is None:
        return weight_operands(weight, plan, need_dgrad)
    return requests_out[-1]


def _reduce(x: torch.Tensor, cfg: TPConfig, *, async_op: bool):
    """Sum a partial result over the group: reduce-scatter along dim 0 under SP, else
    all-reduce. Returns a handle when ``async_op``."""
    if cfg.sequence_parallel:
        return reduce_scatter_along_first_dim(x, cfg.group, async_op=async_op)
    return all_reduce_sum(x, cfg.group, async_op=async_op)


def _all_rows(t2d: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of ``t2d`` in high precision: the reference a logging step measures
    a gathered (sequence-parallel) operand against. Only statistics capture gathers it."""
    world = _comm.group_size(group)
    _comm.log_event("all_gather", "statistics_reference", str(t2d.dtype), t2d.numel() * t2d.element_size() * world)
    _, out = _comm.all_gather_dim0(t2d.detach(), group)
    return out


class ColumnParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, cfg: TPConfig):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k = x.shape[-1]
        shared = prepared_holder(x)
        w_req = _weight_request(weight, plan, need_dgrad=need_dgrad)
        if shared is not None:  # PrepareHybridModuleInput gathered it once for all consumers
            if x.quantizer != plan.input:
                raise ValueError(
                    f"prepared input was quantized with {x.quantizer}, but this layer's recipe "
                    f"gives its input {plan.input}. Give all consumers the same input quantizer.")
            x_row, wgrad_in, lead = x.rowwise, shared, x.shape[:-1]
            done = quantize_shards_with_group_amax([w_req], cfg.group) if w_req is not None else []
        elif cfg.sequence_parallel:
            world = _comm.group_size(cfg.group)
            x_row, wgrad_in, done = gather_input(
                x.reshape(-1, k), cfg.group, plan.input, plan.states["input"], need_wgrad=need_wgrad,
                path=cfg.gather_path, extra=(w_req,) if w_req is not None else ())
            lead = (world * x.shape[0], *x.shape[1:-1])
        else:  # x is replicated: quantized whole on every rank, no amax to reduce
            row, col = plan.input.quantize_storages(x.reshape(-1, k), rowwise=True, columnwise=need_wgrad,
                                                    state=plan.states["input"])
            x_row, wgrad_in, lead = row, (WgradInput("local", col) if need_wgrad else None), x.shape[:-1]
            done = quantize_shards_with_group_amax([w_req], cfg.group) if w_req is not None else []
        w_row, w_col = _weight_pair(weight, plan, w_req, done, need_dgrad=need_dgrad)
        ctx.stats = stats = active_stats(plan)  # None unless a logging step captures (no op when off)
        ctx.stats_x = None  # SP: the gathered high-precision input, for the columnwise row in backward
        if stats is not None:
            if shared is None:
                x_ref = _all_rows(x.reshape(-1, k), cfg.group) if cfg.sequence_parallel else x
                local_col = wgrad_in is not None and wgrad_in.kind == "local"
                stats.record("input", x_ref, x_row, wgrad_in.storage if local_col else None)
                ctx.stats_x = x_ref if need_wgrad and not local_col else None
            elif shared.stats_x is not None:  # prepared once for several consumers: each records it
                stats.record("input", shared.stats_x, x_row, None)
                ctx.stats_x = shared.stats_x if need_wgrad else None
            # a quantized weight's columnwise bytes are valid in backward (FSDP2 refills them then)
            ctx.w_col_stats = isinstance(weight, QuantizedTensor) and w_col is not None
            stats.record("weight", weight, w_row, None if ctx.w_col_stats else w_col, sharded=True)
        # fprop: y [M, N/tp] = x [M, K] · W_local [N/tp, K]ᵀ
        y = gemm.gemm_nt(x_row, w_row, out_dtype=plan.recipe.fprop.out_dtype or x.dtype, config=plan.recipe.fprop)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.shared = shared if need_wgrad else None
        wgrad_st = wgrad_in.storage if isinstance(wgrad_in, WgradInput) else None
        ctx.wgrad_meta = wgrad_in.meta() if isinstance(wgrad_in, WgradInput) else None
        saved_storages.pack(ctx, w_col if need_dgrad else None, wgrad_st)
        ctx.plan, ctx.cfg, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = plan, cfg, x.shape, x.dtype, weight.dtype
        ctx.has_bias, ctx.prepared = bias is not None, shared is not None
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        plan, cfg = ctx.plan, ctx.cfg
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_col, wgrad_st = saved_storages.unpack(ctx)
        dy2d = dy.reshape(-1, dy.shape[-1])
        plan.grad_output.advance_state(plan.states["grad_output"])
        # dy [M, N/tp]: N is sharded, so a per-tensor scale needs the group amax
        dy_row, dy_col = quantize_with_group_amax(plan.grad_output, dy2d, cfg.group, rowwise=need_dgrad,
                                                  columnwise=need_wgrad, state=plan.states["grad_output"])
        if ctx.stats is not None:
            ctx.stats.record("grad_output", dy2d, dy_row, dy_col, sharded=True)
            if ctx.w_col_stats:
                ctx.stats.record("weight", None, None, w_col, sharded=True)
        x_handle = None
        if need_wgrad:  # start the wgrad input gather; it overlaps the dgrad GEMM
            src = ctx.shared if ctx.shared is not None else WgradInput.from_meta(ctx.wgrad_meta, wgrad_st)
            x_handle = src.start()
        dx = dw = db = dx_handle = None
        if need_dgrad:
            # dgrad: dx [M, K] (partial over N shards) = dy [M, N/tp] · W_local [N/tp, K]
            dx = gemm.gemm_nt(dy_row, w_col, out_dtype=plan.recipe.dgrad.out_dtype or ctx.x_dtype,
                              config=plan.recipe.dgrad)
            lead = dy.shape[:-1]
            dx = dx.reshape(*lead, dx.shape[-1])
            if not ctx.prepared and cfg.reduce_input_grad:  # else the sum of all consumers is reduced once
                dx_handle = _reduce(dx, cfg, async_op=True)
        if need_wgrad:
            # wgrad: dW [N/tp, K] = dyᵀ [N/tp, M] · x [M, K]   (x columnwise stored [K, M])
            x_col = x_handle.wait()
            if ctx.stats_x is not None:  # the input's columnwise row, now that it is gathered
                ctx.stats.record("input", ctx.stats_x, None, x_col)
            dw = gemm.gemm_nt(dy_col, x_col, out_dtype=plan.recipe.wgrad.out_dtype or ctx.w_dtype,
                              config=plan.recipe.wgrad)
        if dx_handle is not None:
            dx = dx_handle.wait().reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        return dx, dw, db, None, None


class RowParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, cfg: TPConfig):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k = x.shape[-1]
        # x [M, K/tp]: K is sharded, so a per-tensor scale needs the group amax
        x_req = ShardRequest(quantizer=plan.input, x2d=x.reshape(-1, k), rowwise=True, columnwise=need_wgrad,
                             state=plan.states["input"])
        w_req = _weight_request(weight, plan, need_dgrad=need_dgrad)
        done = quantize_shards_with_group_amax([x_req] + ([w_req] if w_req is not None else []), cfg.group)
        (x_row, x_col), (w_row, w_col) = done[0], _weight_pair(weight, plan, w_req, done, need_dgrad=need_dgrad)
        ctx.stats = stats = active_stats(plan)  # None unless a logging step captures (no op when off)
        if stats is not None:
            stats.record("input", x, x_row, x_col, sharded=True)
            ctx.w_col_stats = isinstance(weight, QuantizedTensor) and w_col is not None  # (as ColumnParallelFn)
            stats.record("weight", weight, w_row, None if ctx.w_col_stats else w_col, sharded=True)
        # fprop: y [M, N] (partial over K shards) = x [M, K/tp] · W_local [N, K/tp]ᵀ
        y = gemm.gemm_nt(x_row, w_row, out_dtype=plan.recipe.fprop.out_dtype or x.dtype, config=plan.recipe.fprop)
        y = _reduce(y.reshape(*x.shape[:-1], y.shape[-1]), cfg, async_op=False)
        if bias is not None:
            y = y + bias.to(y.dtype)
        saved_storages.pack(ctx, w_col if need_dgrad else None, x_col if need_wgrad else None)
        ctx.plan, ctx.cfg, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = plan, cfg, x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        plan, cfg = ctx.plan, ctx.cfg
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_col, x_col = saved_storages.unpack(ctx)
        dy2d = dy.reshape(-1, dy.shape[-1])
        plan.grad_output.advance_state(plan.states["grad_output"])
        db = None
        if cfg.sequence_parallel:
            # dy [M/tp, N] → gathered [M, N] in the grad_output format (rows = sequence)
            dy_row, dy_col = gather_storages_along_first_dim(
                dy2d, cfg.group, plan.grad_output, rowwise=need_dgrad, columnwise=need_wgrad,
                state=plan.states["grad_output"], path=cfg.gather_path)
            if ctx.has_bias and ctx.needs_input_grad[2]:  # the bias saw every row: sum over ranks
                db = _reduce_bias(dy2d.sum(0), cfg)
        else:
            dy_row, dy_col = plan.grad_output.quantize_storages(dy2d, rowwise=need_dgrad, columnwise=need_wgrad,
                                                                state=plan.states["grad_output"])
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy2d.sum(0)
        if ctx.stats is not None:
            ctx.stats.record("grad_output", _all_rows(dy2d, cfg.group) if cfg.sequence_parallel else dy2d, dy_row, dy_col)
            if ctx.w_col_stats:
                ctx.stats.record("weight", None, None, w_col, sharded=True)
        dx = dw = None
        if need_dgrad:
            # dgrad: dx [M, K/tp] = dy [M, N] · W_local [N, K/tp]   (W columnwise stored [K/tp, N])
            dx = gemm.gemm_nt(dy_row, w_col, out_dtype=plan.recipe.dgrad.out_dtype or ctx.x_dtype,
                              config=plan.recipe.dgrad).reshape(ctx.x_shape)
        if need_wgrad:
            # wgrad: dW [N, K/tp] = dyᵀ [N, M] · x [M, K/tp]   (dy, x columnwise stored [N, M], [K/tp, M])
            dw = gemm.gemm_nt(dy_col, x_col, out_dtype=plan.recipe.wgrad.out_dtype or ctx.w_dtype,
                              config=plan.recipe.wgrad)
        return dx, dw, db, None, None


def _reduce_bias(db: torch.Tensor, cfg: TPConfig) -> torch.Tensor:
    _comm.log_event("all_reduce", "bias_grad", str(db.dtype), db.numel() * db.element_size())
    db = db.contiguous()
    _, db = _comm.all_reduce(db, cfg.group)
    return db


class PreparedGatherFn(torch.autograd.Function):
    """Forward: all-gather a sequence-parallel input once, quantized rowwise, for several
    column-parallel consumers (q/k/v, gate/up). Backward: one high-precision
    reduce-scatter of the summed consumer gradients ``[M, K]`` → ``[M/tp, K]``."""

    @staticmethod
    def forward(ctx, x, quantizer, state, group, uses: int, path: str, need_wgrad: bool):
        k = x.shape[-1]
        world = _comm.group_size(group)
        row, wgrad_in, _ = gather_input(x.reshape(-1, k), group, quantizer, state, need_wgrad=need_wgrad,
                                        path=path)
        out = QuantizedTensor((world * x.shape[0], *x.shape[1:]), x.dtype, row, None, quantizer)
        stats_x = _all_rows(x.reshape(-1, k), group) if is_capturing() else None
        _register_prepared(next(iter(row.tensors().values())), SharedWgradInput(wgrad_in, uses, stats_x))
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along_first_dim(grad, ctx.group), None, None, None, None, None, None

