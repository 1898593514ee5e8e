"""What ``hd.Linear`` and ``moe.GroupedLinear`` share: which recipe a forward uses, one
plan (quantizers + states) per recipe, and weights created under ``quantized_model_init``.

Public to the integrations: ``RecipeModuleMixin`` (``plan_for(recipe)``, ``active_recipe()``),
``in_backward``, and ``state_tensors`` / ``load_state_tensors`` for checkpointing plan states.

Recipe resolution: the module's own ``recipe``, else the enclosing ``hd.autocast``'s, else
none (high precision). A recompute runs inside backward, where ``hd.autocast`` is no longer
active, so it reuses the recipe of the module's last forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_dist import hp_init
from hybrid_dist.autocast import current_recipe, model_init_recipe
from hybrid_dist.formats.float8 import DelayedScalingState
from hybrid_dist.formats.nvfp4 import NVFP4State
from hybrid_dist.hybrid import HybridState, stateless
from hybrid_dist.recipes import Recipe
from hybrid_dist.quantized_tensor import QuantizedTensor

# [Note: quantizer states in the state dict]
# Quantizer states are module state: a module with a plan whose quantizers keep state puts
# it in its state dict under ``<prefix>_extra_state`` as ``{recipe name: {tensor_type: ...}}``:
# a DelayedScalingState as ``{"amax_history", "scale"}``, a stochastic-rounding NVFP4State as
# ``{"kernel_key", "generator_<device type>"}`` (``NVFP4State.state_dict`` on the weight's
# device), hybrid states nested as ``"rowwise"`` / ``"columnwise"``, per-expert lists as
# ``"0"``, ``"1"``, ... The key is absent for modules without such state, so their state
# dicts are as before; the name is the one torch.distributed.checkpoint's state_dict helpers
# accept. The tensors are the live ones where they are device tensors (plain, replicated):
# DCP saves one copy and loads it on every rank, in place (the delayed-scaling tensors and
# the Philox key; a generator's state is a copy, set on load). A loaded recipe the module
# has no plan for yet is kept and applied when the plan is built (the module's first
# forward under that recipe).
QUANTIZER_STATE_KEY = "_extra_state"


def _map_leaves(state: Any, fn) -> Any:
    """``fn(leaf)`` for every ``DelayedScalingState`` / ``NVFP4State`` of a plan state, nested
    as the note describes (hybrid directions, per-expert lists), None results left out; None
    if nothing is left."""
    if isinstance(state, (DelayedScalingState, NVFP4State)):
        return fn(state)
    if isinstance(state, HybridState):
        parts = {d: _map_leaves(getattr(state, d), fn) for d in ("rowwise", "columnwise")}
    elif isinstance(state, (list, tuple)):
        parts = {str(i): _map_leaves(s, fn) for i, s in enumerate(state)}
    else:
        return None
    parts = {k: v for k, v in parts.items() if v is not None}
    return parts or None


def state_tensors(state: Any, device: torch.device) -> dict | None:
    """The tensors of a plan state as a nested dict (see the note; live where they are device
    tensors), or None without state. ``device``: the module's (``NVFP4State.state_dict``)."""
    return _map_leaves(state, lambda s: s.state_dict(device) if isinstance(s, NVFP4State)
                       else {"amax_history": s.amax_history, "scale": s.scale})


@torch.no_grad()
def load_state_tensors(state: Any, saved: dict, where: str) -> None:
    """Copy ``saved`` (a ``state_tensors`` dict) into ``state`` in place."""
    if isinstance(state, NVFP4State):
        state.load_state_dict(saved)
        return
    if isinstance(state, DelayedScalingState):
        for f in ("amax_history", "scale"):
            dst, src = getattr(state, f), saved[f]
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(
                    f"load_state_dict: {where}.{f} has shape {tuple(src.shape)} in the checkpoint but "
                    f"{tuple(dst.shape)} in the module (a different amax_history_len?); build the "
                    "module with the recipe the checkpoint was saved with")
            dst.copy_(src)
        return
    children = {"rowwise": getattr(state, "rowwise", None), "columnwise": getattr(state, "columnwise", None)} \
        if isinstance(state, HybridState) else dict(enumerate(state)) if isinstance(state, (list, tuple)) else {}
    for k, sub in saved.items():
        key = int(k) if isinstance(state, (list, tuple)) else k
        if children.get(key) is None:
            raise ValueError(
                f"load_state_dict: the checkpoint has quantizer state {where}.{k}, but this "
                f"module's quantizer keeps none there; build it with the checkpoint's recipe")
        load_state_tensors(children[key], sub, f"{where}.{k}")


def _place_states(state: Any, device: torch.device) -> None:
    """Put a plan's states on ``device`` now rather than at first use: delayed-scaling
    histories move there, stochastic-rounding states create their CUDA Philox keys. A move
    or a key made inside a compiled forward would be a side effect Dynamo cannot trace (and,
    while a CUDA-graph tree runs, an allocation no graph output tracks). Not covered: a plan
    first built while compiling (a recipe that only ``hd.autocast`` gives, at a first
    forward that is compiled); run one eager step first there."""
    _map_leaves(state, lambda s: s.kernel_key(device) if isinstance(s, NVFP4State) else s.to(device))


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. an activation recompute); False while tracing."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class RecipeModuleMixin:
    """Mixed into an ``nn.Module`` that sets ``recipe``, ``name``, ``_plans = {}`` and
    ``_last_recipe = None`` and implements ``_build_plan(recipe)``."""

    recipe: Recipe | None
    _plans: dict[int, Any]  # id(recipe) -> plan (quantizers and their states)
    _last_recipe: Recipe | None  # recipe of the last forward, for recompute

    def _build_plan(self, recipe: Recipe) -> Any:
        raise NotImplementedError

    def plan_for(self, recipe: Recipe) -> Any:
        """The plan this module runs under ``recipe``: its quantizers per tensor type
        (``.weight``, ...) and their states (``.states``), built on first use and kept."""
        plan = self._plans.get(id(recipe))
        if plan is None or plan.recipe is not recipe:
            plan = self._build_plan(recipe)
            self._plans[id(recipe)] = plan
            self._make_plan_kernel_keys([plan])
            pending = self.__dict__.get("_hd_pending_states")
            if pending and recipe.name in pending:  # loaded before this plan existed
                self._load_plan_states(plan, pending.pop(recipe.name))
        return plan

    def plans(self) -> list[Any]:
        """Every plan built so far (one per recipe this module has run under)."""
        return list(self._plans.values())

    def _plan_anchor(self) -> torch.Tensor | None:
        """The parameter whose device the plans' states live on: ``weight``, else (a module
        with several weights, e.g. torchtitan's experts) its first own parameter."""
        params = self.__dict__.get("_parameters", {})
        return params.get("weight", next(iter(params.values()), None))

    def _make_plan_kernel_keys(self, plans) -> None:
        """``_place_states`` for ``plans`` on the weight's device, if it is a CUDA device
        (eager only): when a plan is built and when the module moves (``_apply``)."""
        weight = self._plan_anchor()
        if weight is not None and weight.is_cuda and not torch.compiler.is_compiling():
            for plan in plans:
                for state in plan.states.values():
                    _place_states(state, weight.device)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # .to / .cuda / to_empty: keys for the new device
        for p in self.__dict__.get("_parameters", {}).values():
            if isinstance(p, QuantizedTensor):  # .to(dtype) sets the dtype, not the storages
                p.follow_dtype()
        self._make_plan_kernel_keys(self.__dict__.get("_plans", {}).values())
        return out

    def quantizer_state_dict(self) -> dict[str, dict]:
        """``{recipe name: {tensor_type: nested tensors}}``: the delayed-scaling and
        stochastic-rounding states of every plan (see the note above); ``{}`` when there
        are none."""
        weight = self._plan_anchor()
        device = weight.device if weight is not None else torch.device("cpu")
        out: dict[str, dict] = {}
        for plan in self._plans.values():
            states = {t: state_tensors(s, device) for t, s in plan.states.items()}
            states = {t: v for t, v in states.items() if v is not None}
            if states:
                out[plan.recipe.name] = states
        return out

    def load_quantizer_state_dict(self, sd: dict[str, dict]) -> None:
        """Copy ``quantizer_state_dict()`` output into this module's states in place; a
        recipe without a plan yet is applied when its plan is built."""
        by_name = {plan.recipe.name: plan for plan in self._plans.values()}
        for name, states in sd.items():
            if name in by_name:
                self._load_plan_states(by_name[name], states)
            else:
                self.__dict__.setdefault("_hd_pending_states", {})[name] = states

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        states = self.quantizer_state_dict()
        if states:
            destination[prefix + QUANTIZER_STATE_KEY] = states

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        states = state_dict.pop(prefix + QUANTIZER_STATE_KEY, None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if states is not None:
            self.load_quantizer_state_dict(states)

    def _load_plan_states(self, plan: Any, states: dict) -> None:
        for t, saved in states.items():
            if t not in plan.states:
                raise ValueError(f"load_state_dict: unknown tensor type {t!r} in the quantizer states of "
                                 f"recipe {plan.recipe.name!r} (expected one of {sorted(plan.states)})")
            load_state_tensors(plan.states[t], saved, f"{plan.recipe.name}.{t}")

    def use_recipe(self, recipe: Recipe | None, *, name: str | None = None) -> None:
        """Run under ``recipe`` (None: ``hd.autocast``'s, else high precision), named ``name``
        in ``Role.name`` when given; the plan is built now, not inside a first (possibly
        compiled) forward, so its states exist before tracing."""
        self.recipe = recipe
        if name is not None:
            self.name = name
        if recipe is not None:
            self.plan_for(recipe)

    def active_recipe(self) -> Recipe | None:
        return self._active_recipe(in_backward())

    def _active_recipe(self, recompute: bool) -> Recipe | None:
        # a module's own recipe needs no memory for a recompute, and storing none keeps Python
        # side effects out of a compiled checkpoint, which then compiles whole. A forward that
        # advances delayed-scaling states stores it anyway: AOTAutograd's recompute would rerun
        # that advance from the advanced state, and the side effect makes Dynamo run the
        # checkpointed region eagerly, where the recompute is exact ([Note: recompute and delayed
        # scaling] in ``linear``)
        if self.recipe is not None and not self.plan_for(self.recipe).advances_state:
            return self.recipe
        recipe = self.recipe or current_recipe()
        if recompute:
            return recipe or self._last_recipe
        # eager: skip nn.Module.__setattr__ when unchanged; compiled: store unconditionally
        # (a condition on the attribute would guard on it and recompile once)
        if torch.is_grad_enabled() and (torch.compiler.is_compiling() or self._last_recipe is not recipe):
            self._last_recipe = recipe
        return recipe

    def _weight_parameter(self, w: torch.Tensor) -> nn.Parameter:
        """``w`` as a parameter; a QuantizedTensor (both directions) inside
        ``hd.quantized_model_init``, keeping the initial values when it asks to."""
        init = model_init_recipe()
        if init is None:
            return nn.Parameter(w)
        recipe, keep_hp = init
        return quantized_weight_parameter(w, self.plan_for(recipe).weight, init=w if keep_hp else None)


def quantized_weight_parameter(w: torch.Tensor, quantizer, *, init: torch.Tensor | None,
                               requires_grad: bool = True) -> nn.Parameter:
    """``w`` quantized by ``quantizer`` (both directions; a delayed-scaling quantizer with
    the current amax, as it has no history yet) as a parameter that keeps ``init`` (``w``'s
    values; given up by the caller) as its high-precision init (``hp_init``), if given."""
    param = nn.Parameter(stateless(quantizer).quantize(w.detach(), rowwise=True, columnwise=True),
                         requires_grad=requires_grad)
    if init is not None:
        hp_init.keep(param, init, copy=False)
    return param
