"""The operands an expert-parallel exchange hands its GroupedLinear outside autograd.

``ExchangeIO`` holds the received rows (``"x_quantized"`` / ``"x_packed"``), the gradient
the combine's backward fills before the last GroupedLinear's backward runs
(``"dy_quantized"`` / ``"dy_packed"``), the packed path's marker (``"packed"``), the
route's packed index (``"index"``, ``packed_index.IndexCache``: one per layer and step)
and the dispatch's early sender of the first GroupedLinear's input gradient
(``"dx_sender"``, ``hand_off_input_grad``).

It is deliberately not a ``dict``, dataclass or tuple: module hooks that rebuild their
forward arguments (FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` walks
dicts, lists and dataclasses and casts every floating tensor to ``param_dtype``) must pass
it through untouched. A rebuilt copy would cast the FP8 codes to the compute dtype and
leave the original, which the combine's backward fills, unseen by the expert layer.
"""

from __future__ import annotations

from typing import Any

import torch


class ExchangeIO:
    """A small mapping from slot name to operand, opaque to argument-walking hooks."""

    __slots__ = ("_slots",)

    def __init__(self, **slots: Any):
        self._slots = dict(slots)

    def get(self, key: str, default: Any = None) -> Any:
        return self._slots.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._slots[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._slots[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __repr__(self) -> str:
        return f"ExchangeIO({', '.join(self._slots)})"


def carries_operands(io: ExchangeIO | None) -> bool:
    """Whether ``io`` is an exchange's (operands received, or to be filled before the
    backward: a ``combine_io``), not only the early sender of a high-precision dispatch."""
    return io is not None and len(io) > ("dx_sender" in io)


def input_grad_sender(io: ExchangeIO | None):
    """The dispatch's early sender of the first GroupedLinear's input gradient in ``io``
    (``"dx_sender"``, set by ``expert_parallel.dispatch``), or None. A layer's forward keeps
    it (not ``io``, whose received rows it need not hold) for ``hand_off_input_grad``."""
    return io.get("dx_sender") if io is not None else None


def hand_off_input_grad(sender, dx: torch.Tensor | None) -> torch.Tensor | None:
    """For a GroupedLinear's backward once its dgrad ``dx`` is computed, before its wgrad:
    with an early ``sender`` (``input_grad_sender``), give it ``dx``, whose all-to-all back
    to the slots then runs during the wgrad GEMM, and return what autograd carries in its
    place (broadcast zeros: the dispatch's backward takes the exchanged rows from the
    sender); without one, ``dx`` itself."""
    if sender is None or dx is None:
        return dx
    sender.send(dx)
    return dx.new_zeros(()).expand(dx.shape)
