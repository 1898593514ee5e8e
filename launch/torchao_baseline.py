"""``--baseline torchao-float8``: torchao's float8 tensorwise training on the same model.

The comparison point of the throughput benchmark, set up as torchtitan does it: the model
is built with plain ``nn.Linear`` block projections (an ``hd.Linear`` would not be
converted), ``torchao.float8.convert_to_float8_training`` swaps them for ``Float8Linear``
(dynamic tensorwise scaling: e4m3 input and weight, e5m2 grad_output) with
``enable_fsdp_float8_all_gather=True`` (FSDP2 gathers the weights as float8: 1 byte per
element), before ``torch.compile`` (``--compile``, per block) and FSDP2; after each
optimizer step ``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's scale
with one all-reduce. The output head stays high precision, as in torchtitan and our recipes.

torchao is optional: without it ``--baseline torchao-float8`` raises ``ImportError`` naming
the package to install.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

TORCHAO_FLOAT8 = "torchao-float8"


def _torchao_float8():
    try:
        import torchao.float8 as tf8
    except ImportError as e:  # also a torchao whose compiled parts do not match this torch
        raise ImportError(
            f"--baseline {TORCHAO_FLOAT8} needs torchao (torchao.float8), which failed to import: {e}. "
            "Install a torchao wheel matching this torch (`pip install torchao`) or drop --baseline") from e
    return tf8


def check_available() -> None:
    """Raise ``ImportError`` early (before building a model) if torchao.float8 is missing."""
    _torchao_float8()


def _filter(module: nn.Module, fqn: str) -> bool:
    """Convert the block projections, not the output head (as torchtitan and ``hybrid_filter``)."""
    return fqn != "output" and isinstance(module, nn.Linear)


def convert(model: nn.Module) -> nn.Module:
    """Swap every block ``nn.Linear`` of ``model`` for torchao's ``Float8Linear`` in place
    (on meta or materialised parameters; before compile and FSDP2)."""
    tf8 = _torchao_float8()
    config = tf8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    tf8.convert_to_float8_training(model, module_filter_fn=_filter, config=config)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not converted:
        raise RuntimeError(f"--baseline {TORCHAO_FLOAT8}: no nn.Linear was converted; the model must be built with "
                           "linear=nn.Linear")
    return model


def after_step(model: nn.Module) -> Callable[[], None]:
    """The per-step hook to run after ``optimizer.step()``: one amax all-reduce for every
    sharded float8 weight's scale (a no-op when the weights are not FSDP2-sharded)."""
    tf8 = _torchao_float8()
    return lambda: tf8.precompute_float8_dynamic_scale_for_fsdp(model)


def is_float8_weight(t: torch.Tensor) -> bool:
    """True for a weight FSDP2 gathers as float8 (torchao's ``WeightWithDynamicFloat8CastTensor``)."""
    return type(t).__name__ == "WeightWithDynamicFloat8CastTensor"
