"""``GroupedLinear``: E experts' Linears ``y_e = x_e W_eᵀ`` over token-grouped rows.

Legend: T tokens (sorted by expert), E experts, K in_features, N out_features,
``m_e`` tokens of expert e, ``p_e`` its padded count (``split_quantize`` note).

Each GEMM is grouped over experts. Four paths: the reference (a loop of ``gemm_nt`` per
expert on the padded slices, which reads the split sizes on the host) for CUDA calls the
others do not serve and for expert-parallel calls; on CPU the same formulas on the packed
layout (``grouped_reference.py``: bitwise the loop, no shape that depends on the routing,
so ``torch.compile`` traces it whole); CUDA + bf16 recipe: ``torch._grouped_mm`` with
device offsets (``_grouped_mm.py``); CUDA + a quantized recipe: ``split_quantize_packed``
then ``torch._scaled_grouped_mm`` / ``torch._grouped_mm`` (``grouped_quantized.py``). The
two CUDA paths make no device-to-host sync (except NVFP4 operands in eager steps, whose
split reads the padded offsets on the host once, ``device_split``); the quantized one is
not bitwise the reference (it rounds per-expert scales into one bf16 operand, its module
doc). Expert-parallel calls
(``io``) take the loop, except those whose rows arrive packed for the quantized path
(per-tensor FP8 and MXFP8-like block formats: ``packed_exchange``); recipes the quantized
path refuses (``grouped_quantized.unsupported_reason``) take the loop on CUDA. The reference computes:

    fprop  y_e  [p_e, N] = x_e.rowwise  [p_e, K] · W_e.rowwise    [N, K]ᵀ   → rows [:m_e]
    dgrad  dx_e [p_e, K] = dy_e.rowwise [p_e, N] · W_e.columnwise [K, N]ᵀ   → rows [:m_e]
    wgrad  dW_e [N, K]   = dy_e.colwise [N, p_e] · x_e.columnwise [K, p_e]ᵀ (groups along T)

Statistics (``hybrid_dist.inspection``): every path records one row set for all experts
while a logging step captures (``ModuleStats.record_experts``).

[Note: expert weights]
The weight is one parameter ``[E, N, K]``. High precision: each forward quantizes each
W_e ``[N, K]`` with its own state (per-expert per-tensor scales, as E ``hd.Linear``s).
Under ``hd.quantized_model_init`` the parameter is one ``QuantizedTensor [E, N, K]``
quantized as the 2D ``[E·N, K]`` (one per-tensor scale for all experts): rowwise stored
``[E·N, K]``, expert e = rows ``[eN, (e+1)N)``; columnwise stored ``[K, E·N]`` = ``[W_0ᵀ |
W_1ᵀ | ...]``, so expert e's dgrad operand W_eᵀ is columns ``[eN, (e+1)N)`` — a narrow of
the stored C axis, exact whenever N is a multiple of the columnwise block along N (32
MXFP8, 16 NVFP4 2D, 128 FP8 128x128), which the quantizer enforces on ``[E·N, K]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hybrid_dist import gemm, saved_storages
from hybrid_dist.inspection import active_stats
from hybrid_dist.recipe_module import RecipeModuleMixin, in_backward
from hybrid_dist.formats.float8 import DelayedScalingState, advance_stacked
from hybrid_dist.linear import LinearPlan
from hybrid_dist.moe.exchange_io import ExchangeIO, carries_operands, hand_off_input_grad, input_grad_sender
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.recipes import Recipe
from hybrid_dist.moe import _grouped_mm, grouped_quantized, grouped_reference
from hybrid_dist.moe._checks import check_token_counts
from hybrid_dist.moe.grouped_operands import expert_weight_storages
from hybrid_dist.moe.packed_index import IndexCache
from hybrid_dist.moe.split_quantize import split_quantize, token_multiple

__all__ = ["GroupedLinear", "GroupedPlan", "apply_grouped_linear"]


class GroupedPlan:
    """A grouped module's quantizers (one per role, shared by experts) and per-expert
    states (delayed-scaling histories, SR generators): ``states[tensor_type][e]``."""

    def __init__(self, recipe: Recipe, *, num_experts: int, name: str):
        base = LinearPlan.build(recipe, module_type="grouped_linear", name=name)
        self.recipe = recipe
        self.input, self.weight, self.grad_output = base.input, base.weight, base.grad_output
        self.states = {t: [getattr(self, t).make_state() for _ in range(num_experts)]
                       for t in ("input", "weight", "grad_output")}
        self.multiple = token_multiple(self.input, self.grad_output)  # x and dy pad alike
        # the forward advances a delayed-scaling state (input or weight amax histories)
        self.advances_state = any(isinstance(s, DelayedScalingState) for t in ("input", "weight")
                                  for s in self.states[t])
        self.advance_in_forward = True  # the forward starts the pass; False once hoisted (``LinearPlan``'s)
        self.stats: Any = None  # an inspection.ModuleStats once a StatsCollector is attached

    def start_forward_pass(self) -> None:
        self.advance("input")
        self.advance("weight")

    def hoist(self) -> None:
        """As ``LinearPlan.hoist``."""
        self.advance_in_forward = self.advances_state = False

    def advance(self, tensor_type: str) -> None:
        q, states = getattr(self, tensor_type), self.states[tensor_type]
        if states and all(isinstance(s, DelayedScalingState) for s in states):
            advance_stacked(states, q)  # one launch for every expert on CUDA
            return
        for s in states:
            q.advance_state(s)


def _grouped_gemm_rows(a_list, b_list, splits, *, out_dtype, config, width, like) -> torch.Tensor:
    """``cat_e (A_e @ B_eᵀ)[:m_e]`` → ``[T, width]`` (fprop and dgrad)."""
    outs = [gemm.gemm_nt(a, b, out_dtype=out_dtype, config=config)[:m] for a, b, m in zip(a_list, b_list, splits)]
    if not outs:
        return like.new_zeros(0, width, dtype=out_dtype)
    return torch.cat(outs)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, plan: GroupedPlan, io: ExchangeIO | None):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        e, n, _ = weight.shape
        x_q = io.get("x_quantized") if io else None
        x_hp = x if x_q is None else None  # rows exchanged already quantized: no reference
        if x_q is None:
            x_q = split_quantize(x, tokens_per_expert, [plan.input] * e, rowwise=True, columnwise=need_wgrad,
                                 states=plan.states["input"], multiple=plan.multiple)
        w_rows, w_cols = expert_weight_storages(weight, plan, need_dgrad=need_dgrad)
        ctx.stats = stats = active_stats(plan)  # None unless a logging step captures (no op when off)
        if stats is not None:
            stats.record_experts("input", x_hp, x_q.rowwise, x_q.columnwise if need_wgrad else None,
                                 num_experts=e, offsets=x_q.offsets, poff=x_q.padded_offsets)
            # a quantized weight's columnwise bytes are valid in backward (FSDP2 refills them then)
            ctx.w_col_stats = isinstance(weight, QuantizedTensor) and need_dgrad
            stats.record_experts("weight", weight, w_rows, w_cols if need_dgrad and not ctx.w_col_stats else None,
                                 num_experts=e)
        # fprop: y_e [p_e, N] = x_e [p_e, K] · W_e [N, K]ᵀ, keep the m_e real rows
        y = _grouped_gemm_rows(x_q.rowwise, w_rows, x_q.splits, out_dtype=plan.recipe.fprop.out_dtype or x.dtype,
                               config=plan.recipe.fprop, width=n, like=x)
        x_cols = x_q.columnwise if need_wgrad else [None] * e
        saved_storages.pack(ctx, *x_cols, *(w_cols if need_dgrad else [None] * e))
        ctx.plan, ctx.io, ctx.num_experts, ctx.dx_sender = plan, io, e, input_grad_sender(io)
        ctx.splits, ctx.padded = x_q.splits, x_q.padded_splits
        ctx.x_dtype, ctx.w_dtype, ctx.k = x.dtype, weight.dtype, x.shape[1]
        ctx.tokens_per_expert = tokens_per_expert  # device [E]; not differentiable
        return y

    @staticmethod
    def backward(ctx, dy):
        plan, e = ctx.plan, ctx.num_experts
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        saved = saved_storages.unpack(ctx)
        x_cols, w_cols = saved[:e], saved[e:]
        dy_q = ctx.io.get("dy_quantized") if ctx.io else None
        dy_hp = dy if dy_q is None else None  # gradient exchanged already quantized: no reference
        if dy_q is None:
            plan.advance("grad_output")
            dy_q = split_quantize(dy.contiguous(), ctx.tokens_per_expert, [plan.grad_output] * e, rowwise=need_dgrad,
                                  columnwise=need_wgrad, states=plan.states["grad_output"], multiple=plan.multiple)
        if ctx.stats is not None:
            ctx.stats.record_experts("grad_output", dy_hp, dy_q.rowwise if need_dgrad else None,
                                     dy_q.columnwise if need_wgrad else None, num_experts=e,
                                     offsets=dy_q.offsets, poff=dy_q.padded_offsets)
            if ctx.w_col_stats:
                ctx.stats.record_experts("weight", None, None, w_cols, num_experts=e)
        dx = dw = None
        if need_dgrad:
            # dgrad: dx_e [p_e, K] = dy_e [p_e, N] · W_e [N, K]   (W_e columnwise stored [K, N])
            dx = _grouped_gemm_rows(dy_q.rowwise, w_cols, ctx.splits, out_dtype=plan.recipe.dgrad.out_dtype
                                    or ctx.x_dtype, config=plan.recipe.dgrad, width=ctx.k, like=dy)
            dx = hand_off_input_grad(ctx.dx_sender, dx)  # its exchange runs during the wgrad
        if need_wgrad:
            # wgrad: dW_e [N, K] = dy_eᵀ [N, p_e] · x_e [p_e, K]   (grouped along tokens)
            dw = torch.stack([
                gemm.gemm_nt(d, xc, out_dtype=plan.recipe.wgrad.out_dtype or ctx.w_dtype, config=plan.recipe.wgrad)
                for d, xc in zip(dy_q.columnwise, x_cols)
            ])
        return dx, dw, None, None, None


def apply_grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                         plan: GroupedPlan, *, io: ExchangeIO | None = None, name: str = "") -> torch.Tensor:
    """``GroupedLinear``'s quantized forward with an explicit plan: ``y [T, N]`` of ``x [T, K]``
    (rows sorted by expert), ``weight [E, N, K]`` and ``tokens_per_expert [E]`` (int, on x's
    device), through the path the module doc picks. Unless it runs inside a backward (an
    activation recompute), it starts a new pass of the plan's input and weight states. ``io``: as
    ``GroupedLinear.forward``; ``name`` only labels errors. Inputs are not checked here."""
    if not carries_operands(io) and _grouped_mm.fits(plan, x, weight):
        return _grouped_mm.grouped_mm_linear(x, weight, tokens_per_expert, active_stats(plan), io)
    if not in_backward() and plan.advance_in_forward:
        if not (io is not None and ("x_quantized" in io or "x_packed" in io)):
            plan.advance("input")  # else the exchange that quantized x advanced it (expert_parallel)
        plan.advance("weight")
    packed_io = io is not None and ("x_packed" in io or "packed" in io)
    if (not carries_operands(io) or packed_io) and grouped_quantized.fits(plan, x, weight):
        return grouped_quantized.grouped_linear(x, weight, tokens_per_expert, plan, io)
    if packed_io:
        raise ValueError(f"GroupedLinear {name!r}: packed expert-parallel operands, but this call does "
                         "not take the packed path (see packed_exchange)")
    if grouped_reference.fits(plan, x, io):
        return grouped_reference.grouped_linear(x, weight, tokens_per_expert, plan, io)
    return _GroupedLinearFn.apply(x, weight, tokens_per_expert, plan, io)


class GroupedLinear(RecipeModuleMixin, nn.Module):
    """E bias-free Linears ``[in_features → out_features]`` applied to token groups.

    ``forward(x [T, K], tokens_per_expert [E] int on x's device) -> [T, N]``; rows of x are
    sorted by expert. Recipe resolution as ``hd.Linear`` (own ``recipe``, else the
    enclosing ``hd.autocast``, else high precision); roles use ``module_type="grouped_linear"``.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False, *,
                 recipe: Recipe | None = None, name: str = "", device=None, dtype=None):
        super().__init__()
        if bias:
            raise NotImplementedError("GroupedLinear(bias=True) is not supported; experts here are bias-free")
        if num_experts < 1:
            raise ValueError(f"GroupedLinear needs num_experts >= 1, got {num_experts}")
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.recipe, self.name = recipe, name
        self._plans: dict[int, GroupedPlan] = {}  # id(recipe) -> quantizers and per-expert states
        self._last_recipe: Recipe | None = None  # recipe of the last forward, for recompute
        w = torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype)
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        nn.init.uniform_(w, -bound, bound)  # = kaiming_uniform(a=√5) of each [N, K] expert
        self.weight = self._weight_parameter(w)

    def _build_plan(self, recipe: Recipe) -> GroupedPlan:
        return GroupedPlan(recipe, num_experts=self.num_experts, name=self.name)

    def plan(self, recipe: Recipe) -> GroupedPlan:
        """This module's quantizers and per-expert states under ``recipe``."""
        return self.plan_for(recipe)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, *, io: ExchangeIO | None = None):
        """``io`` (expert-parallel hook, an ``ExchangeIO``; a dict serves outside module hooks
        that rebuild arguments): ``"x_quantized"`` (a ``GroupedQuantized``) replaces the
        input quantization; ``"dy_quantized"``, filled before this layer's backward runs,
        replaces the gradient quantization (``expert_parallel``). On the packed CUDA path
        the same as ``"x_packed"`` / ``"dy_packed"`` (``device_split.PackedSplit``; ``io``
        then holds ``"x_packed"`` or ``"packed"``: ``packed_exchange``), and ``"index"``, the
        route's packed index, whose owner made the counts (not checked again on the device)."""
        index = io.get("index") if io is not None else None
        self._check(x, tokens_per_expert, counted=IndexCache.serving(index, tokens_per_expert, x.shape[0]) is not None)
        recipe = self.active_recipe()
        if recipe is None:
            return _grouped_mm.high_precision(x, self.weight, tokens_per_expert, io)
        return apply_grouped_linear(x, self.weight, tokens_per_expert, self.plan(recipe), io=io, name=self.name)

    def packed_exchange(self, x: torch.Tensor, tensor_type: str) -> int | None:
        """The padding multiple an expert-parallel exchange of ``tensor_type`` (``"input"`` or
        ``"grad_output"``) uses to hand this layer its rows packed (``io["x_packed"]`` /
        ``"dy_packed"``), or None when it should send per-expert storages: the layer must take
        the packed CUDA path for ``x`` under the active recipe, with a format the exchange can
        hand over packed (``grouped_quantized.exchange_packable``)."""
        recipe = self.active_recipe()
        if recipe is None:
            return None
        plan = self.plan(recipe)
        fits = grouped_quantized.fits(plan, x, self._forward_weight_like())
        if not (fits and grouped_quantized.exchange_packable(plan, tensor_type)):
            return None
        return grouped_quantized.packed_multiple(plan)

    def _forward_weight_like(self) -> torch.Tensor:
        """The weight as this module's forward will see it, for choosing a path before it
        runs: under FSDP2 mixed precision the parameter is the sharded master (fp32, say)
        until the forward's pre-hook gathers it in ``param_dtype``; then a meta tensor of
        that dtype and the full shape stands in (DTensor ``shape`` is the global one)."""
        w = self.weight
        state = getattr(self, "_get_fsdp_state", None)  # a fully_shard-ed module (FSDP2's own state)
        dtype = state()._mp_policy.param_dtype if state is not None else None
        if dtype is None or dtype == w.dtype or isinstance(w, QuantizedTensor):
            return w
        return torch.empty(w.shape, dtype=dtype, device="meta")

    def _check(self, x, tokens_per_expert, counted: bool = False) -> None:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"GroupedLinear expects x [T, {self.in_features}], got {tuple(x.shape)}")
        if (not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.shape != (self.num_experts,)
                or tokens_per_expert.is_floating_point() or tokens_per_expert.device != x.device):
            raise ValueError(
                f"GroupedLinear expects tokens_per_expert as an int tensor [{self.num_experts}] on "
                f"{x.device}; got {getattr(tokens_per_expert, 'dtype', type(tokens_per_expert).__name__)} "
                f"{tuple(getattr(tokens_per_expert, 'shape', ()))} on {getattr(tokens_per_expert, 'device', None)}"
            )
        if not counted:
            check_token_counts(tokens_per_expert, x.shape[0], "GroupedLinear")

    def extra_repr(self) -> str:
        recipe = self.recipe.name if self.recipe else None
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, recipe={recipe}")

