"""The operands an expert-parallel exchange hands its GroupedLinear outside autograd.

``ExchangeIO`` holds the received rows (``"x_quantized"`` / ``"x_packed"``), the gradient
the combine's backward fills before the last GroupedLinear's backward runs
(``"dy_quantized"`` / ``"dy_packed"``), the packed path's marker (``"packed"``) and the
route's packed index (``"index"``, ``packed_index.IndexCache``: one per layer and step).

It is deliberately not a ``dict``, dataclass or tuple: module hooks that rebuild their
forward arguments (FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` walks
dicts, lists and dataclasses and casts every floating tensor to ``param_dtype``) must pass
it through untouched. A rebuilt copy would cast the FP8 codes to the compute dtype and
leave the original, which the combine's backward fills, unseen by the expert layer.
"""

from __future__ import annotations

from typing import Any


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
