"""torchtitan's MoE experts on hybrid_dist's grouped GEMMs: ``HybridGroupedExperts``.

Legend (torchtitan's): R routed tokens sorted by expert, D model dim, F expert hidden dim,
E experts; a GEMM ``y [R, N] = x [R, K] · W_eᵀ`` per expert group.

torchtitan's ``GroupedExperts`` holds ``w1_EFD [E, F, D]``, ``w2_EDF [E, D, F]`` and
``w3_EFD [E, F, D]`` and computes, with operands cast to bf16 and ``torch._grouped_mm``:

    h_RF   = silu(x_RD · w1_eᵀ) * (x_RD · w3_eᵀ)       (w1, w3: N = F, K = D)
    out_RD = h_RF · w2_eᵀ, cast to x's dtype             (w2:     N = D, K = F)

``HybridGroupedExperts`` is that module — the same parameters (names, shapes, torchtitan's
``param_init`` and ``sharding_config``), so checkpoints, state-dict keys and FSDP2 / TP
sharding plans apply as they are — whose three GEMMs run through
``hybrid_dist.moe.apply_grouped_linear`` (the ``GroupedLinear`` paths: packed reference on
CPU, ``torch._grouped_mm`` / ``torch._scaled_grouped_mm`` / Triton grouped FP8 on CUDA),
each weight read as a ``GroupedLinear`` weight ``[E, N, K]``, with the SwiGLU between them
as torchtitan computes it. Each GEMM has its own ``GroupedPlan`` (quantizers of
``hd.Role(module_type="grouped_linear", name="<experts fqn>.w1_EFD")`` etc., per-expert
states); the three are one plan of the module (``ExpertsPlan``), whose stateful quantizers
(delayed scaling, stochastic rounding) are saved under ``_extra_state`` as ``hd.Linear``'s
are. x feeds w1 and w3 and is quantized for each (the same quantizer on the same values).

Left as torchtitan's module by ``HybridLinearConverter`` (one warning per reason, naming
the modules): experts whose config is a subclass of ``GroupedExperts.Config`` (their own
forward, e.g. gpt-oss's biased, clamped experts), and recipes that cannot serve the expert
shapes (``unsupported_reason``: a block that does not divide D or F, or a recipe factory
that refuses a grouped role). At run time a call whose local weights hold another number
of experts than the config (expert parallelism) runs torchtitan's forward, warned once per
module: the per-expert quantizer states are sized for the config's experts. Without a
recipe (``hd.set_recipe(model, None)``) the module runs torchtitan's forward.

torchtitan is imported the first time ``experts_class`` or ``convert_experts`` runs.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import hybrid_dist as hd
from hybrid_dist.moe import GroupedPlan, apply_grouped_linear
from hybrid_dist.recipe_module import RecipeModuleMixin
from hybrid_dist.warn import warn_once

__all__ = ["ExpertsPlan", "convert_experts", "experts_class", "replace_config", "unsupported_reason"]

WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


class ExpertsPlan:
    """One experts module's plan under one recipe: a ``GroupedPlan`` per weight
    (``gemms[name]``); ``states`` lists their states as ``"<weight>.<tensor_type>"``."""

    def __init__(self, recipe: hd.Recipe, *, num_experts: int, name: str):
        self.recipe = recipe
        self.gemms = {w: GroupedPlan(recipe, num_experts=num_experts, name=f"{name}.{w}") for w in WEIGHTS}
        self.states = {f"{w}.{t}": s for w, plan in self.gemms.items() for t, s in plan.states.items()}
        self.advances_state = any(plan.advances_state for plan in self.gemms.values())  # GroupedPlan's


def _gemm_shapes(dim: int, hidden_dim: int) -> dict[str, tuple[int, int]]:
    """Each weight's per-expert ``(N, K)``."""
    return {"w1_EFD": (hidden_dim, dim), "w2_EDF": (dim, hidden_dim), "w3_EFD": (hidden_dim, dim)}


def unsupported_reason(recipe: hd.Recipe, name: str, *, dim: int, hidden_dim: int) -> str | None:
    """None when ``recipe`` serves the experts at ``name`` with model dim ``dim`` and hidden
    dim ``hidden_dim``; else why not. Checked per GEMM: the weight ``[N, K]`` and the token
    operands ``x [p, K]``, ``dy [p, N]`` (p: the plan's token padding multiple) against every
    direction's blocks."""
    for w, (n, k) in _gemm_shapes(dim, hidden_dim).items():
        try:
            plan = GroupedPlan(recipe, num_experts=0, name=f"{name}.{w}")
        except (ValueError, NotImplementedError) as e:
            return f"{w}: the recipe has no grouped_linear quantizers ({e})"
        operands = (("weight", plan.weight, n, k), ("input", plan.input, plan.multiple, k),
                    ("grad_output", plan.grad_output, plan.multiple, n))
        for role, q, rows, cols in operands:
            for d in ("rowwise", "columnwise"):
                try:
                    q.direction_quantizer(d).check_shape(rows, cols, d)
                except ValueError as e:
                    return f"{w} {role} [{rows}, {cols}] (N={n}, K={k}): {e}"
    return None


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


@functools.cache
def experts_class() -> type:
    """``HybridGroupedExperts`` (imports torchtitan)."""
    from torchtitan.models.common.moe import GroupedExperts

    class HybridGroupedExperts(RecipeModuleMixin, GroupedExperts):
        """torchtitan's ``GroupedExperts`` whose GEMMs run under a hybrid recipe (module doc)."""

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            name: str = ""  # the module's qualified name (``hd.Role.name`` prefix)
            _recipe: object = None  # the hd.Recipe (one object shared by every layer of a model)

        def __init__(self, config: Config):
            if not isinstance(config._recipe, hd.Recipe):
                raise ValueError(f"HybridGroupedExperts {config.name!r}: the config's _recipe must be an hd.Recipe, "
                                 f"got {type(config._recipe).__name__}; build it through HybridLinearConverter")
            GroupedExperts.__init__(self, config)
            self.recipe, self.name = config._recipe, config.name
            self._plans = {}  # id(recipe) -> ExpertsPlan
            self._last_recipe = None  # recipe of the last forward, for recompute
            self.plan_for(self.recipe)

        def _build_plan(self, recipe: hd.Recipe) -> ExpertsPlan:
            return ExpertsPlan(recipe, num_experts=self.num_experts, name=self.name)

        def _init_self_parameters(self) -> None:
            """torchtitan's initialisation, then the plan built anew on the weights' device
            (as ``HybridLinear``: fresh, real quantizer states before a first compiled step)."""
            super()._init_self_parameters()
            self._plans.clear()
            if self.recipe is not None:
                self.plan_for(self.recipe)

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            recipe = self.active_recipe()
            w1_EFD, w2_EDF, w3_EFD = (_local(getattr(self, w)) for w in WEIGHTS)
            if recipe is None:
                return super().forward(x_RD, num_tokens_per_expert_E)
            if w1_EFD.shape[0] != self.num_experts:
                warn_once(f"HybridGroupedExperts {self.name!r}: {w1_EFD.shape[0]} local experts of "
                          f"{self.num_experts} (expert parallelism); its quantizer states are sized for "
                          f"{self.num_experts}, so it runs torchtitan's bf16 grouped GEMMs",
                          key=f"HybridGroupedExperts EP {self.name}")
                return super().forward(x_RD, num_tokens_per_expert_E)
            gemms, n = self.plan_for(recipe).gemms, num_tokens_per_expert_E
            x_RD_bf16 = x_RD.bfloat16()
            h_RF = F.silu(apply_grouped_linear(x_RD_bf16, w1_EFD.bfloat16(), n, gemms["w1_EFD"], name=self.name))
            h_RF = h_RF * apply_grouped_linear(x_RD_bf16, w3_EFD.bfloat16(), n, gemms["w3_EFD"], name=self.name)
            return apply_grouped_linear(h_RF, w2_EDF.bfloat16(), n, gemms["w2_EDF"], name=self.name).type_as(x_RD)

        def extra_repr(self) -> str:
            w = self.w1_EFD
            return (f"num_experts={self.num_experts}, dim={w.shape[2]}, hidden_dim={w.shape[1]}, "
                    f"recipe={self.recipe.name if self.recipe else None}")

    HybridGroupedExperts.__qualname__ = HybridGroupedExperts.__name__
    return HybridGroupedExperts


def replace_config(root, parent, attr, new):
    """``root`` with the config at ``parent[attr]`` (a list slot or an attribute; ``parent``
    None: the root itself, as ``traverse`` yields it) replaced by ``new``."""
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root


def convert_experts(model_config, recipe: hd.Recipe, wants) -> object:
    """Replace each ``GroupedExperts.Config`` whose FQN ``wants(fqn)`` accepts by a
    ``HybridGroupedExperts.Config`` where ``recipe`` serves it; warn once per reason for
    those left as they are. Returns the (possibly replaced) root config."""
    from torchtitan.models.common.moe import GroupedExperts

    cls = experts_class()
    left: dict[str, list[str]] = {}
    for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        if isinstance(cfg, cls.Config) or not wants(fqn):
            continue
        if type(cfg) is not GroupedExperts.Config:
            reason = f"{type(cfg).__qualname__} is not GroupedExperts.Config (its module has its own forward)"
        else:
            reason = unsupported_reason(recipe, fqn, dim=cfg.dim, hidden_dim=cfg.hidden_dim)
        if reason is not None:
            left.setdefault(reason, []).append(fqn)
            continue
        new = cls.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, name=fqn, _recipe=recipe)
        model_config = replace_config(model_config, parent, attr, new)
    for reason, fqns in left.items():
        more = f" and {len(fqns) - 1} more" if len(fqns) > 1 else ""
        warnings.warn(f"HybridLinearConverter: MoE experts {fqns[0]!r}{more} are not converted under recipe "
                      f"{recipe.name!r} and stay torchtitan's bf16 GroupedExperts: {reason}", stacklevel=3)
    return model_config
