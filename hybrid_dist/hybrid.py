"""``HybridQuantizer``: each direction of a tensor in its own format.

``HybridQuantizer(rowwise=A, columnwise=B).quantize(x)`` returns one
:class:`QuantizedTensor` whose rowwise direction is exactly ``A``'s and whose columnwise
direction is exactly ``B``'s (so docs/design.md §4 invariants 1–2 hold by construction). When
``A == B`` the single quantizer's fused path makes both directions from one read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_dist.formats._quantizer import Quantizer, _check_direction
from hybrid_dist.formats.float8 import Float8Quantizer


@dataclasses.dataclass(frozen=True)
class HybridState:
    """Per-direction states of a hybrid slot (either may be None)."""

    rowwise: Any
    columnwise: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridQuantizer(Quantizer):
    """Rowwise (fprop) direction from ``rowwise``, columnwise (backward) from ``columnwise``."""

    FORMAT = "hybrid"
    rowwise: Quantizer
    columnwise: Quantizer

    def __post_init__(self):
        for name in ("rowwise", "columnwise"):
            sub = getattr(self, name)
            if not isinstance(sub, Quantizer) or isinstance(sub, HybridQuantizer):
                raise ValueError(
                    f"HybridQuantizer({name}=...) must be a single-format quantizer "
                    f"(Float8Quantizer, MXFP8Quantizer, ...); got {type(sub).__name__}"
                )

    @property
    def same_format(self) -> bool:
        return self.rowwise == self.columnwise

    @property
    def PRECISION_RANK(self) -> int:  # noqa: N802 - mirrors the class attribute of formats
        return max(self.rowwise.PRECISION_RANK, self.columnwise.PRECISION_RANK)

    @property
    def is_per_tensor(self) -> bool:
        return self.rowwise.is_per_tensor or self.columnwise.is_per_tensor

    def direction_quantizer(self, direction: str) -> Quantizer:
        _check_direction(direction)
        return getattr(self, direction)

    def direction_state(self, state: Any, direction: str) -> Any:
        if state is None:
            return None
        if self.same_format and not isinstance(state, HybridState):
            return state
        return getattr(state, direction)

    def advance_state(self, state) -> None:
        if state is None:
            return
        if self.same_format and not isinstance(state, HybridState):
            self.rowwise.advance_state(state)
            return
        self.rowwise.advance_state(state.rowwise)
        self.columnwise.advance_state(state.columnwise)

    def block_shape(self, direction):
        return self.direction_quantizer(direction).block_shape(direction)

    def make_state(self):
        if self.same_format:
            return self.rowwise.make_state()
        row, col = self.rowwise.make_state(), self.columnwise.make_state()
        return None if row is None and col is None else HybridState(row, col)

    def _quantize_2d_dispatch(self, x2d, *, rowwise, columnwise, state, amax):
        if self.same_format:
            return self.rowwise._quantize_2d_dispatch(
                x2d, rowwise=rowwise, columnwise=columnwise, state=state, amax=amax
            )
        row = col = None
        if rowwise:
            row, _ = self.rowwise._quantize_2d_dispatch(
                x2d, rowwise=True, columnwise=False,
                state=self.direction_state(state, "rowwise"), amax=amax,
            )
        if columnwise:
            _, col = self.columnwise._quantize_2d_dispatch(
                x2d, rowwise=False, columnwise=True,
                state=self.direction_state(state, "columnwise"), amax=amax,
            )
        return row, col

    def _quantize_2d(self, x, *, rowwise, columnwise, state, amax):  # pragma: no cover
        raise AssertionError("HybridQuantizer dispatches per direction")


def stateless(q: Quantizer) -> Quantizer:
    """A quantizer that needs no state: delayed FP8 scaling becomes current scaling (in
    each direction of a hybrid)."""
    if isinstance(q, HybridQuantizer):
        return HybridQuantizer(rowwise=stateless(q.rowwise), columnwise=stateless(q.columnwise))
    if isinstance(q, Float8Quantizer) and q.scaling == "delayed":
        return dataclasses.replace(q, scaling="current")
    return q
