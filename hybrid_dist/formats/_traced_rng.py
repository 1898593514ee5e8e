"""Draws from a quantizer state's ``torch.Generator`` that ``torch.compile`` can trace.

Dynamo cannot trace a ``torch.Generator``. While compiling, a state's draws go through the
opaque ``torch.library`` op ``hybrid_dist::state_rand`` instead: at run time it looks the
state up by its id and draws from the state's own generator exactly as eager does, so a
compiled step consumes the same random stream as an eager one (bitwise the same numbers).
``draw`` (an index per call site) keeps two draws of one shape distinct for graph passes
that merge identical calls. The op also hands out an ``NVFP4State``'s CUDA-kernel Philox key
(``kind="key"``: a copy, the live key advanced), so compiled and eager steps walk the same keys.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_LIVE: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # uid -> state
_NEXT = itertools.count()


def register(state) -> int:
    """A process-unique id for ``state`` (which must have ``generator(device)``)."""
    uid = next(_NEXT)
    _LIVE[uid] = state
    return uid


def _draw(like: torch.Tensor, uid: int, draw: int, shape: list[int], kind: str) -> torch.Tensor:
    return _draw_from(_LIVE[uid], like, shape, kind)


def _draw_from(state, like: torch.Tensor, shape, kind: str) -> torch.Tensor:
    if kind == "key":  # the CUDA kernels' Philox key (advanced in place; see NVFP4State)
        return state.take_kernel_key(like.device)
    return torch.rand(shape, device=like.device, generator=state.generator(like.device))


@torch.library.custom_op("hybrid_dist::state_rand", mutates_args=())
def _state_rand_op(like: torch.Tensor, uid: int, draw: int, shape: list[int], kind: str) -> torch.Tensor:
    """``torch.rand(shape)`` (fp32, ``kind="rand"``) on ``like``'s device from state ``uid``'s
    generator, or (``kind="key"``, ``shape`` ``[1]``) a copy of the state's kernel Philox key,
    the live key advanced (int64; see ``NVFP4State``)."""
    return _draw(like, uid, draw, shape, kind)


@_state_rand_op.register_fake
def _(like, uid, draw, shape, kind):
    return like.new_empty(shape, dtype=torch.float32 if kind == "rand" else torch.int64)


def state_rand(state, like: torch.Tensor, shape, *, draw: int, kind: str = "rand") -> torch.Tensor:
    """Draw from ``state`` (``kind`` as in ``_state_rand_op``): directly in eager, through the
    op while compiling."""
    if torch.compiler.is_compiling():
        if state.uid is None:
            raise RuntimeError(
                "a stochastic-rounding quantizer state was created inside torch.compile; create "
                "it before compiling (give hd.Linear its recipe= at construction, or run one "
                "eager forward first)")
        return _state_rand_op(like, state.uid, draw, list(shape), kind)
    return _draw_from(state, like, shape, kind)
