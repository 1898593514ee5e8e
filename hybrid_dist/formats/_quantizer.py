"""The quantizer base class: a frozen config that turns a high-precision tensor into a
:class:`~hybrid_dist.QuantizedTensor` holding the requested directions.

Subclasses implement ``_quantize_2d`` (reference, pure torch) on the 2D view ``[M, K]``
and declare their block sizes; the base validates input, checks shapes against the
blocks (``ValueError`` naming dim, size and multiple), picks the CUDA kernel when one is
registered for the format (``hybrid_dist._kernel_registry``) and wraps the result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from hybrid_dist import _kernel_registry
from hybrid_dist.warn import warn_once
from hybrid_dist.formats._storage import DirectionStorage
from hybrid_dist.quantized_tensor import QuantizedTensor

_DIRECTIONS = ("rowwise", "columnwise")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantizer:
    """Base of every format's quantizer. Immutable; mutable state lives in ``make_state()``.

    ``quantize(x, rowwise=..., columnwise=...)`` makes only the directions asked for, from
    one call. ``PRECISION_RANK`` orders formats by fidelity (higher = more precise); a
    hybrid tensor dequantizes from its more precise direction by default.
    """

    FORMAT: ClassVar[str] = ""
    PRECISION_RANK: ClassVar[int] = 0

    # --- to implement -------------------------------------------------------------
    def block_shape(self, direction: str) -> tuple[int, int]:
        """Multiples ``(m, k)`` that the logical ``[M, K]`` must satisfy for ``direction``."""
        raise NotImplementedError

    def _quantize_2d(
        self, x: torch.Tensor, *, rowwise: bool, columnwise: bool, state: Any, amax: torch.Tensor | None
    ) -> tuple[DirectionStorage | None, DirectionStorage | None]:
        raise NotImplementedError

    # --- public -------------------------------------------------------------------
    def make_state(self) -> Any:
        """Mutable per-tensor-slot state (delayed-scaling history, RNG), or None."""
        return None

    def direction_quantizer(self, direction: str) -> "Quantizer":
        """The quantizer that makes ``direction`` (self for single-format quantizers)."""
        _check_direction(direction)
        return self

    def direction_state(self, state: Any, direction: str) -> Any:
        return state

    def advance_state(self, state: Any) -> None:
        """Start a new pass for ``state`` (delayed scaling: history → next scale)."""

    @property
    def is_per_tensor(self) -> bool:
        """True when a direction carries one scale for the whole tensor (amax must agree
        across shards before a quantized all-gather)."""
        return False

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        state: Any = None,
        amax: torch.Tensor | None = None,
    ):
        """Quantize ``x [*, K]`` into a :class:`QuantizedTensor` with the asked directions.

        ``amax``: a precomputed per-tensor amax (e.g. reduced over a process group) for
        per-tensor formats; ignored by formats without a per-tensor scale.
        """
        m, k = self.check_input(x, rowwise=rowwise, columnwise=columnwise)
        x2d = x.detach().reshape(m, k)
        row, col = self._quantize_2d_dispatch(
            x2d, rowwise=rowwise, columnwise=columnwise, state=state, amax=amax
        )
        return QuantizedTensor(x.shape, x.dtype, row, col, self)

    def quantize_storages(self, x2d, *, rowwise, columnwise, state=None, amax=None):
        """``quantize`` without the wrapper: ``(rowwise_storage, columnwise_storage)``.
        Asking for neither direction (e.g. a backward where only the bias needs a gradient)
        returns ``(None, None)`` without touching ``x2d`` or ``state``."""
        if not (rowwise or columnwise):
            return None, None
        self.check_input(x2d, rowwise=rowwise, columnwise=columnwise)
        return self._quantize_2d_dispatch(
            x2d.detach(), rowwise=rowwise, columnwise=columnwise, state=state, amax=amax
        )

    def check_input(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(
                f"{type(self).__name__}.quantize expects a floating-point tensor, got "
                f"{type(x).__name__} of dtype {getattr(x, 'dtype', None)}"
            )
        if x.dim() < 2:
            raise ValueError(
                f"{type(self).__name__}.quantize expects a tensor with at least 2 dims "
                f"([*, K]); got shape {tuple(x.shape)}. Reshape to [M, K] first."
            )
        if not (rowwise or columnwise):
            raise ValueError("quantize: ask for at least one of rowwise / columnwise")
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        # eager: shapes that passed once pass again (the quantizer is immutable), so the block
        # checks are skipped; while compiling the cache is neither read nor written (no guards)
        compiling = torch.compiler.is_compiling()
        checked = None if compiling else self.__dict__.get("_hd_checked_shapes")
        key = (m, k, rowwise, columnwise)
        if checked is not None and key in checked:
            return m, k
        for direction, wanted in zip(_DIRECTIONS, (rowwise, columnwise)):
            if wanted:
                self.direction_quantizer(direction).check_shape(m, k, direction)
        if not compiling:
            if checked is None or len(checked) > 256:
                checked = set()
                object.__setattr__(self, "_hd_checked_shapes", checked)  # a cache, not config
            checked.add(key)
        return m, k

    def check_shape(self, m: int, k: int, direction: str) -> None:
        bm, bk = self.block_shape(direction)
        for dim_name, size, mult in (("M (prod of leading dims)", m, bm), ("K (last dim)", k, bk)):
            if size % mult:
                raise ValueError(
                    f"{type(self).__name__} {direction}: dim {dim_name} has size {size}, "
                    f"which is not a multiple of the {mult} its blocks need. Pad that dim to "
                    f"a multiple of {mult} or choose another format for this tensor."
                )

    def _quantize_2d_dispatch(self, x2d, *, rowwise, columnwise, state, amax):
        impl = _kernel_registry.quantize_impl_for(self, x2d)
        if impl is not None:
            out = impl(self, x2d, rowwise=rowwise, columnwise=columnwise, state=state, amax=amax)
            if out is not NotImplemented:
                return out
        if x2d.is_cuda and self.FORMAT != "identity" and not torch.compiler.is_compiling():
            warn_once(f"{type(self).__name__}: no CUDA kernel serves this call ({x2d.dtype} input, "
                      f"rowwise={rowwise}, columnwise={columnwise}); using the pure-torch reference "
                      "(same numbers, slower). bf16 inputs take the fused kernels.")
        return self._quantize_2d(x2d, rowwise=rowwise, columnwise=columnwise, state=state, amax=amax)


def _check_direction(direction: str) -> None:
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}")


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 scalar max |x| (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().float()


def tensor_amaxes(xs: list[torch.Tensor]) -> torch.Tensor:
    """``[n]`` fp32: ``tensor_amax`` of each of ``xs`` (bitwise: a max is exact). On CUDA one
    launch per input dtype reads them all into one buffer (``_kernel_registry``'s
    ``amaxes_into``; no ``|x|`` temporary, no stacking), the amax kernel any it does not
    serve; elsewhere torch ops."""
    impl = _kernel_registry.amax_into_impl_for(xs[0]) if xs and not torch.compiler.is_compiling() else None
    if impl is None:
        return torch.stack([tensor_amax(x) for x in xs]) if xs else torch.zeros(0, dtype=torch.float32)
    out = torch.zeros(len(xs), dtype=torch.float32, device=xs[0].device)
    many = _kernel_registry.amaxes_into_impl_for(xs[0])
    for i in range(len(xs)) if many is None else many(xs, out):
        x = xs[i]
        if x.numel():
            x2d = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
            impl(x2d if x2d.stride(-1) == 1 else x2d.contiguous(), out[i])
    return out
