"""Draws from a quantizer state's randomness that ``torch.compile`` can trace, with no
per-state constant in the graph (so one compiled block serves every block alike).

* ``kind="key"`` (the CUDA kernels' Philox key, an int64 ``[1]`` tensor of the state):
  traced as torch ops on the live key — a copy is returned, the key is advanced in place
  (an input mutation, as a delayed-scaling amax history is) — so compiled and eager steps
  walk the same keys.
* ``kind="rand"`` (``torch.rand`` from the state's ``torch.Generator``, which Dynamo cannot
  trace): the opaque ``torch.library`` op ``hybrid_dist::state_rand``. The state travels
  as its id in a CPU int64 tensor (a graph input, not a constant); at run time the op
  looks the state up and draws from its generator exactly as eager does. ``draw`` (an
  index per call site) keeps two draws of one shape distinct for passes that merge
  identical calls.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from hybrid_dist.library_op import library_op

_LIVE: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # uid -> state
_NEXT = itertools.count()


def register(state) -> torch.Tensor:
    """A process-unique id for ``state`` (which must have ``generator(device)``), as a CPU
    int64 scalar tensor (what a traced draw passes to the op)."""
    uid = next(_NEXT)
    _LIVE[uid] = state
    return torch.tensor(uid, dtype=torch.int64, device="cpu")  # explicit: also under a CUDA default device


def registered_state(uid: torch.Tensor):
    """The live state whose id (``register``) ``uid`` holds; what an opaque op that draws
    from a state's generator at run time looks up."""
    return _LIVE[int(uid)]


def _draw_from(state, like: torch.Tensor, shape) -> torch.Tensor:
    return torch.rand(shape, device=like.device, generator=state.generator(like.device))


@library_op("hybrid_dist::state_rand")
def _state_rand_op(like: torch.Tensor, uid: torch.Tensor, draw: int, shape: list[int]) -> torch.Tensor:
    """``torch.rand(shape)`` (fp32) on ``like``'s device from the generator of the state
    whose id ``uid`` holds."""
    return _draw_from(registered_state(uid), like, shape)


@_state_rand_op.register_fake
def _(like, uid, draw, shape):
    return like.new_empty(shape, dtype=torch.float32)


def state_rand(state, like: torch.Tensor, shape, *, draw: int, kind: str = "rand") -> torch.Tensor:
    """``kind="rand"``: ``torch.rand(shape)`` from ``state``'s generator on ``like``'s
    device. ``kind="key"``: a copy of the state's kernel Philox key on that device, the
    live key advanced. Eager and compiled draw the same numbers (module doc)."""
    if kind == "key":
        return state.take_kernel_key(like.device)
    if torch.compiler.is_compiling():
        if state.uid is None:
            raise RuntimeError(
                "a stochastic-rounding quantizer state was created inside torch.compile; create "
                "it before compiling (give hd.Linear its recipe= at construction, or run one "
                "eager forward first)")
        return _state_rand_op(like, state.uid, draw, list(shape))
    return _draw_from(state, like, shape)
