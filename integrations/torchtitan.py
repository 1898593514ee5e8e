"""A torchtitan model converter: train any hybrid recipe by configuration alone.

torchtitan (0.3) converts a model by rewriting its config tree before the model is built:
a ``ModelConfigConverter`` walks the tree and replaces configs, as its float8 converter
replaces each ``Linear.Config`` by a ``Float8Linear.Config``. ``HybridLinearConverter``
does the same with :class:`HybridLinear` — an ``hd.Linear`` that is also a torchtitan
``Module`` — so a config registry entry selects a named or a custom recipe::

    from hybrid_dist.integrations.torchtitan import HybridLinearConverter
    model_spec = model_registry("8B", converters=[
        HybridLinearConverter.Config(recipe="mxfp8_fwd_nvfp4_bwd", quantized_all_gather=True)])

``recipe``: a name from ``hd.RECIPE_NAMES``, ``package.module:attr`` or ``path/file.py:attr``
naming an ``hd.Recipe`` or a function returning one (``hybrid_dist.launch.config.load_recipe``).
``fqns`` converts only Linears (and experts) whose qualified name contains one of its entries (empty: all);
``filter_fqns`` leaves out those containing one of its entries. Only plain
``Linear.Config`` entries are converted (subclasses with their own forward, e.g.
``ScaledBiasRowwiseLinear``, stay). Each layer's plan (quantizers, delayed-scaling and
stochastic-rounding states) is built when the model is built and again by torchtitan's
``init_states`` (on the device the model was materialised on), so a compiled first step
meets no state creation.

``quantized_all_gather=True`` is the FSDP2 extension (torchtitan's float8 all-gather
counterpart): each weight is a ``hybrid_dist.fsdp2.HighPrecisionParam``, kept and updated in
high precision, that FSDP2 shards in high precision and all-gathers quantized per direction
(a shard that does not align with the format's blocks is gathered in high precision and
quantized after the gather). torchtitan builds the model on the meta device and initialises
it after ``fully_shard``, so weights stay high precision parameters here; quantized
parameters (``hd.quantized_model_init``) are not made by this converter.

``convert_experts=True`` (the default) also replaces each MoE ``GroupedExperts.Config`` (FQN
filtered as the Linears) by a :class:`HybridGroupedExperts` config: the same parameters
``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` (state-dict keys, shapes, sharding plans unchanged),
its three GEMMs through ``hybrid_dist.moe.apply_grouped_linear`` under the recipe's
``grouped_linear`` roles (``integrations/torchtitan_experts.py``). Experts the recipe cannot
serve, and ``GroupedExperts`` subclasses with their own forward, stay torchtitan's (one
warning per reason, naming them). The MoE router's ``gate`` is a plain Linear (out_features =
the number of experts, often no block multiple): leave it out with ``filter_fqns=["router.gate"]``,
as torchtitan's float8 converter does. ``quantized_all_gather`` applies to Linears only.

torchtitan is imported the first time ``HybridLinear``, ``HybridGroupedExperts`` or
``HybridLinearConverter`` is used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torch import nn

import hybrid_dist as hd
from hybrid_dist.fsdp2 import HighPrecisionParam
from hybrid_dist.integrations.torchtitan_experts import convert_experts, experts_class, replace_config

__all__ = ["HybridGroupedExperts", "HybridLinear", "HybridLinearConverter"]


def __getattr__(name: str):
    if name in __all__:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _classes() -> dict[str, type]:
    try:
        from torchtitan.components.quantization import QuantizationConverter
        from torchtitan.models.common.linear import Linear as TitanLinear
        from torchtitan.protocols.module import Module
    except ImportError as e:
        raise ImportError(f"hybrid_dist.integrations.torchtitan needs torchtitan ({e}); install it with "
                          "pip install -e \".[torchtitan]\"") from e

    class HybridLinear(hd.Linear, Module):
        """``hd.Linear`` built from a torchtitan ``Linear.Config`` plus a recipe. Its
        parameters are those of the Linear it replaces (``weight``, ``bias``; same shapes,
        same initialisation), so checkpoints and torchtitan's ``param_init`` apply as they are."""

        @dataclass(kw_only=True, slots=True)
        class Config(TitanLinear.Config):
            name: str = ""  # the module's qualified name (``hd.Role.name``)
            quantized_all_gather: bool = False  # weight as a HighPrecisionParam (FSDP2 quantized all-gather)
            _recipe: object = None  # the hd.Recipe (one object shared by every layer of a model)

        def __init__(self, config: Config):
            if not isinstance(config._recipe, hd.Recipe):
                raise ValueError(f"HybridLinear {config.name!r}: the config's _recipe must be an hd.Recipe, got "
                                 f"{type(config._recipe).__name__}; build it through HybridLinearConverter")
            hd.Linear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                               recipe=config._recipe, name=config.name)
            if config.quantized_all_gather:
                w = self.weight
                self.weight = nn.Parameter(HighPrecisionParam(w.detach(), self.plan_for(self.recipe).weight),
                                           requires_grad=w.requires_grad)

        def _init_self_parameters(self) -> None:
            """torchtitan's initialisation (``init_states``, after the model left the meta
            device): the parameters as torchtitan's ``Linear``, then the plan built anew on
            the weight's device, so its quantizer states (stochastic-rounding streams,
            amax histories) are fresh and real before a first, possibly compiled, step."""
            super()._init_self_parameters()
            self._plans.clear()
            self.plan_for(self.recipe)

    class HybridLinearConverter(QuantizationConverter):
        """Replace matching ``Linear.Config`` entries by :class:`HybridLinear` configs."""

        @dataclass(kw_only=True, slots=True)
        class Config(QuantizationConverter.Config):
            recipe: str = "mxfp8_fwd_nvfp4_bwd"
            """A named recipe, ``package.module:attr`` or ``path/file.py:attr``."""
            fqns: list[str] = field(default_factory=list)
            """Convert only Linears and experts whose FQN contains one of these (empty: all)."""
            filter_fqns: list[str] = field(default_factory=list)
            """Never convert Linears or experts whose FQN contains one of these."""
            quantized_all_gather: bool = False
            """FSDP2 all-gathers each weight quantized per direction (weights stay high precision)."""
            convert_experts: bool = True
            """Also run MoE ``GroupedExperts`` under the recipe, where it serves their shapes."""

        def __init__(self, config: Config):
            from hybrid_dist.launch.config import load_recipe

            self.config = config
            self.recipe = load_recipe(config.recipe)

        def wants(self, fqn: str) -> bool:
            """Whether the Linear or experts module at ``fqn`` is converted."""
            cfg = self.config
            return ((not cfg.fqns or any(f in fqn for f in cfg.fqns))
                    and not any(f in fqn for f in cfg.filter_fqns))

        def convert(self, model_config):
            for fqn, lin, parent, attr in list(model_config.traverse(TitanLinear.Config)):
                if type(lin) is not TitanLinear.Config or not self.wants(fqn):
                    continue
                new = HybridLinear.Config(
                    in_features=lin.in_features, out_features=lin.out_features, bias=lin.bias,
                    param_init=lin.param_init, sharding_config=lin.sharding_config, name=fqn,
                    quantized_all_gather=self.config.quantized_all_gather, _recipe=self.recipe)
                model_config = replace_config(model_config, parent, attr, new)
            if self.config.convert_experts:
                model_config = convert_experts(model_config, self.recipe, self.wants)
            return model_config

    for cls in (HybridLinear, HybridLinearConverter):
        cls.__qualname__ = cls.__name__  # shown in reprs and torchtitan's logs as the public name
    return {"HybridGroupedExperts": experts_class(), "HybridLinear": HybridLinear,
            "HybridLinearConverter": HybridLinearConverter}
