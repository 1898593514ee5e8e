"""Shared input quantization: a producer (``hd.RMSNorm``, ``hd.SwiGLU``) quantizes its
output once for every ``hd.Linear`` that reads it.

In a Llama block, ``attention_norm``'s output feeds wq, wk and wv: unfused, each of them
quantizes the same tensor again (FP8 current scaling reads it twice each: amax, then
cast). Linked with ``link_quantized_input(norm, consumers=[wq, wk, wv])``, the norm
returns one :class:`QuantizedTensor` holding the directions the consumers need and
``hd.Linear`` uses its storages as they are (docs/design.md §3).

[Note: when a producer shares its quantization]
At each forward the producer asks its consumers which recipe they run now (their own
``recipe``, else the enclosing ``hd.autocast``, else — in an activation recompute — the
recipe of their last forward) and which input quantizer that recipe gives them. It
fuses only if

* every consumer runs a recipe (none at all: plain output, no warning),
* all resolve to one input quantizer (frozen dataclasses, compared with ``==``), and
* that quantizer is stateless (the consumers' plans hold no input state: delayed
  scaling keeps one amax history per consumer, so each must quantize itself);

otherwise it returns its plain high-precision output and warns once, saying why.
Directions: rowwise always (fprop); columnwise when grad mode is on and some consumer's
weight needs a gradient (wgrad). A recompute sees the same recipes, quantizer and grad
mode, so it reproduces the forward bitwise. Under ``torch.compile`` a producer never
fuses (a ``QuantizedTensor`` crossing modules is a graph break): the launcher does not
link compiled models.

[Note: shared-input numerics]
The fused output is bitwise the unfused path — the producer's high-precision output
quantized by each consumer — because both quantize the same values with the same
stateless quantizer. ``hd.RMSNorm`` computes ``F.rms_norm`` and quantizes its output once
(``quantize_shared``, straight-through backward); ``hd.SwiGLU`` calls a CUDA kernel
registered with ``kernels.register_fused_quantize`` where one serves the quantizer
(``silu(a) * b`` recomputed in registers with torch's roundings, bitwise), else its
formula then one ``quantize_storages``. The consumers' input gradients are summed by
autograd as before and the producers' backward is the unfused one, so the gradients are
bitwise those of the unfused path.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hybrid_dist.recipe_module import in_backward
from hybrid_dist.warn import warn_once
from hybrid_dist.formats._quantizer import Quantizer
from hybrid_dist.linear import Linear
from hybrid_dist.quantized_tensor import QuantizedTensor


class _QuantizeShared(torch.autograd.Function):
    """``y`` → one ``QuantizedTensor`` for all consumers; straight-through backward (the
    consumers' input gradients, summed by autograd, are ``y``'s gradient)."""

    @staticmethod
    def forward(ctx, y, quantizer: Quantizer, columnwise: bool):
        y2d = y.reshape(-1, y.shape[-1])
        row, col = quantizer.quantize_storages(y2d, rowwise=True, columnwise=columnwise)
        return QuantizedTensor(y.shape, y.dtype, row, col, quantizer)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def quantize_shared(y: torch.Tensor, quantizer: Quantizer, columnwise: bool) -> torch.Tensor:
    """``y [..., K]`` quantized once (rowwise, and columnwise if asked) as a
    ``QuantizedTensor`` through which the gradient passes unchanged."""
    return _QuantizeShared.apply(y, quantizer, columnwise)


class QuantizedOutputProducer:
    """Mixed into an ``nn.Module`` whose output may feed ``hd.Linear`` consumers as one
    shared :class:`QuantizedTensor` (see ``link_quantized_input``)."""

    _hd_consumers: tuple = ()  # the linked hd.Linear modules (not submodules: no state)

    def output_features(self) -> int | None:
        """Size of the output's last dim when known at construction (consumers must read it)."""
        return None

    def _shared_target(self) -> tuple[Quantizer, bool] | None:
        """``(quantizer, columnwise)`` when this forward quantizes for the consumers, else None."""
        return shared_target(self, self._hd_consumers)


def link_quantized_input(producer: nn.Module, *, consumers: Sequence[nn.Module]) -> None:
    """Let ``producer`` quantize its output once for ``consumers`` (``hd.Linear`` modules
    that all read that output). ``consumers=[]`` unlinks. The link holds no state: state
    dicts are unchanged. The producer fuses only when the consumers' recipes allow it (see
    the note above); otherwise it returns its plain output."""
    if not isinstance(producer, QuantizedOutputProducer):
        raise ValueError(
            f"link_quantized_input: producer must be an hd.RMSNorm or hd.SwiGLU (a module that can "
            f"quantize its output), got {type(producer).__name__}; use hd.RMSNorm in place of nn.RMSNorm")
    consumers = tuple(consumers)
    bad = [type(c).__name__ for c in consumers if not isinstance(c, Linear)]
    if bad:
        raise ValueError(f"link_quantized_input: consumers must be hd.Linear modules, got {bad}; convert them "
                         "with hd.convert_to_hybrid first")
    features = {c.in_features for c in consumers}
    expected = producer.output_features()
    if len(features) > 1 or (expected is not None and features and features != {expected}):
        raise ValueError(
            f"link_quantized_input: the consumers read inputs of in_features {sorted(features)} but the "
            f"{type(producer).__name__} output has last dim {expected}; link only the layers that read it")
    if len({id(c) for c in consumers}) != len(consumers):
        raise ValueError("link_quantized_input: a consumer is listed twice; list each hd.Linear once")
    producer._hd_consumers = consumers


def _label(consumers) -> str:
    return ", ".join(getattr(c, "name", "") or type(c).__name__ for c in consumers)


def shared_target(producer, consumers: tuple) -> tuple[Quantizer, bool] | None:
    """The shared input quantizer and whether the columnwise direction is needed, or None
    (plain output; warns once when a recipe is set but the consumers cannot share)."""
    if not consumers or torch.compiler.is_compiling():
        return None
    recompute = in_backward()
    recipes = [c._active_recipe(recompute) for c in consumers]
    if all(r is None for r in recipes):
        return None
    why = None
    if any(r is None for r in recipes):
        why = "some consumers run without a recipe"
    else:
        plans = [c.plan_for(r) for c, r in zip(consumers, recipes)]
        quantizer = plans[0].input
        if any(p.input != quantizer for p in plans[1:]):
            why = f"their input quantizers differ ({', '.join(sorted({repr(p.input) for p in plans}))})"
        elif any(p.states["input"] is not None for p in plans):
            why = (f"the input quantizer {quantizer!r} keeps state per consumer (e.g. a delayed-scaling "
                   "amax history)")
    if why is not None:
        # once per producer class and reason (not per layer): a 32-layer model warns once
        warn_once(f"hd.{type(producer).__name__} feeding [{_label(consumers)}] (and any others alike): not sharing "
                  f"one quantization of its output because {why}; each consumer quantizes it itself (same "
                  "numbers, more work)", key=f"shared_input {type(producer).__name__}: {why}")
        return None
    columnwise = torch.is_grad_enabled() and any(c.weight.requires_grad for c in consumers)
    return quantizer, columnwise
