"""Recipes: which quantizer each tensor role gets, and each GEMM's precision.

A recipe is a factory ``factory(role) -> Quantizer`` plus a :class:`GemmConfig` per GEMM
(fprop, dgrad, wgrad). ``Role.tensor_type`` is one of ``"input"``, ``"weight"``,
``"grad_output"``; ``Role.module_type`` is ``"linear"`` or ``"grouped_linear"``;
``Role.name`` is the module's qualified name (set by ``convert_to_hybrid``; ``""`` when
unknown). The named recipes below each document their three-GEMM table as
``operand (direction: format)``.

Precision defaults (as PyTorch, TE and torchao): accumulate in fp32; GEMM outputs in the
input's dtype; FP8 fast accumulation allowed in fprop only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hybrid_dist.formats import (
    Float8BlockQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from hybrid_dist.formats._quantizer import Quantizer
from hybrid_dist.gemm import GemmConfig
from hybrid_dist.hybrid import HybridQuantizer

TENSOR_TYPES = ("input", "weight", "grad_output")
MODULE_TYPES = ("linear", "grouped_linear")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Role:
    """Which tensor of which module a quantizer is for."""

    tensor_type: str
    module_type: str = "linear"
    name: str = ""

    def __post_init__(self):
        if self.tensor_type not in TENSOR_TYPES:
            raise ValueError(f"Role.tensor_type must be one of {TENSOR_TYPES}, got {self.tensor_type!r}")
        if self.module_type not in MODULE_TYPES:
            raise ValueError(f"Role.module_type must be one of {MODULE_TYPES}, got {self.module_type!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """A named quantizer factory with per-GEMM precision."""

    name: str
    factory: Callable[[Role], Quantizer]
    fprop: GemmConfig = GemmConfig(use_fast_accum=True)
    dgrad: GemmConfig = GemmConfig()
    wgrad: GemmConfig = GemmConfig()

    def quantizer(self, role: Role) -> Quantizer:
        q = self.factory(role)
        if not isinstance(q, Quantizer):
            raise ValueError(
                f"recipe {self.name!r}: factory({role}) returned {type(q).__name__}; it must "
                "return a Quantizer (use hd.IdentityQuantizer() for 'no quantization')"
            )
        return q


def CustomRecipe(factory: Callable[[Role], Quantizer], *, name: str = "custom", **gemm_configs) -> Recipe:  # noqa: N802
    """A recipe from your own ``factory(role) -> Quantizer`` (GEMM configs as keywords)."""
    if not callable(factory):
        raise ValueError(f"CustomRecipe needs a callable factory(role) -> Quantizer, got {type(factory).__name__}")
    return Recipe(name=name, factory=factory, **gemm_configs)


def _by_type(input: Quantizer, weight: Quantizer, grad_output: Quantizer) -> Callable[[Role], Quantizer]:
    table = {"input": input, "weight": weight, "grad_output": grad_output}
    return lambda role: table[role.tensor_type]


def bf16() -> Recipe:
    """No quantization: fprop x·Wᵀ, dgrad dy·W, wgrad dyᵀ·x all in high precision."""
    i = IdentityQuantizer()
    return Recipe(name="bf16", factory=_by_type(i, i, i))


def fp8_current() -> Recipe:
    """Per-tensor FP8, current scaling (E4M3 forward, E5M2 gradients).

    | GEMM  | A                 | B                 |
    | fprop | x (row: E4M3)     | W (row: E4M3)     |
    | dgrad | dy (row: E5M2)    | W (col: E4M3)     |
    | wgrad | dy (col: E5M2)    | x (col: E4M3)     |
    """
    f, g = Float8Quantizer(dtype=E4M3), Float8Quantizer(dtype=E5M2)
    return Recipe(name="fp8_current", factory=_by_type(f, f, g))


def fp8_delayed() -> Recipe:
    """Per-tensor FP8, delayed scaling (amax history 16, max), E4M3 forward, E5M2 grads.

    | GEMM  | A                       | B                       |
    | fprop | x (row: E4M3 delayed)   | W (row: E4M3 delayed)   |
    | dgrad | dy (row: E5M2 delayed)  | W (col: E4M3 delayed)   |
    | wgrad | dy (col: E5M2 delayed)  | x (col: E4M3 delayed)   |
    """
    f = Float8Quantizer(dtype=E4M3, scaling="delayed")
    g = Float8Quantizer(dtype=E5M2, scaling="delayed")
    return Recipe(name="fp8_delayed", factory=_by_type(f, f, g))


def fp8_block() -> Recipe:
    """DeepSeek-V3 blockwise FP8: activations and grads 1×128, weights 128×128 (E4M3).

    | GEMM  | A                  | B                   |
    | fprop | x (row: 1x128)     | W (row: 128x128)    |
    | dgrad | dy (row: 1x128)    | W (col: 128x128)    |
    | wgrad | dy (col: 128x1)    | x (col: 128x1)      |
    """
    a, w = Float8BlockQuantizer(block="1x128"), Float8BlockQuantizer(block="128x128")
    return Recipe(name="fp8_block", factory=_by_type(a, w, a))


def mxfp8() -> Recipe:
    """MXFP8 everywhere (E4M3, 32-element E8M0 blocks along each GEMM's contraction).

    | GEMM  | A               | B              |
    | fprop | x (row: MXFP8)  | W (row: MXFP8) |
    | dgrad | dy (row: MXFP8) | W (col: MXFP8) |
    | wgrad | dy (col: MXFP8) | x (col: MXFP8) |
    """
    m = MXFP8Quantizer()
    return Recipe(name="mxfp8", factory=_by_type(m, m, m))


def nvfp4() -> Recipe:
    """NVFP4 everywhere: weights 16×16 blocks; inputs and grads RHT on the wgrad path;
    grads stochastically rounded.

    | GEMM  | A                       | B                    |
    | fprop | x (row: NVFP4)          | W (row: NVFP4 2D)    |
    | dgrad | dy (row: NVFP4 SR)      | W (col: NVFP4 2D)    |
    | wgrad | dy (col: NVFP4 RHT SR)  | x (col: NVFP4 RHT)   |
    """
    return Recipe(name="nvfp4", factory=_by_type(
        NVFP4Quantizer(rht=True), NVFP4Quantizer(block_2d=True),
        NVFP4Quantizer(rht=True, stochastic_rounding=True),
    ))


def mxfp8_fwd_nvfp4_bwd() -> Recipe:
    """MXFP8 forward, NVFP4 backward (hybrid input and weight).

    | GEMM  | A                       | B                   |
    | fprop | x (row: MXFP8)          | W (row: MXFP8)      |
    | dgrad | dy (row: NVFP4 SR)      | W (col: NVFP4)      |
    | wgrad | dy (col: NVFP4 RHT SR)  | x (col: NVFP4 RHT)  |
    """
    m = MXFP8Quantizer()
    return Recipe(name="mxfp8_fwd_nvfp4_bwd", factory=_by_type(
        HybridQuantizer(rowwise=m, columnwise=NVFP4Quantizer(rht=True)),
        HybridQuantizer(rowwise=m, columnwise=NVFP4Quantizer()),
        NVFP4Quantizer(rht=True, stochastic_rounding=True),
    ))


def fp8_fwd_bf16_bwd() -> Recipe:
    """Per-tensor FP8 forward, high-precision backward.

    | GEMM  | A                | B              |
    | fprop | x (row: E4M3)    | W (row: E4M3)  |
    | dgrad | dy (row: bf16)   | W (col: bf16)  |
    | wgrad | dy (col: bf16)   | x (col: bf16)  |
    """
    f, i = Float8Quantizer(dtype=E4M3), IdentityQuantizer()
    h = HybridQuantizer(rowwise=f, columnwise=i)
    return Recipe(name="fp8_fwd_bf16_bwd", factory=_by_type(h, h, i))


def bf16_fwd_mxfp8_bwd() -> Recipe:
    """High-precision forward, MXFP8 backward.

    | GEMM  | A               | B              |
    | fprop | x (row: bf16)   | W (row: bf16)  |
    | dgrad | dy (row: MXFP8) | W (col: MXFP8) |
    | wgrad | dy (col: MXFP8) | x (col: MXFP8) |
    """
    m, i = MXFP8Quantizer(), IdentityQuantizer()
    h = HybridQuantizer(rowwise=i, columnwise=m)
    return Recipe(name="bf16_fwd_mxfp8_bwd", factory=_by_type(h, h, m))


_NAMED = {
    f.__name__: f
    for f in (bf16, fp8_current, fp8_delayed, fp8_block, mxfp8, nvfp4, mxfp8_fwd_nvfp4_bwd,
              fp8_fwd_bf16_bwd, bf16_fwd_mxfp8_bwd)
}
RECIPE_NAMES = tuple(_NAMED)


_BUILT: dict[str, Recipe] = {}  # one object per name: modules key their quantizer state by recipe


def recipe_from_name(name: str) -> Recipe:
    """The named recipe ``name`` (one of ``RECIPE_NAMES``). Repeated calls return the same
    (immutable) object, so ``hd.autocast(hd.recipe_from_name(...))`` inside a training loop
    keeps each module's delayed-scaling history instead of starting a new one every step."""
    if name not in _NAMED:
        raise ValueError(f"unknown recipe {name!r}; named recipes are {', '.join(RECIPE_NAMES)}")
    if name not in _BUILT:
        _BUILT[name] = _NAMED[name]()
    return _BUILT[name]
