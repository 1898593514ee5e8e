"""``kernel_op``: a ``torch.library`` operator over Triton kernels that inductor traces into.

A ``torch.library.triton_op`` is decomposed when AOTAutograd functionalizes a graph: each
kernel its body launches through ``traced_launch`` (``wrap_triton``) becomes a node that
inductor emits as a direct launch in its generated code, next to the allocations of the
body's outputs, so a compiled graph pays neither a dispatcher call nor a Python wrapper per
call (the FP8 cast: 20 µs of host time per call against 65 µs as a ``library_op``, one
profiled 1b step on a 2×H200 host). The kernel, its arguments and its constexprs are the
eager path's, so the bytes are the same.

The Triton interpreter's kernels cannot be traced by ``wrap_triton`` (it runs them on fake
tensors), so under ``TRITON_INTERPRET=1`` the same function is registered as a
``library_op`` with the given fake implementation, and ``traced_launch`` launches directly.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.library import triton_op, wrap_triton

from hybrid_dist.kernels._jit_common import INTERPRET
from hybrid_dist.library_op import library_op


def traced_launch(kernel, grid: tuple[int, ...], *args, **consts) -> None:
    """``kernel[grid](*args, **consts)`` as a launch a ``kernel_op`` body may trace."""
    wrap_triton(kernel)[grid](*args, **consts)


def traced_empty_f32(device: torch.device) -> torch.Tensor:
    """An uninitialized fp32 scalar ``[]`` for a ``kernel_op`` body's kernel to write: a view
    of a ``[1]`` buffer. Inductor lowers ``empty`` to a buffer with no kernel by giving each
    dimension an empty range; a 0-d tensor has no dimension, so a 0-d ``empty`` becomes a
    one-element fill kernel, launched once per call of the op (torch 2.11 to 2.13)."""
    return torch.empty(1, dtype=torch.float32, device=device).view(())


def kernel_op(qualname: str, *, mutates_args: Iterable[str] = (), fake: Callable) -> Callable:
    """Decorator: register ``fn`` (its kernels launched through ``traced_launch``) as the
    operator ``qualname``, a ``triton_op`` (see the module note); ``fake`` is used only
    under the interpreter. Returns the operator (call it like ``fn``)."""
    mutates_args = tuple(mutates_args)

    def register(fn: Callable):
        if INTERPRET.value:
            op = library_op(qualname, mutates_args=mutates_args)(fn)
            op.register_fake(fake)
            return op
        return triton_op(qualname, mutates_args=mutates_args)(fn)

    return register


__all__ = ["kernel_op", "traced_empty_f32", "traced_launch"]
