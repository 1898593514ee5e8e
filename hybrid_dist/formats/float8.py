"""Per-tensor FP8 (E4M3 or E5M2), current or delayed scaling.

Layout for a logical ``[M, K]`` tensor:

* rowwise    ``data`` fp8 ``[M, K]``, ``scale_inv`` fp32 ``[]``;
* columnwise ``data`` fp8 ``[K, M]`` = the exact transpose of rowwise (same scale).

Scale rules (``x_fp8 = sat(x · scale)``, ``x ≈ x_fp8 · scale_inv``, ``scale_inv = 1/scale``):

* current: ``scale = fp8_max / max(amax(x), amax_epsilon)``; amax 0 → scale 1; an
  overflowing scale clamps to fp32 max.
* delayed: ``scale`` comes from :class:`DelayedScalingState` — the max (or most recent) of
  the amax history, ``scale = fp8_max / amax / 2**margin``. Quantizing records ``amax(x)``
  into the current history slot as a running max (idempotent, so activation recompute
  leaves the state unchanged); ``advance()`` (called by the module once per pass) turns
  the history into the next scale and opens a new slot.
* ``power_of_2_scales``: scale rounded **down** to a power of two (exact dequantization
  of the scale itself).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybrid_dist._kernel_registry import delayed_advance_impl_for
from hybrid_dist.formats._quantizer import Quantizer, tensor_amax
from hybrid_dist.formats._storage import DirectionStorage, FieldAxes
from hybrid_dist.formats.numerics import FP8_MAX, cast_to_fp8, check_fp8_dtype, scale_from_amax
from hybrid_dist.library_op import library_op


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8Storage(DirectionStorage):
    """``data`` fp8 ``[R, C]``; ``scale_inv`` fp32 ``[]`` (shared by both directions)."""

    TENSOR_FIELDS = ("data", "scale_inv")
    FORMAT = "fp8"
    data: torch.Tensor
    scale_inv: torch.Tensor

    def field_axes(self) -> FieldAxes:
        return {"data": {"R": (0, 1), "C": (1, 1)}, "scale_inv": {}}

    def values(self, *, undo_rht: bool = True):
        return self.data.float()

    def tensor_scale(self):
        return self.scale_inv


class DelayedScalingState:
    """Amax history and current scale of one delayed-scaling tensor slot.

    ``amax_history[0]`` is the slot being filled this pass (running max); ``scale`` is the
    scale used now, computed by the last ``advance()`` from the older slots.
    """

    def __init__(self, history_len: int, device: torch.device | str | None = None):
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    def record(self, amax: torch.Tensor) -> None:
        self.to(amax.device)
        torch.maximum(self.amax_history[0], amax, out=self.amax_history[0])

    def advance(self, quantizer: "Float8Quantizer") -> None:
        """Compute the scale for the next pass from the history, then open a new slot."""
        impl = delayed_advance_impl_for(self.amax_history)
        if impl is not None:  # one launch, no host sync; an operator in compiled graphs
            impl(self.amax_history, self.scale, quantizer)
        else:
            self.advance_reference(quantizer)

    def advance_reference(self, quantizer: "Float8Quantizer") -> None:
        """``advance`` in torch ops (CPU, and the kernel's ground truth)."""
        hist = self.amax_history
        amax = hist.amax() if quantizer.amax_compute == "max" else hist[0]
        floored = torch.clamp(amax, min=quantizer.amax_epsilon)
        new_scale = _scale_from_amax(floored, quantizer, margin=quantizer.margin)
        # nothing recorded (amax 0) or a non-finite amax: keep the scale (test the raw amax,
        # not the epsilon-floored one, or an empty pass would set scale = fp8_max / eps)
        self.scale.copy_(torch.where(torch.isfinite(amax) & (amax > 0), new_scale, self.scale))
        self.amax_history.copy_(torch.roll(hist, 1))
        self.amax_history[:1].zero_()

    def to(self, device) -> "DelayedScalingState":
        if self.scale.device != torch.device(device):
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.amax_history, "scale": self.scale}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.amax_history.copy_(sd["amax_history"])
        self.scale.copy_(sd["scale"])


def stacked_delayed_states(states: "list[DelayedScalingState]", device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(history [E, L], scale [E])`` on ``device`` whose rows are the ``E`` states' own
    tensors, so one op records, reads or advances them all (``moe.GroupedLinear``'s
    per-expert states). The first call, or one after a state's tensors were replaced
    (``to()``), copies them into new stacked buffers and points each state at its rows;
    the states keep their API and checkpoints (``load_state_dict`` copies in place)."""
    hist0, scale0 = states[0].amax_history, states[0].scale
    hist, scale = hist0._base, scale0._base
    if (isinstance(hist, torch.Tensor) and isinstance(scale, torch.Tensor) and hist.device == torch.device(device)
            and hist.dim() == 2 and hist.shape[0] == len(states) and scale.shape == (len(states),)
            and all(s.amax_history._base is hist and s.amax_history.data_ptr() == hist[i].data_ptr()
                    and s.scale._base is scale and s.scale.data_ptr() == scale[i].data_ptr()
                    for i, s in enumerate(states))):
        return hist, scale
    hist = torch.stack([s.amax_history.to(device) for s in states])
    scale = torch.stack([s.scale.to(device) for s in states])
    for i, s in enumerate(states):
        s.amax_history, s.scale = hist[i], scale[i]
    return hist, scale


def advance_stacked(states: "list[DelayedScalingState]", quantizer: "Float8Quantizer") -> None:
    """``advance`` every state: one launch on CUDA (``kernels.fp8.delayed``); while compiling,
    one operator call per state; on the CPU each in torch."""
    hist = states[0].amax_history
    impl = None if torch.compiler.is_compiling() else delayed_advance_impl_for(hist)
    if impl is not None:
        impl(*stacked_delayed_states(states, hist.device), quantizer)
    else:  # traced: stacking would rebind the states' tensors; each state's own advance
        for s in states:
            s.advance(quantizer)


def _scale_from_amax(amax: torch.Tensor, q: "Float8Quantizer", margin: int = 0) -> torch.Tensor:
    return scale_from_amax(amax, FP8_MAX[q.dtype], margin=margin, pow2=q.power_of_2_scales)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8Quantizer(Quantizer):
    """Per-tensor FP8. ``scaling="current"`` or ``"delayed"`` (state from ``make_state``)."""

    FORMAT: ClassVar[str] = "fp8"
    PRECISION_RANK: ClassVar[int] = 2
    dtype: torch.dtype = torch.float8_e4m3fn
    scaling: str = "current"
    power_of_2_scales: bool = False
    amax_epsilon: float = 0.0
    amax_history_len: int = 16
    margin: int = 0
    amax_compute: str = "max"

    def __post_init__(self):
        check_fp8_dtype(self.dtype)
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"scaling must be 'current' or 'delayed', got {self.scaling!r}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")
        if self.amax_history_len < 1 or self.amax_epsilon < 0 or self.margin < 0:
            raise ValueError(
                "amax_history_len must be >= 1, amax_epsilon >= 0 and margin >= 0; got "
                f"{self.amax_history_len}, {self.amax_epsilon}, {self.margin}"
            )

    @property
    def is_per_tensor(self) -> bool:
        return True

    def block_shape(self, direction):
        return (1, 1)

    def make_state(self):
        return DelayedScalingState(self.amax_history_len) if self.scaling == "delayed" else None

    def advance_state(self, state) -> None:
        if isinstance(state, DelayedScalingState):
            state.advance(self)

    def compute_scale(self, x: torch.Tensor, state, amax: torch.Tensor | None) -> torch.Tensor:
        """The fp32 scale this call uses (records the amax into a delayed state)."""
        amax = tensor_amax(x) if amax is None else amax.float().to(x.device)
        if self.scaling == "delayed":
            if not isinstance(state, DelayedScalingState):
                raise ValueError(
                    "Float8Quantizer(scaling='delayed').quantize needs state=quantizer."
                    f"make_state() (the amax history); got {type(state).__name__}"
                )
            state.record(amax)
            return state.scale.clone()
        return _scale_from_amax(torch.clamp(amax, min=self.amax_epsilon), self)

    def _quantize_2d(self, x, *, rowwise, columnwise, state, amax):
        scale = self.compute_scale(x, state, amax)
        data = cast_to_fp8(x.float() * scale, self.dtype)
        scale_inv = torch.reciprocal(scale)
        row = Float8Storage(data=data, scale_inv=scale_inv, transposed=False) if rowwise else None
        col = None
        if columnwise:
            col = Float8Storage(data=transposed_fp8(data), scale_inv=scale_inv, transposed=True)
        return row, col


@library_op("hybrid_dist::fp8_transpose")
def _fp8_transpose_op(data: torch.Tensor) -> torch.Tensor:
    return data.t().contiguous()


@_fp8_transpose_op.register_fake
def _(data):
    return data.new_empty(data.shape[1], data.shape[0])


def transposed_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.t().contiguous()`` of 2-D fp8 data. While compiling, an opaque op: inductor's
    vectorized CPU code fuses an fp8 cast into a transposed store of a slice of a larger
    tensor wrongly (NaNs, torch 2.13), so the cast is stored rowwise first and moved here."""
    if torch.compiler.is_compiling():
        return _fp8_transpose_op(data)
    return data.t().contiguous()

