"""``hd.Linear``: ``y = x Wᵀ + b`` with each GEMM operand in its recipe's format.

One ``autograd.Function`` holds the three GEMMs (see ``gemm``). Forward quantizes the
input rowwise (fprop) and, only if the weight needs a gradient, columnwise (wgrad); the
weight rowwise and, only if the input needs a gradient, columnwise (dgrad). Backward
needs only the columnwise directions, so only those are saved — never the
high-precision input. The input may also arrive already quantized, as a
``QuantizedTensor`` made by a linked producer (``hd.RMSNorm``, ``hd.SwiGLU``; see
``shared_input``) with this layer's input quantizer: its storages are used as they are,
and the input's gradient flows back to the producer as a plain tensor.

[Note: recompute and delayed scaling]
Activation recompute reruns the forward inside backward, where ``hd.autocast`` is no
longer active: a module reuses the recipe its original forward used. A forward that is
not a recompute (``torch._C._current_graph_task_id() == -1``) starts a new delayed-scaling
pass; quantizing records the amax as a running max, so a recompute changes no state and
reproduces the forward bitwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_dist import gemm, saved_storages
from hybrid_dist.inspection.capture import active_stats
from hybrid_dist.recipe_module import QUANTIZER_STATE_KEY, RecipeModuleMixin, in_backward  # noqa: F401 (re-export)
from hybrid_dist.formats._quantizer import Quantizer
from hybrid_dist.formats.float8 import DelayedScalingState
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.recipes import Recipe, Role


@dataclasses.dataclass
class LinearPlan:
    """A module's quantizers and their states under one recipe."""

    recipe: Recipe
    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer
    states: dict[str, Any]  # tensor_type -> quantizer state (delayed history, SR RNG)
    stats: Any = None  # an inspection.ModuleStats once a StatsCollector is attached (else nothing records)
    # the forward advances a delayed-scaling state (input or weight amax history); fixed at
    # construction (or by ``hoist``), read on every forward (``RecipeModuleMixin._active_recipe``)
    advances_state: bool = dataclasses.field(init=False)
    # the module's forward starts the pass (``start_forward_pass``); False once hoisted
    advance_in_forward: bool = dataclasses.field(default=True, init=False)

    def __post_init__(self) -> None:
        self.advances_state = any(isinstance(self.states[t], DelayedScalingState) for t in ("input", "weight"))

    def hoist(self) -> None:
        """Leave ``start_forward_pass`` to the caller (``hoisted_advance``): the forward then
        only reads and records its states."""
        self.advance_in_forward = self.advances_state = False

    @classmethod
    def build(cls, recipe: Recipe, *, module_type: str, name: str) -> "LinearPlan":
        qs = {t: recipe.quantizer(Role(tensor_type=t, module_type=module_type, name=name))
              for t in ("input", "weight", "grad_output")}
        return cls(recipe=recipe, **qs, states={t: q.make_state() for t, q in qs.items()})

    def start_forward_pass(self) -> None:
        self.input.advance_state(self.states["input"])
        self.weight.advance_state(self.states["weight"])


def weight_operands(weight, plan: LinearPlan, need_dgrad: bool):
    """(rowwise, columnwise or None) storages of the weight: taken from a quantized
    parameter (error naming a missing direction), else quantized now."""
    if isinstance(weight, QuantizedTensor):
        w_col = gemm.operand(weight, "columnwise", "weight", "dgrad") if need_dgrad else None
        return gemm.operand(weight, "rowwise", "weight", "fprop"), w_col
    return plan.weight.quantize_storages(weight, rowwise=True, columnwise=need_dgrad,
                                         state=plan.states["weight"])


def _input_operands(x, plan: LinearPlan, need_wgrad: bool):
    """(rowwise, columnwise or None) storages of the input: taken from a shared
    QuantizedTensor (error naming a missing direction), else quantized now."""
    if isinstance(x, QuantizedTensor):
        x_col = gemm.operand(x, "columnwise", "input", "wgrad") if need_wgrad else None
        return gemm.operand(x, "rowwise", "input", "fprop"), x_col
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return plan.input.quantize_storages(x2d, rowwise=True, columnwise=need_wgrad, state=plan.states["input"])


class _LinearFn(torch.autograd.Function):
    """The three GEMMs on per-direction storages (plain tensors inside: traceable by
    ``torch.compile``; no ``QuantizedTensor`` is made for activations or gradients)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, grad_enabled: bool):
        # under no_grad no backward runs: the columnwise directions are not made
        need_dgrad, need_wgrad = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        x_row, x_col = _input_operands(x, plan, need_wgrad)
        w_row, w_col = weight_operands(weight, plan, need_dgrad)
        ctx.stats = stats = active_stats(plan)  # None unless a logging step captures (no op when off)
        if stats is not None:
            stats.record("input", x, x_row, x_col)
            # a quantized weight's columnwise bytes are valid in backward (FSDP2 refills them then)
            ctx.w_col_stats = isinstance(weight, QuantizedTensor) and w_col is not None
            stats.record("weight", weight, w_row, None if ctx.w_col_stats else w_col)
        # fprop: y [M, N] = x [M, K] · W [N, K]ᵀ
        y = gemm.gemm_nt(x_row, w_row, out_dtype=plan.recipe.fprop.out_dtype or x.dtype, config=plan.recipe.fprop)
        if bias is not None:
            y = y + bias.to(y.dtype)
        saved_storages.pack(ctx, x_col, w_col)
        ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = plan, x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_col, w_col = saved_storages.unpack(ctx)
        dy2d = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        plan.grad_output.advance_state(plan.states["grad_output"])
        dy_row, dy_col = plan.grad_output.quantize_storages(dy2d, rowwise=need_dgrad, columnwise=need_wgrad,
                                                            state=plan.states["grad_output"])
        if ctx.stats is not None:
            ctx.stats.record("grad_output", dy2d, dy_row, dy_col)
            if ctx.w_col_stats:
                ctx.stats.record("weight", None, None, w_col)
        dx = dw = db = None
        if need_dgrad:
            # dgrad: dx [M, K] = dy [M, N] · W [N, K]   (W columnwise stored [K, N])
            dx = gemm.gemm_nt(dy_row, w_col, out_dtype=plan.recipe.dgrad.out_dtype or ctx.x_dtype,
                              config=plan.recipe.dgrad)
            if len(ctx.x_shape) != 2:
                dx = dx.reshape(ctx.x_shape)
        if need_wgrad:
            # wgrad: dW [N, K] = dyᵀ [N, M] · x [M, K]   (dy, x columnwise stored [N, M], [K, M])
            dw = gemm.gemm_nt(dy_col, x_col, out_dtype=plan.recipe.wgrad.out_dtype or ctx.w_dtype,
                              config=plan.recipe.wgrad)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        return dx, dw, db, None, None


class DequantizeFn(torch.autograd.Function):
    """Straight-through dequantize: the gradient passes to the quantized tensor unchanged."""

    @staticmethod
    def forward(ctx, t: QuantizedTensor, dtype: torch.dtype):
        # a forward reads the rowwise (fprop) direction: under FSDP2 it is the one gathered
        # for this pass, while a columnwise copy may be left over from the last backward
        return t.dequantize("rowwise" if t.rowwise is not None else "columnwise", dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Linear(RecipeModuleMixin, nn.Module):
    """Drop-in ``nn.Linear`` whose GEMMs run in a recipe's formats.

    The recipe is ``recipe`` if given, else the one of the enclosing ``hd.autocast``;
    with neither, the layer runs in high precision. Created inside
    ``hd.quantized_model_init(recipe)``, the weight is a :class:`QuantizedTensor`.
    ``name`` is the qualified name passed to the recipe's factory in ``Role.name``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe | None = None, name: str = "", device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe = recipe
        self.name = name
        self._plans: dict[int, LinearPlan] = {}  # id(recipe) -> quantizers and states
        self._last_recipe: Recipe | None = None  # recipe of the last forward, for recompute
        w = torch.empty(out_features, in_features, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self._init_weights(w)
        if recipe is not None:  # built now, not inside a first (possibly compiled) forward
            self.plan_for(recipe)

    def _init_weights(self, w: torch.Tensor) -> None:
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self.weight = self._weight_parameter(w)

    def _build_plan(self, recipe: Recipe) -> LinearPlan:
        return LinearPlan.build(recipe, module_type="linear", name=self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"hd.Linear expects input [..., {self.in_features}], got {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(
                f"hd.Linear {self.name!r}: the input is on {x.device} but the weight is on "
                f"{self.weight.device}; move the input or the module to one device")
        recompute = in_backward()
        recipe = self._active_recipe(recompute)
        if isinstance(x, QuantizedTensor):
            self._check_shared_input(x, recipe)
        if recipe is None:
            w = self.weight
            if isinstance(w, QuantizedTensor):
                w = DequantizeFn.apply(w, x.dtype)
            return F.linear(x, w, self.bias)
        plan = self.plan_for(recipe)
        if not recompute and plan.advance_in_forward:
            plan.start_forward_pass()
        if torch.compiler.is_compiling():
            return _LinearFn.apply(x, self.weight, self.bias, plan, torch.is_grad_enabled())
        try:
            return _LinearFn.apply(x, self.weight, self.bias, plan, torch.is_grad_enabled())
        except ValueError as e:  # e.g. a dim that does not fit a format's block: say which layer
            raise ValueError(f"hd.Linear {self.name or '(unnamed)'!r} under recipe {recipe.name!r}: {e}") from None

    def _check_shared_input(self, x: QuantizedTensor, recipe: Recipe | None) -> None:
        """A producer's QuantizedTensor must be what this layer would have made itself."""
        if recipe is None:
            raise ValueError(
                f"hd.Linear {self.name!r} runs without a recipe but got a QuantizedTensor input (quantizer "
                f"{x.quantizer!r}); give it a recipe or pass a high-precision input")
        quantizer = self.plan_for(recipe).input
        if x.quantizer != quantizer:
            raise ValueError(
                f"hd.Linear {self.name!r}: the QuantizedTensor input was made by {x.quantizer!r}, but recipe "
                f"{recipe.name!r} quantizes this layer's input with {quantizer!r}; quantize it with that "
                "quantizer, pass a high-precision input, or unlink the producer (hd.link_quantized_input)")
        if self.plan_for(recipe).states["input"] is not None:
            raise ValueError(
                f"hd.Linear {self.name!r}: its input quantizer {quantizer!r} keeps state (e.g. a delayed-scaling "
                "amax history) that must see the high-precision input; pass that instead of a QuantizedTensor")

    # delayed-scaling states in the state dict (see [Note: quantizer states in the state dict])
    def extra_repr(self) -> str:
        recipe = self.recipe.name if self.recipe else None
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={recipe}")
